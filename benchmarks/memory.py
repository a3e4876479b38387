"""Scenario 4: peak memory of the training process and all its children, ours vs torch.

A background thread samples the process tree (the training process and every
descendant: workers, the multiprocessing resource tracker) every `interval`
seconds and keeps the peak of the sums. The metric is **PSS** (proportional
set size, from ``/proc/PID/smaps_rollup``): a page shared by k processes counts
1/k in each, so the sum over processes is the physical memory the group uses,
shared memory, forked copy-on-write pages and mapped store files counted once.
The sum of RSS (every process counts every page it maps, so shared pages count
several times) is kept beside it. Where ``smaps_rollup`` is missing (not Linux)
only RSS is measured, and the result says so.

Sampling costs a few ms of kernel time per process (page-table walks), so the
memory runs are separate from the timed runs.
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
from typing import Any

import psutil

from cachestore import open_store

from .common import summarize
from .expensive_dataset import cached_epochs, torch_epochs

_ROLLUP_FIELDS = {"Rss:": "rss", "Pss:": "pss", "Private_Clean:": "uss", "Private_Dirty:": "uss"}


def has_pss() -> bool:
    """Whether this system publishes ``/proc/PID/smaps_rollup`` (Linux >= 4.14)."""
    return os.path.exists(f"/proc/{os.getpid()}/smaps_rollup")


def process_memory(proc: psutil.Process) -> dict[str, int]:
    """``{"rss", "pss", "uss"}`` bytes of one process (only ``rss`` without smaps_rollup)."""
    try:
        with open(f"/proc/{proc.pid}/smaps_rollup") as f:
            text = f.read()
    except OSError:
        return {"rss": proc.memory_info().rss}
    out = {"rss": 0, "pss": 0, "uss": 0}
    for line in text.splitlines():
        parts = line.split()
        key = _ROLLUP_FIELDS.get(parts[0]) if parts else None
        if key is not None:
            out[key] += int(parts[1]) * 1024
    return out


def tree_memory(root: psutil.Process | None = None, exclude: int | None = None) -> dict[str, int]:
    """Sums of :func:`process_memory` over `root` (default: this process) and its descendants but `exclude`."""
    root = root or psutil.Process()
    total = {"processes": 0}
    for proc in [root, *root.children(recursive=True)]:
        if proc.pid == exclude:
            continue
        try:
            mem = process_memory(proc)
        except (psutil.Error, OSError):
            continue  # exited between listing and reading
        total["processes"] += 1
        for key, value in mem.items():
            total[key] = total.get(key, 0) + value
    return total


class PeakMemory:
    """Context manager: peak memory of this process tree while the block runs.

    The tree is sampled by a process of its own (:func:`watch`), not a thread of
    this one: a thread running in the training process is what makes a loader
    spawn its workers instead of forking them (``loader/executors/process/start.py``),
    so a sampler thread would measure the loader it turned into another. The
    sampler's own process is left out of the sums.

    Attributes
    ----------
    baseline
        :func:`tree_memory` on entry.
    peak
        The largest sum seen per metric (``rss``, ``pss``, ``uss``, ``processes``).
    samples
        How many times the tree was sampled.
    """

    def __init__(self, interval: float = 0.1) -> None:
        self.interval = interval
        self.baseline: dict[str, int] = {}
        self.peak: dict[str, int] = {}
        self.samples = 0
        self._watcher: subprocess.Popen | None = None

    def __enter__(self) -> "PeakMemory":
        self._watcher = subprocess.Popen([sys.executable, "-c", "from benchmarks.memory import watch; watch()",
                                          str(os.getpid()), str(self.interval)],
                                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        assert self._watcher.stdout is not None
        self._watcher.stdout.readline()  # "ready": it samples from now on
        self.baseline = tree_memory(exclude=self._watcher.pid)
        return self

    def __exit__(self, *exc: Any) -> None:
        assert self._watcher is not None
        # A line, not EOF: workers forked while the block ran (and still alive) hold the pipe's write end too.
        out, _ = self._watcher.communicate("stop\n", timeout=60)  # one last sample, then its peak
        found = json.loads(out)
        last = tree_memory(exclude=self._watcher.pid)
        self.samples = found["samples"] + 1
        self.peak = {key: max(found["peak"].get(key, 0), last.get(key, 0), self.baseline.get(key, 0))
                     for key in set(found["peak"]) | set(last) | set(self.baseline)}


def watch() -> None:
    """The sampler process of :class:`PeakMemory`: ``python -c ... ROOT_PID INTERVAL``. Samples the tree of
    ROOT_PID (itself left out) every INTERVAL seconds until a line (or EOF) comes on its stdin, then prints the
    peak as JSON."""
    root, interval = psutil.Process(int(sys.argv[1])), float(sys.argv[2])
    peak: dict[str, int] = {}
    samples = 0
    print("ready", flush=True)
    while True:
        for key, value in tree_memory(root, exclude=os.getpid()).items():
            peak[key] = max(peak.get(key, 0), value)
        samples += 1
        if select.select([sys.stdin], [], [], interval)[0]:  # readable: the block ended
            break
    print(json.dumps({"peak": peak, "samples": samples}), flush=True)


def memory_scenario(dataset_class: type, kwargs: dict, epochs: int, k: float, workers: int, batch_size: int,
                    repeats: int = 1, interval: float = 0.1, label: str = "") -> dict:
    """Peak memory of CachedLoader (`epochs` epochs, ``update_frequency=k``) vs torch's DataLoader.

    Both load ``dataset_class(**kwargs)`` (torch without any cache), alternating
    run by run. "Added" is the peak minus the tree's memory just before the
    run (the training process as it was, and any child already running). The
    allowance of the target is one generation of the store
    (``GenerationInfo.nbytes``): its pages are mapped by the readers, so they
    appear in the PSS of the processes.
    """
    import torch.utils.data  # noqa: F401  a training process has torch loaded: in both baselines

    metric = "pss" if has_pss() else "rss"
    runs: dict[str, list[dict]] = {"ours": [], "torch": []}
    store_bytes = 0
    for rep in range(repeats):
        for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
            try:
                with PeakMemory(interval) as mem:
                    if who == "ours":
                        cached_epochs(kwargs, epochs, batch_size, workers, k, f"{tmp}/cache",
                                      dataset_class=dataset_class)
                    else:
                        torch_epochs(kwargs, epochs, batch_size, workers, dataset_class=dataset_class)
                if who == "ours":
                    with open_store(f"{tmp}/cache", readonly=True) as store:
                        store_bytes = max([g.nbytes for g in store.generations() if g.committed] + [store_bytes])
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            runs[who].append({"baseline": mem.baseline, "peak": mem.peak, "samples": mem.samples})
    added = {who: [r["peak"][metric] - r["baseline"][metric] for r in rs] for who, rs in runs.items()}
    return {"label": label, "dataset": dataset_class.__name__, "kwargs": kwargs, "epochs": epochs,
            "update_frequency": None if k == float("inf") else k, "workers": workers, "batch_size": batch_size,
            "repeats": repeats, "interval_s": interval, "metric": metric, "runs": runs, "store_bytes": store_bytes,
            "ours_peak": summarize([r["peak"][metric] for r in runs["ours"]]),
            "torch_peak": summarize([r["peak"][metric] for r in runs["torch"]]),
            "ours_peak_rss": summarize([r["peak"]["rss"] for r in runs["ours"]]),
            "torch_peak_rss": summarize([r["peak"]["rss"] for r in runs["torch"]]),
            "ours_added": summarize(added["ours"]), "torch_added": summarize(added["torch"])}
