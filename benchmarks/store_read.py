"""Store read benchmark: a random-order epoch of batch reads per backend, against memcpy.

Writes one generation of float32 ``(3, 64, 64)`` images (48 KiB) plus an int
label per backend into a temporary directory, then times full epochs of
``reader.get_batch`` over a fresh random permutation (batch 256) and reports
samples/s, GB/s and the ratio to this machine's memcpy bandwidth, measured in
the same run (before every case, median) with ``np.copyto`` between buffers far
larger than the last-level cache (memory-bound, like a random gather from a
store that does not fit in it; a cache-resident copy of one batch is shown
too). Fixed-layout generations (memmap, memory) gather into ``out=`` arrays
reused across batches, as the loader does; lmdb batches are new arrays. The
memory backend keeps no checksums, so it has nothing to verify.

Targets (docs/ARCHITECTURE.md, "Performance targets"): memmap and memory reach at
least 0.5x memcpy, lmdb at least 0.25x.

Run ``python -m benchmarks.store_read`` (``--samples 2000`` for a quick run).
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from cachestore import open_store

from .common import memcpy_bandwidth, memory_bound_nbytes, table, verdict

SHAPE = (3, 64, 64)
SAMPLE_BYTES = int(np.prod(SHAPE)) * 4 + 8  # image + int64 label

#: (label, backend, verify, target ratio to memcpy)
CASES = [
    ("memmap", "memmap", True, 0.5),
    ("memmap verify=False", "memmap", False, 0.5),
    ("lmdb", "lmdb", True, 0.25),
    ("memory", "memory", True, 0.5),
]


@dataclass
class Result:
    label: str
    seconds: float  # median epoch time
    samples: int
    target: float

    @property
    def samples_per_s(self) -> float:
        return self.samples / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.samples * SAMPLE_BYTES / self.seconds


def write_generation(store, n: int) -> None:
    base = np.arange(int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE)
    with store.writer(0, n) as writer:
        for i in range(n):
            writer.put(i, {"image": base + i, "label": i})


def time_epochs(reader, n: int, batch: int, repeats: int, seed: int) -> float:
    """Median seconds of `repeats` full random-order epochs (after one untimed warm-up epoch)."""
    return statistics.median(epoch_times(reader, n, batch, repeats, seed))


def epoch_times(reader, n: int, batch: int, repeats: int, seed: int) -> list[float]:
    """Seconds of each of `repeats` full random-order epochs (after one untimed warm-up epoch).

    Where the generation has a fixed layout the batches land in arrays reused from batch
    to batch (``out=``), as the loader's shared-memory slots do; elsewhere each batch is new.
    """
    rng = np.random.default_rng(seed)
    layout = reader.batch_layout()
    out = None if layout is None else [np.empty((batch, *shape), dtype=dtype) for dtype, shape in layout[1]]
    times = []
    for epoch in range(repeats + 1):
        order = rng.permutation(n)
        start = time.perf_counter()
        for lo in range(0, n, batch):
            idx = order[lo:lo + batch]
            reader.get_batch(idx, out=None if out is None else [a[:idx.size] for a in out])
        if epoch:  # the first epoch maps pages in: not what a cached epoch costs
            times.append(time.perf_counter() - start)
    return times


def check_batch(reader, n: int) -> None:
    """The batch read returns what was written (a fast wrong answer is no result)."""
    idx = np.array([0, n - 1, n // 2])
    batch = reader.get_batch(idx)
    base = np.arange(int(np.prod(SHAPE)), dtype=np.float32).reshape(SHAPE)
    for j, i in enumerate(idx):
        if batch["label"][j] != i or not np.array_equal(batch["image"][j], base + i):
            raise AssertionError(f"sample {i} read back wrong")


def memcpy_pair(batch: int) -> tuple[float, float]:
    """Bytes/s of a memory-bound copy and of a cache-resident copy of one batch."""
    return memcpy_bandwidth(memory_bound_nbytes(), repeats=7), memcpy_bandwidth(batch * SAMPLE_BYTES)


def run(samples: int, batch: int, repeats: int, root: str | None) -> tuple[tuple[float, float], list[Result]]:
    """``((memory-bound, cache-resident memcpy bytes/s), results)``. memcpy is measured before every
    case and at the end, and the medians taken: on a shared machine one measurement can be off by 2x."""
    memcpy = [memcpy_pair(batch)]
    results = []
    tmp = tempfile.mkdtemp(prefix="store_read-", dir=root)
    try:
        stores = {}
        for label, backend, verify, target in CASES:
            if backend not in stores:
                store = open_store(Path(tmp) / backend, backend)
                write_generation(store, samples)
                stores[backend] = store
            reader_store = stores[backend] if verify else open_store(Path(tmp) / backend, backend, verify=False)
            reader = reader_store.reader()
            check_batch(reader, samples)
            memcpy.append(memcpy_pair(batch))
            seconds = time_epochs(reader, samples, batch, repeats, seed=len(results))
            results.append(Result(label, seconds, samples, target))
            reader.close()
        for store in stores.values():
            store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    memcpy.append(memcpy_pair(batch))
    return (statistics.median(m for m, _ in memcpy), statistics.median(c for _, c in memcpy)), results


def report(memcpy_both: tuple[float, float], results: list[Result], samples: int, batch: int, repeats: int) -> str:
    memcpy, resident = memcpy_both
    rows = []
    for r in results:
        ratio = r.bytes_per_s / memcpy
        rows.append([r.label, f"{r.samples_per_s:,.0f}", f"{r.bytes_per_s / 1e9:.2f}", f"{ratio:.2f}",
                     f">= {r.target:.2f}", verdict(ratio >= r.target)])
    return "\n".join([
        f"store_read: {samples} samples of float32 {SHAPE} + int label ({SAMPLE_BYTES / 1024:.1f} KiB), "
        f"random order, batch {batch}, median of {repeats} epochs after a warm-up epoch; "
        "fixed layouts gather into reused out= arrays",
        f"memcpy (np.copyto, median over the run): {memcpy / 1e9:.2f} GB/s memory-bound "
        f"({memory_bound_nbytes() >> 20} MiB buffers; the ratios use this one), {resident / 1e9:.2f} GB/s "
        f"cache-resident ({batch * SAMPLE_BYTES / 2**20:.1f} MiB buffers)",
        "",
        table(["backend", "samples/s", "GB/s", "x memcpy", "target", "result"], rows),
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_read", description=__doc__.split("\n\n")[0])
    parser.add_argument("--samples", type=int, default=20_000, help="samples per generation (default 20000)")
    parser.add_argument("--batch", type=int, default=256, help="batch size (default 256)")
    parser.add_argument("--repeats", type=int, default=3, help="timed epochs per backend (default 3)")
    parser.add_argument("--dir", default=None, help="where to put the temporary stores (default: the system temp)")
    args = parser.parse_args(argv)
    if args.samples < 1 or args.batch < 1 or args.repeats < 1:
        parser.error("--samples, --batch and --repeats must be positive")
    memcpy, results = run(args.samples, args.batch, args.repeats, args.dir)
    print(report(memcpy, results, args.samples, args.batch, args.repeats))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
