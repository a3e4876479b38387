"""How the data is split between consumers (ranks), and what ``torch.distributed`` says about this one."""

from __future__ import annotations

import hashlib
import itertools
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from cachestore.errors import MalformedFileError
from cachestore.guard.safefs import require_real_dir, write_json_atomic, write_new
from cachestore.guard.trust import OWN
from cachestore.guard.untrusted import read_document

from .errors import RanksTimeoutError

#: Seconds the ranks of a torchrun job without ``torch.distributed`` wait for each other's files.
RENDEZVOUS_TIMEOUT = 300.0
#: Seconds between looks at the rendezvous directory (processes of one job, no event to wait on).
RENDEZVOUS_POLL = 0.02
_rendezvous_count = itertools.count()
#: The bytes a rank's file may take (its dataset's fingerprint and a hash per parameter).
RANK_FILE_BYTES = 4 << 20


def distributed_defaults() -> tuple[int, int]:
    """World size and rank when torch.distributed is initialised, else (1, 0)."""
    # Only a process that imported torch.distributed can have initialised it:
    # importing torch here would cost a second for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0


def gather_across_ranks(value: Any, nb_consumer: int, consumer_index: int, prefix: str) -> list[Any] | None:
    """Every consumer's `value` (JSON-able), in consumer order; ``None`` when the consumers cannot compare.

    The consumers must be the job's ranks: ``torch.distributed``'s, compared with one
    ``all_gather_object`` on the default group (every rank calls this at the same point, the
    loader's constructor); else, under torchrun on one machine, through files in `prefix`
    (:func:`_gather_by_files`). Consumers given by hand cannot compare.
    """
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        if dist.get_world_size() != nb_consumer or dist.get_rank() != consumer_index:
            return None  # these consumers are not the group's ranks
        everyone: list[Any] = [None] * nb_consumer
        dist.all_gather_object(everyone, value)
        return everyone
    env = os.environ
    if (env.get("TORCHELASTIC_RUN_ID") and env.get("WORLD_SIZE") == str(nb_consumer)
            and env.get("LOCAL_WORLD_SIZE") == str(nb_consumer) and env.get("RANK") == str(consumer_index)):
        return _gather_by_files(value, nb_consumer, consumer_index, prefix)
    return None


def _gather_by_files(value: Any, ranks: int, rank: int, prefix: str) -> list[Any] | None:
    """`value` of each of torchrun's `ranks` on this machine, exchanged through a directory in `prefix`.

    The directory is named after torchrun's run id, its restart count and how many loaders this
    process compared before (ranks construct their loaders in the same order), so a new run, a
    restart or a second loader never reads an old answer. Each rank writes its file atomically,
    waits for the others', then marks that it read them; the last to mark removes the directory.
    ``None`` where the prefix cannot be written (nothing can be compared, nothing will be written).

    Raises
    ------
    RanksTimeoutError
        A rank did not arrive within :data:`RENDEZVOUS_TIMEOUT` seconds.
    """
    key = f"{os.environ.get('TORCHELASTIC_RUN_ID')}-{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}-" \
          f"{next(_rendezvous_count)}"
    where = Path(prefix) / f".ranks-{hashlib.sha256(key.encode()).hexdigest()[:16]}"
    try:
        where.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None
    check_rendezvous(where)
    try:
        write_json_atomic(where / f"rank-{rank}.json", {"value": value})
    except OSError:
        return None
    deadline = time.monotonic() + RENDEZVOUS_TIMEOUT
    everyone: list[Any] = [None] * ranks
    missing = set(range(ranks))
    while missing:
        for r in sorted(missing):
            doc = read_rank_file(where / f"rank-{r}.json")
            if doc is not None:
                everyone[r] = doc
                missing.discard(r)
        if missing and time.monotonic() > deadline:
            raise RanksTimeoutError(f"ranks {sorted(missing)} of this torchrun job did not construct their loader "
                                    f"within {RENDEZVOUS_TIMEOUT:.0f} s (the ranks compare their datasets in {where}): "
                                    "every rank constructs its loader, or initialise torch.distributed first")
        if missing:
            time.sleep(RENDEZVOUS_POLL)
    write_new(where / f"read-{rank}", b"")
    if sum(1 for p in where.iterdir() if p.name.startswith("read-")) == ranks:
        shutil.rmtree(where, ignore_errors=True)
    return everyone


def check_rendezvous(where: Path) -> None:
    """Refuse a rendezvous directory that is not this user's own: in a prefix others can write, one
    made (or swapped in) by another user would let them answer for a rank, or have the ranks write
    through a symlink (see :mod:`cachestore.guard.trust`).

    Raises
    ------
    CacheStoreError
        :class:`~cachestore.errors.SymlinkError` or :class:`~cachestore.errors.UntrustedOwnerError`
        naming `where` (a co-tenant's directory is nobody's rendezvous).
    """
    require_real_dir(where, "the ranks' rendezvous")
    OWN.check(where, os.lstat(where), "the ranks' rendezvous")


def read_rank_file(path: Path) -> Any:
    """The value a rank wrote into `path`, ``None`` while there is none (each is written whole, renamed in).

    Raises
    ------
    CacheStoreError
        Naming `path`: a symlink, a FIFO, another user's file, or not what a rank writes
        (:class:`~cachestore.errors.MalformedFileError`).
    """
    try:
        doc = read_document(path, "a rank's file", RANK_FILE_BYTES, OWN)
    except FileNotFoundError:
        return None
    if not isinstance(doc, dict) or set(doc) != {"value"}:
        raise MalformedFileError(f"{path} is not what a rank writes (a JSON object with one 'value'); "
                                 "remove it and start the job again")
    return doc["value"]


#: How the data is split between consumers (the ``partition`` argument).
PARTITIONS = ("equal", "contiguous")


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    """Batches of `n` samples: the last one short, or dropped with `drop_last`."""
    return n // batch_size if drop_last else -(-n // batch_size)


def rank_batch_count(n: int, ranks: int, batch_size: int, drop_last: bool, even: bool = False) -> int:
    """Batches each of `ranks` ranks serves when they split an order of `n` samples
    (:func:`loader.epochs.order.rank_batches`): the most samples a rank gets, or the fewest with `drop_last`
    or `even` (each rank serves ``n // ranks``, as ``DistributedSampler(drop_last=True)``)."""
    return num_batches(n // ranks if drop_last or even else -(-n // ranks), batch_size, drop_last)


def ranks_per_node(nb_consumer: int) -> int:
    """How many of the `nb_consumer` consumers run on each machine: torchrun's ``LOCAL_WORLD_SIZE``
    when it names an even split of them, else all of them (one node)."""
    local = os.environ.get("LOCAL_WORLD_SIZE", "")
    if local.isdigit() and 0 < int(local) <= nb_consumer and nb_consumer % int(local) == 0:
        return int(local)
    return nb_consumer


class ConsumerLayout:
    """The part of the dataset one consumer serves.

    Two schemes (the loader's ``partition`` argument):

    * ``"equal"`` (default): every consumer gets ``ceil(N / n)`` samples, every
      n-th index of a permutation padded by wrapping around, so every rank sees as
      many batches (what ``DistributedSampler`` does). With shuffling and no cache
      the permutation changes every epoch. With a cache and `node_scope` (the
      cache's ``scope="node"``), the store holds the node's part (every m-th index
      on node k of m, all of it on one node), which its ranks deal anew every epoch
      (:func:`loader.epochs.order.node_deck`); with ``scope="rank"`` a cache pins
      each consumer's part (its own store holds it).
    * ``"contiguous"`` (``swift_loader``'s): consumer ``c`` gets a contiguous run.
      Without shuffling it is ``[c*S, min((c+1)*S, N))`` with ``S = ceil(N / n)``,
      the last consumers shorter, never padded. With shuffling each consumer's run
      is made of one window per worker, ``ws = ceil(N / (n*W))`` samples each,
      which all move by ``ws`` every epoch (cyclically), so the runs stay disjoint
      and cover the data; a cache pins them at their epoch-0 place.

    Parameters
    ----------
    num_samples
        Length of the dataset.
    nb_consumer, consumer_index
        How many consumers, and which one this is.
    seed
        Seed of the per-epoch permutation of ``"equal"`` (the same on every rank).
    pinned
        Keep the same part every epoch (a cache, or no shuffle).
    scheme
        ``"equal"`` or ``"contiguous"``.
    workers
        Workers per consumer (``"contiguous"`` with shuffling splits a run in that many windows).
    shuffled
        The loader shuffles (``"contiguous"`` then cuts runs in windows).
    node_scope
        One store per node, shared by its ranks (see above).
    local_ranks
        Ranks per node (default: torchrun's ``LOCAL_WORLD_SIZE``, else all on one node).
    whole
        With the node scope, every node's store holds the whole dataset (a cache with a remote:
        node k computes its part, fetches the others'; :mod:`loader.cache.remote`): the store is
        `prefix` itself on every node, its positions are the dataset's indices, and its
        fingerprint is the same on every node (and for a job on one node).
    node
        ``(nodes, this node)`` for `whole` (:func:`loader.remote_setting.node_of`).
    even
        ``"equal"`` without padding: each consumer serves ``N // n`` samples and the tail of the
        epoch's permutation is not served (``DistributedSampler(drop_last=True)``).

    Raises
    ------
    ValueError
        ``"contiguous"`` would leave this consumer without samples.
    """

    def __init__(self, num_samples: int, nb_consumer: int, consumer_index: int, seed: int, pinned: bool,
                 scheme: str = "equal", workers: int = 1, shuffled: bool = False, node_scope: bool = False,
                 local_ranks: int | None = None, whole: bool = False, node: tuple[int, int] | None = None,
                 even: bool = False) -> None:
        if scheme not in PARTITIONS:
            raise ValueError(f"partition must be one of {PARTITIONS}, got {scheme!r}")
        self.num_samples = num_samples
        self.nb_consumer = nb_consumer
        self.consumer_index = consumer_index
        self.seed = seed
        self.pinned = pinned
        self.scheme = scheme
        self.workers = max(1, workers)
        self.shuffled = shuffled
        self.even = even and scheme == "equal"
        # One store per node, its ranks splitting a new permutation of it every epoch (a cache's "node"
        # scope); else each consumer keeps its own part (and store).
        # A single consumer is the one rank of its node: the same batches, and a state it takes resumes on
        # several ranks of the node (and back).
        self.node_scope = node_scope and scheme == "equal" and pinned
        self.whole = whole and self.node_scope
        if self.whole and node is not None:
            if nb_consumer % node[0]:
                raise ValueError(f"{nb_consumer} consumers cannot be split evenly between {node[0]} nodes")
            local_ranks = nb_consumer // node[0]
        local = local_ranks if local_ranks is not None else ranks_per_node(nb_consumer)
        self.local_ranks = local if self.node_scope else 1
        self.local_rank = consumer_index % local if self.node_scope else 0
        self.nodes = nb_consumer // local if self.node_scope else nb_consumer
        self.node = consumer_index // local if self.node_scope else consumer_index
        if self.whole and node is not None:
            self.node = node[1]
        if scheme == "contiguous" and nb_consumer > 1 and self.per_consumer == 0:
            raise ValueError(f"partition='contiguous' leaves consumer {consumer_index} of {nb_consumer} without "
                             f"samples: {num_samples} samples in runs of {self._run_length()} per consumer. Use "
                             "fewer consumers, or partition='equal'")

    def _run_length(self) -> int:
        n, k = self.num_samples, self.nb_consumer
        return -(-n // (k * self.workers)) * self.workers if self.shuffled else -(-n // k)

    def _moving(self) -> bool:
        """Contiguous runs that move every epoch: shuffled, without a cache."""
        return self.scheme == "contiguous" and self.shuffled and not self.pinned

    @property
    def per_store(self) -> int:
        """Samples a generation of this consumer's store holds (its node's part with the node scope)."""
        if self.whole:
            return self.num_samples
        # Counted, not built: a state's check asks it, and 10 million indices take a while to allocate.
        return len(range(self.node, self.num_samples, self.nodes)) if self.node_scope else self.per_consumer

    @property
    def per_consumer(self) -> int:
        """Samples this consumer serves per epoch (with the node scope: the most any rank of its node serves)."""
        if self.whole:
            return self.num_samples // self.nb_consumer if self.even else -(-self.num_samples // self.nb_consumer)
        if self.node_scope:
            node_part = len(range(self.node, self.num_samples, self.nodes))
            return node_part // self.local_ranks if self.even else -(-node_part // self.local_ranks)
        n, k, c = self.num_samples, self.nb_consumer, self.consumer_index
        if self.scheme == "equal" or k == 1:
            return n // k if self.even else -(-n // k)
        run = self._run_length()
        return min(max(n - c * run, 0), run)

    def partition(self, epoch: int) -> np.ndarray:
        """Dataset indices this consumer serves in `epoch`."""
        n, k, i = self.num_samples, self.nb_consumer, self.consumer_index
        if self.whole:  # the whole dataset on every node: a store position is the dataset's index
            return np.arange(n, dtype=np.int64)
        if self.node_scope:  # the node's part, pinned: every nodes-th index
            return np.arange(self.node, n, self.nodes, dtype=np.int64)
        if k == 1:
            return np.arange(n, dtype=np.int64)
        if self.scheme == "contiguous":
            start = i * self._run_length()
            if self._moving():
                start += epoch * -(-n // (k * self.workers))  # every window moves by one window's width
            return (start + np.arange(self.per_consumer, dtype=np.int64)) % n
        base = (np.arange(n, dtype=np.int64) if self.pinned
                else np.random.default_rng([self.seed, epoch, 1]).permutation(n))
        return np.resize(base, self.per_consumer * k)[i::k]

    @property
    def changes_per_epoch(self) -> bool:
        """Whether :meth:`partition` differs between epochs."""
        return self.nb_consumer > 1 and not self.pinned

    def store_path(self, prefix: str) -> str:
        """This consumer's store under `prefix`: the prefix itself (one node, or one consumer),
        ``node-<k>-of-<m>/`` (the node scope on several nodes), or ``consumer-<i>-of-<n>/`` in it."""
        if self.node_scope:
            many = self.nodes > 1 and not self.whole
            return str(Path(prefix) / f"node-{self.node}-of-{self.nodes}") if many else str(prefix)
        if self.nb_consumer > 1:
            return str(Path(prefix) / f"consumer-{self.consumer_index}-of-{self.nb_consumer}")
        return str(prefix)

    def batches(self, batch_size: int, drop_last: bool) -> int:
        """Batches this consumer serves per epoch (with the node scope: every rank of every node as many,
        the nodes' parts differing by a sample: those of the largest, or with `drop_last` the smallest)."""
        if self.node_scope:
            n, m = self.num_samples, self.nodes
            return rank_batch_count(n // m if drop_last or self.even else -(-n // m), self.local_ranks, batch_size,
                                    drop_last, self.even)
        return num_batches(self.per_consumer, batch_size, drop_last)

    @property
    def store_owner(self) -> tuple[int, int]:
        """Whose store it is, for its fingerprint: ``(node, nodes)`` with the node scope (every rank of a
        node, whatever their number), else ``(consumer_index, nb_consumer)``."""
        if self.whole:
            return (0, 1)
        return (self.node, self.nodes) if self.node_scope else (self.consumer_index, self.nb_consumer)
