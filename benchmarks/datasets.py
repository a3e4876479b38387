"""Datasets of the benchmarks (importable by module path, as loader workers need)."""

from __future__ import annotations

import time

import numpy as np


def burn_cpu(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time (not wall time: sleeping costs nothing)."""
    end = time.thread_time() + seconds
    x = 1.0
    while time.thread_time() < end:
        for _ in range(200):
            x = x * 1.0000001 + 1e-9


class ExpensiveDataset:
    """Each sample costs `cost` seconds of CPU, like decoding plus augmentation.

    Sample ``i``: ``(float32 array of shape `shape`, int label)``, with random
    augmentation noise so refreshed epochs differ.
    """

    def __init__(self, n: int = 1000, cost: float = 0.005, shape: tuple = (3, 64, 64)) -> None:
        self.n = n
        self.cost = cost
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        burn_cpu(self.cost)
        rng = np.random.default_rng()
        x = np.full(self.shape, index % 251, dtype=np.float32) + rng.random(self.shape, dtype=np.float32)
        return x, index
