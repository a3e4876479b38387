"""Set-up time: the first epoch when the training script does something between building the loader and the loop.

A training script builds its loader, then its model (seconds of CPU: layers,
weights, a compile), then loops. Both loaders start their workers at the first
``iter()``, as torch's ``DataLoader`` does (CachedLoader forks them with the
default ``start_method="auto"`` where nothing unsafe runs in the training
process, else spawns them: a fresh interpreter with its imports), so each
first epoch includes that start. Two cases (docs/ARCHITECTURE.md):

* **gap**: construct the loader, spend `gap` seconds of CPU in the training
  process's main thread (:func:`~benchmarks.datasets.burn_cpu`: building a
  model uses CPU and holds the GIL, unlike a sleep), then time the first epoch
  from the start of the loop to its end. Target: ours <= 1.05x torch. The wall
  time from construction to the end of the first epoch (set-up included) is
  reported beside, so that no cost is hidden by where the clock starts, and
  so are the CPU seconds the workers used from their start to their exit
  (steadier than wall times when neighbours load the machine).
* **no gap**: the loop starts right after construction; seconds from the
  start of construction to the first batch (target for ours: <= 1 s), and the
  constructor's own wall time (small: it starts nothing).

CachedLoader with default settings (a cache in a temporary directory, so the
first epoch is a generate epoch that also writes the store) against
``DataLoader(dataset, batch_size, shuffle=True, num_workers=workers)`` (not
persistent: its workers stop at the end of the epoch, which the timed epoch
includes, as a training loop sees it). Both loaders are fully shut down
between repetitions; ours and torch alternate, so a neighbour's load hits both.

What a spawned worker imports is part of its start: the training script's main
module again, besides the dataset's (about 0.3 s of CPU here, 1.5 s more for a
script or dataset module that imports torch); a forked one imports nothing
(:mod:`benchmarks.first_epoch` measures both kinds of dataset module).
"""

from __future__ import annotations

import resource
import shutil
import tempfile
import time
from typing import Any

from loader import CachedLoader

from .common import summarize
from .datasets import ExpensiveDataset, burn_cpu


def _ours(kwargs: dict, batch_size: int, workers: int, prefix: str) -> CachedLoader:
    return CachedLoader(ExpensiveDataset, kwargs, batch_size=batch_size, nb_worker=workers,
                        cache_setting={"prefix": prefix})


def _torch(kwargs: dict, batch_size: int, workers: int) -> Any:
    import torch.utils.data as tud

    return tud.DataLoader(ExpensiveDataset(**kwargs), batch_size=batch_size, shuffle=True, num_workers=workers)


def _children_cpu() -> float:
    """CPU seconds of this process's children that have exited and been waited for (the loaders' workers)."""
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def _gap_ours(kwargs: dict, batch_size: int, workers: int, gap: float) -> dict:
    """Build ours, burn `gap` s of CPU, time the first epoch; fresh cache directory, shut down after."""
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        children = _children_cpu()
        t = time.perf_counter()
        with _ours(kwargs, batch_size, workers, f"{tmp}/cache") as loader:
            constructed = time.perf_counter()
            burn_cpu(gap)
            start, cpu = time.perf_counter(), time.process_time()
            for _batch in loader:
                pass
            end, cpu = time.perf_counter(), time.process_time() - cpu
            stats = loader.epoch_stats[0]
        children = _children_cpu() - children  # closed: the workers have exited
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"construct_s": constructed - t, "gap_s": start - constructed, "epoch_s": end - start,
            "total_s": end - t, "epoch_cpu_s": cpu, "workers_cpu_s": children, "mode": stats.mode,
            "loader_wait_s": stats.wait_seconds}


def _gap_torch(kwargs: dict, batch_size: int, workers: int, gap: float) -> dict:
    """Build torch's loader, burn `gap` s of CPU, time the first epoch (worker start at ``iter()`` included)."""
    children = _children_cpu()
    t = time.perf_counter()
    dl = _torch(kwargs, batch_size, workers)
    constructed = time.perf_counter()
    burn_cpu(gap)
    start, cpu = time.perf_counter(), time.process_time()
    it = iter(dl)
    for _batch in it:
        pass
    end, cpu = time.perf_counter(), time.process_time() - cpu
    del it, dl  # not persistent: the exhausted iterator has stopped and joined its workers already
    return {"construct_s": constructed - t, "gap_s": start - constructed, "epoch_s": end - start,
            "total_s": end - t, "epoch_cpu_s": cpu, "workers_cpu_s": _children_cpu() - children}


def _first_batch_ours(kwargs: dict, batch_size: int, workers: int) -> dict:
    """Seconds of the constructor, and from the start of construction to the first batch."""
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        t = time.perf_counter()
        with _ours(kwargs, batch_size, workers, f"{tmp}/cache") as loader:
            constructed = time.perf_counter()
            it = iter(loader)
            next(it)
            first = time.perf_counter()
            del it
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"construct_s": constructed - t, "first_batch_s": first - t}


def _first_batch_torch(kwargs: dict, batch_size: int, workers: int) -> dict:
    t = time.perf_counter()
    dl = _torch(kwargs, batch_size, workers)
    constructed = time.perf_counter()
    it = iter(dl)
    next(it)
    first = time.perf_counter()
    del it, dl  # the iterator's finaliser stops its workers
    return {"construct_s": constructed - t, "first_batch_s": first - t}


def setup_time_scenario(n: int = 640, cost: float = 0.005, workers: int = 2, batch_size: int = 64,
                        gap: float = 1.0, repeats: int = 3) -> dict:
    """First epoch after a set-up gap, and first batch without one: CachedLoader vs torch's DataLoader.

    Parameters
    ----------
    n, cost
        Samples of the :class:`~benchmarks.datasets.ExpensiveDataset` and CPU
        seconds each: ``n * cost / workers`` is about the compute of an epoch.
        Best a multiple of ``workers * batch_size``: both loaders hand out
        whole batches in turn, so a last odd batch leaves a worker idle.
    workers, batch_size
        The same for both loaders.
    gap
        CPU seconds the training process spends "building the model" between
        constructing the loader and starting the loop (in its main thread).
    repeats
        Repetitions of each case; ours and torch alternate (ours first on even
        repetitions), each with a fresh loader and a fresh cache directory.

    Returns
    -------
    dict
        ``gap``: per-run figures of both and the summaries
        ``ours_first_epoch_s``, ``torch_first_epoch_s`` and ``ratio`` (ours /
        torch within each pair of runs), the same for the wall time from
        construction to the end of the first epoch (``ours_total_s``,
        ``torch_total_s``, ``total_ratio``), the wall time the gap took, and
        CPU seconds: of the workers from their start to their exit
        (``*_workers_cpu_s``), of the training process during the epoch
        (``*_epoch_cpu_s``);
        ``no_gap``: ``ours_first_batch_s``,
        ``torch_first_batch_s`` and ``ours_construct_s``.
    """
    kwargs = {"n": n, "cost": cost}
    # Untimed: the first spawn of a run reads the interpreter and the modules from disk.
    _first_batch_ours(kwargs, batch_size, workers)
    _first_batch_torch(kwargs, batch_size, workers)
    gap_runs: dict[str, list[dict]] = {"ours": [], "torch": []}
    first_runs: dict[str, list[dict]] = {"ours": [], "torch": []}
    for rep in range(repeats):
        for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            if who == "ours":
                gap_runs[who].append(_gap_ours(kwargs, batch_size, workers, gap))
            else:
                gap_runs[who].append(_gap_torch(kwargs, batch_size, workers, gap))
    for rep in range(repeats):
        for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            if who == "ours":
                first_runs[who].append(_first_batch_ours(kwargs, batch_size, workers))
            else:
                first_runs[who].append(_first_batch_torch(kwargs, batch_size, workers))
    ours, torch = gap_runs["ours"], gap_runs["torch"]
    return {
        "n": n, "cost_ms": cost * 1e3, "workers": workers, "batch_size": batch_size, "gap_s": gap,
        "repeats": repeats,
        "gap": {"runs": gap_runs, "mode": ours[0]["mode"],
                "ours_first_epoch_s": summarize([r["epoch_s"] for r in ours]),
                "torch_first_epoch_s": summarize([r["epoch_s"] for r in torch]),
                "ratio": summarize([o["epoch_s"] / t["epoch_s"] for o, t in zip(ours, torch)]),
                "ours_total_s": summarize([r["total_s"] for r in ours]),
                "torch_total_s": summarize([r["total_s"] for r in torch]),
                "total_ratio": summarize([o["total_s"] / t["total_s"] for o, t in zip(ours, torch)]),
                "ours_workers_cpu_s": summarize([r["workers_cpu_s"] for r in ours]),
                "torch_workers_cpu_s": summarize([r["workers_cpu_s"] for r in torch]),
                "ours_epoch_cpu_s": summarize([r["epoch_cpu_s"] for r in ours]),
                "torch_epoch_cpu_s": summarize([r["epoch_cpu_s"] for r in torch]),
                "ours_gap_wall_s": summarize([r["gap_s"] for r in ours]),
                "torch_gap_wall_s": summarize([r["gap_s"] for r in torch]),
                "ours_loader_wait_s": summarize([r["loader_wait_s"] for r in ours])},
        "no_gap": {"runs": first_runs,
                   "ours_first_batch_s": summarize([r["first_batch_s"] for r in first_runs["ours"]]),
                   "torch_first_batch_s": summarize([r["first_batch_s"] for r in first_runs["torch"]]),
                   "ours_construct_s": summarize([r["construct_s"] for r in first_runs["ours"]]),
                   "torch_construct_s": summarize([r["construct_s"] for r in first_runs["torch"]])},
    }
