"""A stream's cached epochs with and without the background refresh running beside them (one run, a ratio).

The refresh's thread shares the training process's GIL with the read path: it
unpickles the stream workers' samples and writes them. This measures what that
costs the cached epochs: epoch 1 of a stream with ``update_frequency=2`` reads
generation 0 while (with ``background_refresh``) the workers iterate the stream
into generation 1; the baseline reads the same generation with it off.

usage: python -m benchmarks.stream_refresh [SAMPLES] [KIB]
"""

from __future__ import annotations

import sys
import tempfile
import time
from typing import Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

from loader import CachedLoader


class Blobs(IterableDataset):
    """`n` samples of `kib` KiB, split by worker; each costs a little computation, as a decode would."""

    def __init__(self, n: int, kib: int) -> None:
        self.n, self.kib = n, kib

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            x = np.random.default_rng(i).random(self.kib * 128)  # float64: kib KiB
            yield {"x": np.sort(x), "i": i}


def cached_epoch(n: int, kib: int, background: bool) -> tuple[float, float]:
    """Samples per second of epoch 1 (a cached epoch), and how many seconds the refresh took meanwhile."""
    with tempfile.TemporaryDirectory() as prefix:
        cache = {"prefix": prefix, "update_frequency": 2, "background_refresh": background}
        with CachedLoader(Blobs(n, kib), batch_size=64, num_workers=2, shuffle=True, timeout=300,
                          cache_setting=cache) as loader:
            for _ in loader:  # generation 0
                pass
            served, start = 0, time.perf_counter()
            for batch in loader:
                served += len(batch["i"])
            seconds = time.perf_counter() - start
            for _ in loader:  # generation 1: read (waiting for the refresh) or written in its epoch
                pass
            waited = float(loader.epoch_stats[-1].wait_seconds)
    return served / seconds, waited


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    kib = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    off, _ = cached_epoch(n, kib, False)
    on, waited = cached_epoch(n, kib, True)
    print(f"{n} samples of {kib} KiB, 2 workers, batch 64: cached epoch {off:.0f} samples/s without the "
          f"refresh, {on:.0f} samples/s beside it: ratio {on / off:.2f}; epoch 2 waited {waited:.2f} s for it")


if __name__ == "__main__":
    main()
