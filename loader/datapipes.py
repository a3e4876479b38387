"""torch's datapipes (``IterDataPipe``) run as torch's ``DataLoader`` runs them: shuffle, seeds, shards.

A datapipe is a stream (an ``IterableDataset``) whose graph holds its own
shufflers and sharding filters, which torch's ``DataLoader`` drives; code
written for it counts on that (``docs/ARCHITECTURE.md``, "Streams"):

- ``shuffle=`` turns the graph's shufflers on or off (one is added at the end,
  with torch's warning, when asked and there is none);
- every epoch one seed, drawn in the training process, seeds the random pipes
  of every worker's copy alike: the workers shuffle the same way, and a
  sharding filter after a shuffler splits one permutation between them, each
  sample served once;
- worker ``w`` of ``N`` (of rank ``r`` of ``W``) keeps its share: the sharding
  filters are set to ``(N * W, w * W + r)``, as torch's
  ``_sharding_worker_init_fn`` sets them, before ``worker_init_fn`` runs.

What driving a datapipe changes in it (its seeds, its random generators'
states, a shuffler's buffer, the default sharding, torch's per-iterator
bookkeeping) is not what it is: :func:`identity_state` leaves it out of the
cache's fingerprint, so that the same datapipe maps to the same store in every
epoch and every run.

torch is imported only for a datapipe, which cannot exist without it.
"""

from __future__ import annotations

import inspect
import random
import sys
from typing import Any

import numpy as np

from .distributed import distributed_defaults


def is_datapipe(dataset: object) -> bool:
    """Whether `dataset` (an instance or a class) is one of torch's ``IterDataPipe`` s."""
    if "torch.utils.data" not in sys.modules:
        return False  # no datapipe can exist before torch's data module is imported
    from torch.utils.data import IterDataPipe

    return isinstance(dataset, IterDataPipe) or (isinstance(dataset, type) and issubclass(dataset, IterDataPipe))


def apply_shuffle(dataset: Any, shuffle: bool) -> Any:
    """`dataset` with its shufflers on or off (torch's ``apply_shuffle_settings``): the same graph, or the
    graph with a shuffler added at the end."""
    from torch.utils.data.graph_settings import apply_shuffle_settings

    return apply_shuffle_settings(dataset, shuffle=shuffle)


def epoch_seed(seed: int | None, epoch: int) -> int:
    """The seed of a datapipe's random pipes in `epoch`: from ``(seed, epoch)`` when the run has a seed
    (``seed`` or ``generator``: a resumed run draws the same), else drawn from torch's global generator,
    as torch draws it at each ``iter()`` (``torch.manual_seed(s)`` before the loop repeats an epoch)."""
    if seed is not None:
        return int(np.random.SeedSequence([seed, epoch, 0x44_50]).generate_state(1, np.uint64)[0] >> 1)
    import torch

    return int(torch.empty((), dtype=torch.int64).random_().item())


def seed_pipes(dataset: Any, seed: int) -> None:
    """Seed every random pipe of `dataset`'s graph from `seed` (torch's ``apply_random_seed``)."""
    import torch
    from torch.utils.data.graph_settings import apply_random_seed

    apply_random_seed(dataset, torch.Generator().manual_seed(seed))


def ranks() -> tuple[int, int]:
    """``(world size, rank)`` of ``torch.distributed`` in the training process (``(1, 0)`` without it),
    for :func:`shard`: a worker never joins the process group, so it is told."""
    return distributed_defaults()


def shard(dataset: Any, num_workers: int, worker_id: int, world: tuple[int, int]) -> None:
    """Keep worker `worker_id`'s share of `dataset` of the rank `world` names (see the module docstring);
    the training process iterating it itself is worker 0 of 1."""
    from torch.utils.data.graph_settings import apply_sharding

    size, rank = world
    apply_sharding(dataset, num_workers * size, worker_id * size + rank)


#: What torch's ``IterDataPipe`` keeps of its current iterator (class-level defaults; an instance gets
#: its own once iterated): the same pipe before and after an epoch in the training process.
_ITERATION = frozenset({"_valid_iterator_id", "_number_of_samples_yielded", "_snapshot_state",
                        "_fast_forward_iterator"})
#: What seeding and iterating torch's shufflers make of them besides their seed and generator: the
#: samples pending in the buffer (``iter.Shuffler``), the indices still to yield (``map.Shuffler``).
_PENDING = frozenset({"_buffer", "_shuffled_indices"})


def _is_generator(value: object) -> bool:
    """Whether `value` is a random generator: its state is where the draws are, not what the pipe is
    (a fresh ``random.Random()`` is seeded by the OS, another state in every run)."""
    if isinstance(value, (random.Random, np.random.Generator, np.random.RandomState)):
        return True
    import torch

    return isinstance(value, torch.Generator)


def identity_state(pipe: Any) -> dict[str, Any]:
    """The attributes of datapipe `pipe` that say what it yields, for its fingerprint.

    Left out is what torch's ``DataLoader`` (and this loader, driving a datapipe as it does) changes
    by seeding, sharding and iterating it: the iterator bookkeeping of every ``IterDataPipe``; a
    random pipe's (one with a ``set_seed`` method, which ``apply_random_seed`` seeds) ``_seed``
    (where torch's pipes keep the seed for their next ``reset()``) and random generators; torch's
    shufflers' pending samples; a sharding filter's default group (each worker's share, set on
    each copy: what the workers write together is the whole stream), with the instance count and
    id derived from it. A shuffler's on/off (``shuffle=``), its buffer size, and a sharding group
    the user set stay.

    Parameters
    ----------
    pipe
        An ``IterDataPipe`` (see :func:`is_datapipe`).

    Returns
    -------
    dict
        A copy of ``vars(pipe)`` without those attributes (the pipe itself is not changed).
    """
    from torch.utils.data.datapipes.iter import Shuffler
    from torch.utils.data.datapipes.iter.sharding import SHARDING_PRIORITIES, ShardingFilterIterDataPipe
    from torch.utils.data.datapipes.map.combinatorics import ShufflerIterDataPipe as MapShuffler

    state = {k: v for k, v in vars(pipe).items() if k not in _ITERATION}
    if inspect.ismethod(getattr(pipe, "set_seed", None)):
        state = {k: v for k, v in state.items() if k != "_seed" and not _is_generator(v)}
    if isinstance(pipe, (Shuffler, MapShuffler)):
        state = {k: v for k, v in state.items() if k not in _PENDING}
    if isinstance(pipe, ShardingFilterIterDataPipe):
        state.pop("num_of_instances", None)
        state.pop("instance_id", None)
        groups = state.get("groups")
        if isinstance(groups, dict):
            state["groups"] = {k: v for k, v in groups.items() if k != SHARDING_PRIORITIES.DEFAULT}
    return state
