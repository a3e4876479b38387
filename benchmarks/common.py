"""Timing helpers shared by the benchmarks: summaries, memcpy bandwidth, tables."""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable, Iterable, Iterator, Sequence

import numpy as np

#: Where the kernel publishes the size of the last-level cache.
LLC_SIZE_FILE = "/sys/devices/system/cpu/cpu0/cache/index3/size"


def median_spread(values: list[float]) -> tuple[float, float]:
    """Median and half the min-max range."""
    return statistics.median(values), (max(values) - min(values)) / 2


def summarize(values: Sequence[float]) -> dict[str, Any]:
    """Median, min, max and half the min-max range ("spread") of repeated measurements.

    Parameters
    ----------
    values
        One figure per repetition (at least one).

    Returns
    -------
    dict
        ``{"median", "min", "max", "spread", "n", "values"}``.
    """
    values = [float(v) for v in values]
    median, spread = median_spread(values)
    return {"median": median, "min": min(values), "max": max(values), "spread": spread, "n": len(values),
            "values": values}


def per_epoch(runs: list[list[float]]) -> dict[str, list[float]]:
    """Median, min and max of each epoch over repeated runs (one list of per-epoch figures per run)."""
    columns = list(zip(*runs))
    return {"median": [statistics.median(c) for c in columns], "min": [min(c) for c in columns],
            "max": [max(c) for c in columns]}


def llc_bytes() -> int | None:
    """Size of the last-level (L3) cache of cpu0 in bytes, or ``None`` when the kernel does not say."""
    try:
        with open(LLC_SIZE_FILE) as f:
            text = f.read().strip().upper()
    except OSError:
        return None
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    try:
        return int(text[:-1]) * units[text[-1]] if text[-1] in units else int(text)
    except (ValueError, IndexError):
        return None


def memory_bound_nbytes() -> int:
    """A buffer size far beyond the last-level cache: 8x the LLC, at least 256 MiB."""
    llc = llc_bytes()
    return max(8 * llc, 256 << 20) if llc else 512 << 20


def memcpy_bandwidth(nbytes: int = 12 << 20, repeats: int = 30) -> float:
    """Bytes/s of a plain copy between two warm buffers of `nbytes` (median).

    Buffers smaller than the last-level cache measure a cache-resident copy;
    buffers several times larger measure main-memory bandwidth. The bytes
    counted are the bytes copied (each is read once and written once).
    """
    src = np.ones(nbytes // 8)  # ones, not zeros: calloc'ed zero pages are not real memory
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return src.nbytes / statistics.median(times)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


class WaitClock:
    """Iterate over `batches`, adding up the time spent in ``iter()`` and ``next()``.

    That is the time a training loop waits on data, the final ``next()`` that
    ends the epoch included (a loader may still be busy then: committing a
    generation, for instance).
    """

    def __init__(self, batches: Iterable[Any]) -> None:
        self.batches = batches
        self.seconds = 0.0

    def __iter__(self) -> Iterator[Any]:
        t = time.perf_counter()
        it = iter(self.batches)
        while True:
            try:
                batch = next(it)
            except StopIteration:
                self.seconds += time.perf_counter() - t
                return
            self.seconds += time.perf_counter() - t
            yield batch
            t = time.perf_counter()


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"
