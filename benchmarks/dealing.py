"""What dealing batches to the workers in turn costs, against the least loaded worker (``loader/executors/process/pool.py``).

With a ``worker_init_fn`` a loader deals batch ``i`` of an epoch to worker ``i mod N``, whole, as torch
does (``LoaderSettings.deals_in_turn``); without one, a batch goes to the least loaded worker and an
epoch's first and last batches are split between the workers. Both loaders here are the same but for a
``worker_init_fn`` that does nothing, run alternately in one process; compute epochs of 2 workers,
640 samples in batches of 32, shuffled. Cases:

- ``sleep``: every sample waits 2 ms (no CPU: the dealing alone, whatever else the machine runs);
- ``var-sleep``: 1 ms, one sample in ten 10 ms (uneven batches, where the least loaded worker helps);
- ``cpu``, ``var-cpu``: the same costs (1 ms; 0.5 ms and one in ten 5 ms) spent computing.

Medians over `repeats` loaders of each, in milliseconds: the first batch of epoch 0 (workers
started), of epochs 1-2 (workers warm), and the epochs' times; ``turn/free`` is their ratio.

``python -m benchmarks.dealing [--repeats 3]`` (not part of ``python -m benchmarks``: about a minute).
"""

from __future__ import annotations

import argparse
import os
import statistics
import time
import zlib
from typing import Any, Callable

import numpy as np

#: (case, samples, batch size, milliseconds per sample)
CASES = [("sleep", 640, 32, 2.0), ("var-sleep", 640, 32, 1.0), ("cpu", 640, 32, 1.0), ("var-cpu", 640, 32, 0.5)]


class Costly:
    """`ms` milliseconds per sample (ten times that for one in ten with ``var-``), asleep or computing."""

    def __init__(self, n: int, case: str, ms: float) -> None:
        self.n, self.case, self.ms = n, case, ms

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        seconds = self.ms / 1000
        if self.case.startswith("var-") and zlib.crc32(str(index).encode()) % 10 == 0:
            seconds *= 10
        if self.case.endswith("cpu"):
            end = time.perf_counter() + seconds
            while time.perf_counter() < end:
                pass
        else:
            time.sleep(seconds)
        return np.full(256, index, dtype=np.float32)


def no_init(worker_id: int) -> None:
    """A ``worker_init_fn`` that does nothing: the loader deals in turn."""


def run(case: str, n: int, batch_size: int, ms: float, init: Callable[[int], None] | None,
        epochs: int = 3) -> dict[str, list[float]]:
    """One loader's epochs: seconds to each epoch's first batch, and each epoch's."""
    from loader import CachedLoader

    out: dict[str, list[float]] = {"first": [], "epoch": []}
    with CachedLoader(Costly(n, case, ms), batch_size=batch_size, nb_worker=2, shuffle=True, seed=1,
                      worker_init_fn=init) as loader:
        for _ in range(epochs):
            start, first = time.perf_counter(), None
            for _batch in loader:
                if first is None:
                    first = time.perf_counter() - start
            out["first"].append(first or 0.0)
            out["epoch"].append(time.perf_counter() - start)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    results: dict[tuple[str, str], list[dict[str, list[float]]]] = {}
    for r in range(args.repeats):
        for case, n, batch_size, ms in CASES:
            order = [("free", None), ("turn", no_init)]
            for name, init in order if r % 2 == 0 else order[::-1]:  # alternate which runs first
                results.setdefault((case, name), []).append(run(case, n, batch_size, ms, init))
    metrics: list[tuple[str, Callable[[dict[str, list[float]]], float]]] = [
        ("first batch e0", lambda o: o["first"][0]), ("first batch e1-2", lambda o: statistics.mean(o["first"][1:])),
        ("epoch 0", lambda o: o["epoch"][0]), ("epochs 1-2", lambda o: statistics.mean(o["epoch"][1:]))]
    print(f"load average at the end: {os.getloadavg()}")
    print(f"{'case':10} {'ms':16} {'free':>8} {'turn':>8} {'turn/free':>9}")
    for case, *_ in CASES:
        for metric, pick in metrics:
            free = statistics.median(pick(o) for o in results[(case, "free")])
            turn = statistics.median(pick(o) for o in results[(case, "turn")])
            print(f"{case:10} {metric:16} {free * 1000:8.1f} {turn * 1000:8.1f} {turn / free:9.2f}")


if __name__ == "__main__":
    main()
