"""Which indices an epoch visits, in which order, split into batches."""

from __future__ import annotations

import numpy as np


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool, nearby_shuffle: int = 0) -> np.ndarray:
    """The order of indices ``0..n-1`` for `epoch`, deterministic in `(seed, epoch)`.

    ``nearby_shuffle=W`` sorts ``i + u_i`` with ``u_i`` uniform in ``[0, W)``:
    every index moves fewer than W positions from its own, so a dataset reading
    contiguous files keeps reading nearby records.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if nearby_shuffle:
        keys = np.arange(n) + rng.random(n) * nearby_shuffle
        return np.argsort(keys, kind="stable").astype(np.int64)
    return rng.permutation(n).astype(np.int64)


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Consecutive chunks of `batch_size` (the last one shorter unless `drop_last`)."""
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def num_batches(n: int, batch_size: int, drop_last: bool) -> int:
    return n // batch_size if drop_last else -(-n // batch_size)
