"""How the data is split between consumers (ranks), and what ``torch.distributed`` says about this one."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np


def distributed_defaults() -> tuple[int, int]:
    """World size and rank when torch.distributed is initialised, else (1, 0)."""
    # Only a process that imported torch.distributed can have initialised it:
    # importing torch here would cost a second for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0


#: How the data is split between consumers (the ``partition`` argument).
PARTITIONS = ("equal", "contiguous")


class ConsumerLayout:
    """The part of the dataset one consumer serves.

    Two schemes (the loader's ``partition`` argument):

    * ``"equal"`` (default): every consumer gets ``ceil(N / n)`` samples, every
      n-th index of a permutation padded by wrapping around, so every rank sees as
      many batches (what ``DistributedSampler`` does). With shuffling and no cache
      the permutation changes every epoch; a cache pins it (each consumer's store
      holds the samples of its own part).
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

    Raises
    ------
    ValueError
        ``"contiguous"`` would leave this consumer without samples.
    """

    def __init__(self, num_samples: int, nb_consumer: int, consumer_index: int, seed: int, pinned: bool,
                 scheme: str = "equal", workers: int = 1, shuffled: bool = False) -> None:
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
    def per_consumer(self) -> int:
        """Samples this consumer serves per epoch."""
        n, k, c = self.num_samples, self.nb_consumer, self.consumer_index
        if self.scheme == "equal" or k == 1:
            return -(-n // k)
        run = self._run_length()
        return min(max(n - c * run, 0), run)

    def partition(self, epoch: int) -> np.ndarray:
        """Dataset indices this consumer serves in `epoch`."""
        n, k, i = self.num_samples, self.nb_consumer, self.consumer_index
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
        """This consumer's store under `prefix`: the prefix itself, or ``consumer-<i>-of-<n>/`` in it."""
        if self.nb_consumer > 1:
            return str(Path(prefix) / f"consumer-{self.consumer_index}-of-{self.nb_consumer}")
        return str(prefix)
