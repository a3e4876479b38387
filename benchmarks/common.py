"""Timing helpers shared by the benchmarks: medians, memcpy bandwidth, tables."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import numpy as np


def median_spread(values: list[float]) -> tuple[float, float]:
    """Median and half the min-max range."""
    return statistics.median(values), (max(values) - min(values)) / 2


def memcpy_bandwidth(nbytes: int = 12 << 20, repeats: int = 30) -> float:
    """Bytes/s of a plain copy between two warm buffers of `nbytes` (median)."""
    src = np.random.default_rng(0).random(nbytes // 8)
    dst = np.empty_like(src)
    np.copyto(dst, src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        np.copyto(dst, src)
        times.append(time.perf_counter() - t)
    return nbytes / statistics.median(times)


def timed(fn: Callable[[], object]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def table(headers: list[str], rows: list[list[object]]) -> str:
    cells = [[str(c) for c in row] for row in [headers] + rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  ".join(c.rjust(w) if j else c.ljust(w) for j, (c, w) in enumerate(zip(r, widths))) for r in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def verdict(ok: bool) -> str:
    return "met" if ok else "NOT met"
