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


class StoredSamples:
    """A cheap dataset of fixed samples, to fill a store fast for throughput runs.

    Sample ``i``: ``(float32 array of shape `shape`, int label)``.
    """

    def __init__(self, n: int, shape: tuple) -> None:
        self.n = n
        self.base = np.random.default_rng(0).random(tuple(shape), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        return self.base + np.float32(index % 7), index


class SleepyDataset:
    """Each sample takes `delay` seconds of wall time and no CPU (a slow network read).

    Lets a benchmark see the CPU the training process burns while it waits:
    the workers use none, so whatever the training process uses is its own.
    """

    def __init__(self, n: int = 48, delay: float = 0.1, shape: tuple = (16,)) -> None:
        self.n = n
        self.delay = delay
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        time.sleep(self.delay)
        return np.full(self.shape, index, dtype=np.float32), index
