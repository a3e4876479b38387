"""What the multi-process scenarios share: a dataset that counts its calls, a file barrier, a JSON out.

The sweep (:mod:`benchmarks.sweep`) and torchrun (:mod:`benchmarks.torchrun_node`)
scenarios run several independent processes on one store and ask how many
times each sample was computed in total. The loader's own ``epoch_stats``
say what each process believes it computed; :class:`CountedExpensiveDataset`
counts independently of the loader, one line per ``__getitem__`` call in a
file per process, so a sample computed twice shows even if the loader's
bookkeeping were wrong.

Only light imports: loader workers start with spawn and import this module
again to rebuild the dataset.
"""

from __future__ import annotations

import json
import os
import time
from collections import Counter
from pathlib import Path
from typing import Any

from .datasets import ExpensiveDataset

#: Seconds a job waits at the barrier for the others before it gives up.
BARRIER_TIMEOUT = 120.0


class CountedExpensiveDataset(ExpensiveDataset):
    """:class:`~benchmarks.datasets.ExpensiveDataset` that appends each index it computes to
    ``<counter_dir>/calls-<pid>.txt``.

    `counter_dir` is a dataset parameter, so it is part of the cache
    fingerprint: jobs meant to share a store must pass the same directory.
    """

    def __init__(self, n: int = 1000, cost: float = 0.005, shape: tuple = (3, 64, 64),
                 counter_dir: str = "") -> None:
        super().__init__(n, cost, shape)
        self.counter_dir = counter_dir

    def __getitem__(self, index: int) -> tuple:
        sample = super().__getitem__(index)
        # One small append per call (O_APPEND: lines of concurrent processes never interleave);
        # microseconds against the milliseconds of CPU a sample costs.
        with open(os.path.join(self.counter_dir, f"calls-{os.getpid()}.txt"), "a") as f:
            f.write(f"{index}\n")
        return sample


def count_calls(counter_dir: str | Path) -> dict[str, Any]:
    """What the dataset calls logged in `counter_dir` add up to.

    Returns
    -------
    dict
        ``calls`` (all ``__getitem__`` calls), ``distinct`` (distinct indices),
        ``repeated`` (indices computed more than once), ``processes`` (files,
        one per process that computed anything).
    """
    counts: Counter[int] = Counter()
    files = 0
    for path in Path(counter_dir).glob("calls-*.txt"):
        files += 1
        counts.update(int(line) for line in path.read_text().split())
    return {"calls": sum(counts.values()), "distinct": len(counts),
            "repeated": sum(1 for c in counts.values() if c > 1), "processes": files}


def file_barrier(directory: str | Path, me: int, parties: int, timeout: float = BARRIER_TIMEOUT) -> float:
    """Wait until all `parties` processes reached this point; returns ``time.time()`` on release.

    Each leaves ``ready-<me>`` in `directory` and polls for the others' (unrelated
    processes share no event to wait on).

    Raises
    ------
    TimeoutError
        Fewer than `parties` arrived within `timeout` seconds.
    """
    directory = Path(directory)
    (directory / f"ready-{me}").touch()
    deadline = time.monotonic() + timeout
    while sum(1 for p in directory.iterdir() if p.name.startswith("ready-")) < parties:
        if time.monotonic() > deadline:
            raise TimeoutError(f"only some of the {parties} processes reached the barrier in {directory} "
                               f"within {timeout:g} s")
        time.sleep(0.002)
    return time.time()


def wait_children_idle(min_children: int, timeout: float = 60.0, quiet: float = 0.3) -> float:
    """Wait until this process has `min_children` child processes and they have used no CPU
    (under 10 ms together) for `quiet` seconds: the loader's workers have started and are waiting
    for tasks. Returns the seconds waited (or `timeout`, past which it stops waiting).

    Spawned workers import torch and the dataset at their start: a second or more of CPU each. A
    scenario that times what the jobs do *together* waits for this before its barrier, so every job
    starts its epoch with its workers ready.
    """
    import psutil

    me, start = psutil.Process(), time.monotonic()

    def children_cpu() -> tuple[int, float]:
        total, count = 0.0, 0
        for child in me.children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.Error:  # exited meanwhile
                continue
            count += 1
            total += times.user + times.system
        return count, total

    count, before = children_cpu()
    while time.monotonic() - start < timeout:
        time.sleep(quiet)
        count, now = children_cpu()
        if count >= min_children and now - before < 0.01:
            break
        before = now
    return time.monotonic() - start


def stats_dict(stats: Any) -> dict[str, Any]:
    """The figures of one :class:`~loader.epochs.plan.EpochStats` the reports use."""
    return {"mode": str(stats.mode.value), "generation": stats.generation, "samples": stats.samples,
            "computed": stats.computed, "read": stats.read, "waited": stats.waited, "written": stats.written,
            "committed": stats.committed, "seconds": stats.seconds}


def write_json(path: str | Path, data: Any) -> None:
    """Write `data` as JSON through a temp name and a rename, so a reader never sees half a file."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(data))
    os.replace(tmp, path)
