"""Scenario 5: a simulated training step; the fraction of each epoch the loop waits on data.

The training loop sleeps `step` seconds per batch (a GPU step: the training
process uses no CPU, the workers have every core). Per epoch we record the
wall time and the time spent getting batches - inside ``iter()`` and
``next()``, the final ``next()`` that ends the epoch included - the same way
for both loaders (:class:`~benchmarks.common.WaitClock`). Epoch 0 also counts
constructing the loader and starting its workers. For CachedLoader the
``wait_seconds`` it records itself (``loader.epoch_stats``) are kept beside:
that is the time its training-process side blocked on the workers, without
the work it does itself (e.g. reading an in-RAM store, committing).

Background refresh (DESIGN.md) is not implemented: refresh epochs compute
every sample while the loop waits, like any plain loader.
"""

from __future__ import annotations

import shutil
import statistics
import tempfile
import time
from typing import Any, Iterable

from loader import CachedLoader

from .common import WaitClock, summarize
from .datasets import ExpensiveDataset


def _epochs(make: Any, epochs: int, step: float) -> tuple[list[float], list[float], Any]:
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


def _ours(kwargs: dict, epochs: int, k: int, workers: int, batch_size: int, step: float) -> dict:
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    loader = None
    try:
        def make() -> CachedLoader:
            return CachedLoader(ExpensiveDataset, kwargs, batch_size=batch_size, nb_worker=workers,
                                cache_setting={"prefix": f"{tmp}/cache", "update_frequency": k})
        walls, waits, loader = _epochs(make, epochs, step)
        stats = list(loader.epoch_stats)
    finally:
        if loader is not None:
            loader.close()
        shutil.rmtree(tmp, ignore_errors=True)
    return {"wall": walls, "wait": waits, "modes": [s.mode for s in stats],
            "loader_wait": [s.wait_seconds for s in stats]}


def _torch(kwargs: dict, epochs: int, workers: int, batch_size: int, step: float) -> dict:
    import torch.utils.data as tud

    def make() -> Iterable:
        return tud.DataLoader(ExpensiveDataset(**kwargs), batch_size=batch_size, shuffle=True,
                              num_workers=workers, persistent_workers=workers > 0)
    walls, waits, loader = _epochs(make, epochs, step)
    del loader
    return {"wall": walls, "wait": waits}


def training_step_scenario(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int,
                           step: float, repeats: int = 1) -> dict:
    """Per-epoch wait fraction of CachedLoader (``update_frequency=k``) and torch's DataLoader.

    Runs alternate (ours first on even repetitions); per epoch the fractions
    ``wait / wall`` are summarised over the `repeats` runs.
    """
    kwargs = {"n": n, "cost": cost}
    runs: dict[str, list[dict]] = {"ours": [], "torch": []}
    for rep in range(repeats):
        for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            if who == "ours":
                runs["ours"].append(_ours(kwargs, epochs, k, workers, batch_size, step))
            else:
                runs["torch"].append(_torch(kwargs, epochs, workers, batch_size, step))

    def fractions(who: str, key: str = "wait") -> list[dict]:
        return [summarize([r[key][e] / r["wall"][e] for r in runs[who]]) for e in range(epochs)]

    ours_frac = fractions("ours")
    later = [f["median"] for e, f in enumerate(ours_frac) if e > 0]
    later_cached = [f["median"] for e, (f, mode) in enumerate(zip(ours_frac, runs["ours"][0]["modes"]))
                    if e > 0 and mode == "read"]
    return {"n": n, "cost_ms": cost * 1e3, "epochs": epochs, "update_frequency": k, "workers": workers,
            "batch_size": batch_size, "step_ms": step * 1e3, "repeats": repeats,
            "modes": runs["ours"][0]["modes"], "runs": runs,
            "ours_wait_fraction": ours_frac, "ours_loader_wait_fraction": fractions("ours", "loader_wait"),
            "torch_wait_fraction": fractions("torch"),
            "ours_epoch_s": [statistics.median(r["wall"][e] for r in runs["ours"]) for e in range(epochs)],
            "torch_epoch_s": [statistics.median(r["wall"][e] for r in runs["torch"]) for e in range(epochs)],
            "ours_worst_after_first": max(later) if later else None,
            "ours_worst_cached_after_first": max(later_cached) if later_cached else None}
