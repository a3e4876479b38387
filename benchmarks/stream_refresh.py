"""A stream's cached epochs with and without the background refresh running beside them (one run, a ratio).

The refresh's thread shares the training process's GIL with the read path: it
unpickles the stream workers' samples and writes them. This measures what that
costs the cached epochs: epoch 3 of a stream with ``update_frequency=2`` reads
generation 1 while (with ``background_refresh``) the workers, started long
before, iterate the stream into generation 2; the baseline reads generation 1
with it off.

usage: python -m benchmarks.stream_refresh [SAMPLES] [KIB] [cheap]
(``cheap``: samples that cost the workers next to nothing, so the thread's own cost shows)
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

    def __init__(self, n: int, kib: int, cheap: bool = False) -> None:
        self.n, self.kib, self.cheap = n, kib, cheap

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            if self.cheap:  # next to no work in the workers: what is left is the thread's (and the pipes')
                yield {"x": np.full(self.kib * 128, i, dtype=np.float64), "i": i}
                continue
            x = np.random.default_rng(i).random(self.kib * 128)  # float64: kib KiB
            yield {"x": np.sort(x), "i": i}


def cached_epoch(n: int, kib: int, background: bool, cheap: bool) -> tuple[float, bool, float]:
    """Samples per second of epoch 3, a cached epoch of generation 1, its stream workers started long
    before; whether the refresh of generation 2 (begun at epoch 2) still ran at its end (epoch 4 waited
    for it), and the CPU
    seconds of the thread that wrote generation 1 (its share of the GIL)."""
    with tempfile.TemporaryDirectory() as prefix:
        cache = {"prefix": prefix, "update_frequency": 2, "background_refresh": background}
        with CachedLoader(Blobs(n, kib, cheap), batch_size=64, num_workers=2, shuffle=True, timeout=300,
                          cache_setting=cache) as loader:
            for _ in range(3):  # generation 0; epoch 2 reads generation 1 (or writes it, without)
                for _batch in loader:
                    pass
            cpu = float(loader.epoch_stats[-1].extra.get("stream_refresh_cpu", 0.0))
            served, start = 0, time.perf_counter()
            for batch in loader:
                served += len(batch["i"])
            seconds = time.perf_counter() - start
            for _batch in loader:  # epoch 4 waited for generation 2: the refresh ran through epoch 3
                pass
            overlapped = loader.epoch_stats[-1].extra.get("stream_refresh") == "waited"
    return served / seconds, overlapped, cpu


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 4000
    kib = int(sys.argv[2]) if len(sys.argv) > 2 else 48
    cheap = len(sys.argv) > 3 and sys.argv[3] == "cheap"
    off, _, _ = cached_epoch(n, kib, False, cheap)
    on, overlapped, cpu = cached_epoch(n, kib, True, cheap)
    print(f"{n} samples of {kib} KiB{' (cheap)' if cheap else ''}, 2 workers, batch 64: cached epoch {off:.0f} samples/s without the "
          f"refresh, {on:.0f} samples/s beside it: ratio {on / off:.2f} (the refresh "
          f"{'still ran at its end' if overlapped else 'ended before it'}); the thread that wrote generation 1 "
          f"took {cpu:.2f} CPU s")


if __name__ == "__main__":
    main()
