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


class ConsumerLayout:
    """The part of the dataset one consumer serves.

    Every consumer gets the same number of samples (the partition is padded by
    wrapping around), so every rank sees as many batches. Without a cache and
    with shuffling the partition changes every epoch; a cache pins it, since
    each consumer's store holds the samples of its own part.

    Parameters
    ----------
    num_samples
        Length of the dataset.
    nb_consumer, consumer_index
        How many consumers, and which one this is.
    seed
        Seed of the per-epoch partition (the same on every rank).
    pinned
        Keep the same partition every epoch (a cache, or no shuffle).
    """

    def __init__(self, num_samples: int, nb_consumer: int, consumer_index: int, seed: int, pinned: bool) -> None:
        self.num_samples = num_samples
        self.nb_consumer = nb_consumer
        self.consumer_index = consumer_index
        self.seed = seed
        self.pinned = pinned

    @property
    def per_consumer(self) -> int:
        """Samples each consumer serves per epoch."""
        return -(-self.num_samples // self.nb_consumer)

    def partition(self, epoch: int) -> np.ndarray:
        """Dataset indices this consumer serves in `epoch`."""
        n, k, i = self.num_samples, self.nb_consumer, self.consumer_index
        if k == 1:
            return np.arange(n, dtype=np.int64)
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
