"""Where a consumer's store lives: one store per node, shared by its ranks, or one per rank.

The one place the cache's ``scope`` is decided (``docs/ARCHITECTURE.md``, "Epoch plan"), once, at
construction, before anything is written. ``"node"`` needs three things:

* ranks that *can* write one store together: a backend that says so
  (:attr:`cachestore.backends.base.Backend.supports_shared_write`), ``cache_setting["shared"]``,
  and workers that write and read back the node's staging area themselves (an executor whose
  ``writes_local_store`` is true: not Ray's actors; a stream's samples are written by the rank
  that takes them from its copies, so its workers may be Ray actors);
* the ``"equal"`` partition (``"contiguous"`` runs are pinned per consumer);
* ranks of a node whose datasets are the same: one store has one producer (its fingerprint).
  Ranks whose ``dataset_params`` hold a per-rank value (a log path with the rank in it, a
  per-rank file list) each have a fingerprint of their own, and two producers on one store
  fail. The ranks compare their fingerprints (:func:`loader.distributed.gather_across_ranks`)
  and, when the ranks of any node differ, every rank keeps a store of its own - all of them,
  so that the data stays split the same way on every rank - and says so in one log line.
  Ranks that cannot compare (consumers given by hand, no ``torch.distributed``) share the node
  store as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import replace

from cachestore.backends import get_backend

from ..dataset import DatasetSource
from ..distributed import ConsumerLayout, gather_across_ranks, ranks_per_node
from ..errors import RankFailedError
from ..remote_setting import node_of
from ..executors.host import executor_class
from ..settings import CacheSettings, LoaderSettings
from .fingerprint import dataset_fingerprint
from .mismatch import describe_mismatch, describe_params

log = logging.getLogger(__name__)


def write_together(cache: CacheSettings, executor: str, stream: bool = False) -> str | None:
    """Why the ranks of a node cannot write one store together, ``None`` when they can. A stream's
    samples are written by the rank that takes them from its copies (``loader.cache.stream_ranks``), so its
    workers may run anywhere; a map-style dataset's workers write the node's staging area themselves."""
    if not get_backend(cache.backend).supports_shared_write:
        return f"the {cache.backend!r} backend does not support writing together"
    if cache.shared is not True:
        return "shared=False"
    if not stream and not executor_class(executor).writes_local_store:
        return f"the {executor!r} executor's workers do not write this machine's store"
    return None


def decide_scope(settings: LoaderSettings, num_samples: int) -> LoaderSettings:
    """`settings` with the cache's ``scope`` decided (see the module docstring); unchanged without a cache.

    Under ``torch.distributed`` every rank must call this at the same point (the loader's
    constructor): the ranks compare their datasets with one collective call.

    Raises
    ------
    ValueError
        ``scope="node"`` was asked for ranks that cannot share a store, or the ranks' streams cannot
        be cached in one (it says why).
    """
    cache, consumers = settings.cache, settings.nb_consumer
    if cache is None or (cache.scope == "rank" and not (settings.dataset.stream and consumers > 1)):
        return settings
    why_not = "scope='rank'" if cache.scope == "rank" else write_together(cache, settings.executor,
                                                                                 settings.dataset.stream)
    if why_not is None and settings.partition != "equal":
        why_not = f"partition={settings.partition!r} keeps each consumer's part in a store of its own"
    if why_not is None and consumers > 1 and not settings.deferred_start:
        why_not = _differing_ranks(settings, num_samples)
    if why_not is None:
        return replace(settings, cache=_node_remote(replace(cache, scope="node"), settings))
    if settings.dataset.stream and consumers > 1:
        # A stream has no indices to split between stores of their own: the node's ranks write one generation.
        raise ValueError(f"a cache of an iterable dataset is written by the {consumers} ranks of the node together, "
                         f"which they cannot here: {why_not}. They need the node scope: a backend that writes "
                         "together (memmap), partition='equal' and the same stream on every rank (split the work by "
                         "rank inside __iter__, or give cache_setting['fingerprint'])")
    if cache.scope == "node" and consumers > 1:
        raise ValueError(f"cache_setting['scope']='node' has the {consumers} ranks of a node write one store "
                         f"together, which they cannot here: {why_not}. Use scope='rank' (a store per rank) or "
                         "leave scope out to have it chosen")
    return replace(settings, cache=replace(cache, scope="rank"))


def several_nodes(settings: LoaderSettings) -> bool:
    """Whether the consumers are torchrun's ranks on several nodes."""
    return ranks_per_node(settings.nb_consumer) != settings.nb_consumer


def _node_remote(cache: CacheSettings, settings: LoaderSettings) -> CacheSettings:
    """`cache` with a stream's remote on several nodes made the node's own (``<remote>/node-<k>-of-<m>``):
    each node's store holds its own ranks' streams (its generations are not the other nodes'), so each
    publishes and fetches its own."""
    if cache.remote is None or not settings.dataset.stream or not several_nodes(settings):
        return cache
    local = ranks_per_node(settings.nb_consumer)
    node, nodes = settings.consumer_index // local, settings.nb_consumer // local
    return replace(cache, remote=f"{str(cache.remote).rstrip('/')}/node-{node}-of-{nodes}")


def consumer_layout(settings: LoaderSettings, num_samples: int) -> ConsumerLayout:
    """This consumer's part of a dataset of `num_samples` (its scope decided): with a remote and the node
    scope, every node's store holds the whole dataset (``ConsumerLayout.whole``)."""
    s, cache = settings, settings.cache
    # A remote makes every node's store hold the whole dataset (nodes compute parts), but for a stream
    # on several nodes, whose nodes each hold their own ranks' streams (see _node_remote).
    whole = (cache is not None and cache.remote is not None and cache.scope == "node"
             and not (s.dataset.stream and several_nodes(s)))
    node = node_of(cache.nb_node, cache.node_rank, s.nb_consumer) if whole and cache is not None else None
    return ConsumerLayout(num_samples, s.nb_consumer, s.consumer_index, s.seed,
                          pinned=cache is not None or not s.shuffle, scheme=s.partition,
                          workers=s.nb_worker, shuffled=s.shuffle,
                          node_scope=cache is not None and cache.scope == "node", whole=whole, node=node,
                          even=s.even_ranks)


def _differing_ranks(settings: LoaderSettings, num_samples: int) -> str | None:
    """Why the node's ranks cannot share a store because their datasets differ (one log line says so),
    ``None`` when they are the same on every node or cannot be compared."""
    assert settings.cache is not None
    layout = consumer_layout(replace(settings, cache=replace(settings.cache, scope="node")), num_samples)
    mine = _identity(settings.dataset, num_samples, layout, settings.cache.fingerprint)
    everyone = gather_across_ranks(mine, settings.nb_consumer, settings.consumer_index, settings.cache.prefix)
    if everyone is None:
        return None
    by_node: dict[int, list[tuple[int, dict]]] = {}
    for rank, identity in enumerate(everyone):
        if not isinstance(identity, dict) or not isinstance(identity.get("params"), dict) \
                or "fingerprint" not in identity:
            raise RankFailedError(f"rank {rank} answered {str(identity)[:80]!r}, not a dataset's identity: its "
                                  f"file under {settings.cache.prefix} was not written by a rank of this job")
        by_node.setdefault(rank // layout.local_ranks, []).append((rank, identity))
    for node, ranks in sorted(by_node.items()):
        first_rank, first = ranks[0]
        other = next(((r, i) for r, i in ranks if i["fingerprint"] != first["fingerprint"]), None)
        if other is None:
            continue
        why = (f"the datasets of ranks {first_rank} and {other[0]} (node {node}) differ: "
               f"{_difference(first, other[1])}")
        if settings.cache.scope is None:
            log.warning("%s, so they cannot share the node's store: every rank keeps its own, under %s/"
                        "consumer-<rank>-of-%d (scope='rank')", why, settings.cache.prefix, settings.nb_consumer)
        return why
    return None


def _identity(dataset: DatasetSource, num_samples: int, layout: ConsumerLayout,
              explicit: str | None) -> dict[str, object]:
    """What a rank's node store would record of it: its fingerprint, and a hash of each dataset parameter
    (so that a log line can name the parameters that differ)."""
    fingerprint = dataset_fingerprint(dataset, num_samples, layout.store_owner, explicit)
    params = {key: hashlib.sha256(json.dumps(value, sort_keys=True).encode()).hexdigest()[:16]
              for key, value in describe_params(dataset.params).items()}
    return {"fingerprint": fingerprint, "params": params}


def _difference(a: dict, b: dict) -> str:
    """The dataset parameters two identities differ in, in words (else the parts of their fingerprints)."""
    names = sorted(k for k in set(a["params"]) | set(b["params"]) if a["params"].get(k) != b["params"].get(k))
    if names:
        return f"dataset_params {', '.join(map(repr, names))} differ"
    return describe_mismatch(a["fingerprint"], b["fingerprint"]).replace("changed", "differs")
