"""Scenario 5: a simulated training step; the fraction of each epoch the loop waits on data.

The training loop sleeps `step` seconds per batch (a GPU step: the training
process uses no CPU, the workers have every core). Per epoch we record the
wall time and the time spent getting batches - inside ``iter()`` and
``next()``, the final ``next()`` that ends the epoch included - the same way
for every loader (:class:`~benchmarks.common.WaitClock`). Epoch 0 also counts
constructing the loader and starting its workers. For CachedLoader the
``wait_seconds`` it records itself (``loader.epoch_stats``) are kept beside.

Three loaders: CachedLoader with ``background_refresh=True`` (idle workers
compute the next generation during the cached epochs, so a refresh epoch
reads at cache speed: a performance target in docs/ARCHITECTURE.md), CachedLoader as configured by
default (``background_refresh="auto"``: the same, whenever the budget has room for a second
generation) and torch's DataLoader. Background refresh can only keep up when the
cached epochs leave the workers enough time: ``(K - 1) * batches * step``
must exceed ``n * cost / workers`` (:func:`idle_margin`); the sizes in
``benchmarks/__main__.py`` leave about a 2x margin.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Any, Callable, Iterable

from loader import CachedLoader

from .common import WaitClock, summarize
from .datasets import ExpensiveDataset

#: The loaders compared, in the order of the first repetition.
LOADERS = ["refresh", "ours", "torch"]


def _epochs(make: Callable[[], Any], epochs: int, step: float) -> tuple[list[float], list[float], Any]:
    """Run `epochs` epochs of the loader `make()` builds, sleeping `step` per batch.

    Returns per-epoch wall seconds, per-epoch wait seconds and the loader.
    """
    walls, waits = [], []
    start = time.perf_counter()
    loader = make()
    construction = time.perf_counter() - start
    for epoch in range(epochs):
        clock = WaitClock(loader)
        for _batch in clock:
            time.sleep(step)
        now = time.perf_counter()
        walls.append(now - start)
        waits.append(clock.seconds + (construction if epoch == 0 else 0.0))
        start = now
    return walls, waits, loader


def _ours(kwargs: dict, epochs: int, k: int, workers: int, batch_size: int, step: float,
          background_refresh: bool | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    loader = None
    try:
        def make() -> CachedLoader:
            cache = {"prefix": f"{tmp}/cache", "update_frequency": k}
            if background_refresh is not None:  # None: the default
                cache["background_refresh"] = background_refresh
            return CachedLoader(ExpensiveDataset, kwargs, batch_size=batch_size, nb_worker=workers,
                                cache_setting=cache)
        walls, waits, loader = _epochs(make, epochs, step)
        stats = list(loader.epoch_stats)
    finally:
        if loader is not None:
            loader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"wall": walls, "wait": waits, "modes": [s.mode for s in stats],
            "computed": [s.computed for s in stats], "loader_wait": [s.wait_seconds for s in stats]}


def _torch(kwargs: dict, epochs: int, workers: int, batch_size: int, step: float) -> dict:
    import torch.utils.data as tud

    def make() -> Iterable:
        return tud.DataLoader(ExpensiveDataset(**kwargs), batch_size=batch_size, shuffle=True,
                              num_workers=workers, persistent_workers=workers > 0)
    walls, waits, loader = _epochs(make, epochs, step)
    del loader
    return {"wall": walls, "wait": waits}


def _summary(runs: list[dict], epochs: int) -> dict:
    """Per-epoch medians of the wall time and of the waiting shares over the runs of one loader."""
    out = {"epoch_s": [statistics.median(r["wall"][e] for r in runs) for e in range(epochs)],
           "wait_fraction": [summarize([r["wait"][e] / r["wall"][e] for r in runs]) for e in range(epochs)]}
    if "modes" in runs[0]:
        out["modes"] = runs[0]["modes"]
        out["computed"] = runs[0]["computed"]
        out["loader_wait_fraction"] = [summarize([r["loader_wait"][e] / r["wall"][e] for r in runs])
                                       for e in range(epochs)]
    return out


def idle_margin(n: int, cost: float, k: int, workers: int, batch_size: int, step: float) -> float:
    """Worker time the K - 1 cached epochs leave idle (the loop's steps), over the time a generation takes."""
    return (k - 1) * -(-n // batch_size) * step * workers / (n * cost)


def training_step_scenario(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int,
                           step: float, repeats: int = 1) -> dict:
    """Per-epoch wait shares of CachedLoader (with and without background refresh) and torch's DataLoader.

    The loaders take turns (the order rotates every repetition); per epoch the
    shares ``wait / wall`` are summarised over the `repeats` runs of each.
    """
    kwargs = {"n": n, "cost": cost}
    runs: dict[str, list[dict]] = {name: [] for name in LOADERS}
    for rep in range(repeats):
        for name in LOADERS[rep % 3:] + LOADERS[:rep % 3]:
            if name == "torch":
                runs[name].append(_torch(kwargs, epochs, workers, batch_size, step))
            else:
                runs[name].append(_ours(kwargs, epochs, k, workers, batch_size, step,
                                        True if name == "refresh" else None))
    return {"n": n, "cost_ms": cost * 1e3, "epochs": epochs, "update_frequency": k, "workers": workers,
            "batch_size": batch_size, "step_ms": step * 1e3, "repeats": repeats,
            "batches_per_epoch": -(-n // batch_size), "idle_margin": idle_margin(n, cost, k, workers, batch_size, step),
            "runs": runs,
            **{name: _summary(runs[name], epochs) for name in LOADERS}}
