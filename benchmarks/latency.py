"""Start-up and idle costs: time to the first batch, and CPU the training process burns while it waits.

* First batch: seconds from ``CachedLoader(...)`` to the first batch in hand,
  on a warm machine (one untimed run first, so imports and files are in the
  page cache), with a cheap dataset so that only the loader's own start-up is
  measured: a committed store (a new run reusing the cache: read epoch) and an
  empty one (generate epoch); torch's ``DataLoader`` (fork) for reference.
* Idle CPU: a dataset that sleeps per sample (:class:`~benchmarks.datasets.SleepyDataset`)
  keeps the training loop waiting most of the time while the workers use no
  CPU; the training process's CPU time (all its threads, ``time.process_time``)
  over the wall time of the epochs after the first is the share of a core it
  burns. Polling would show here; handing over each batch costs a little.
"""

from __future__ import annotations

import math
import shutil
import tempfile
import time
from typing import Any

from loader import CachedLoader

from .common import summarize
from .datasets import SleepyDataset, StoredSamples


def _first_batch(make: Any) -> float:
    """Seconds from calling `make()` to the first batch of its first epoch (then it is closed)."""
    t = time.perf_counter()
    loader = make()
    it = iter(loader)
    next(it)
    seconds = time.perf_counter() - t
    close = getattr(loader, "close", None)
    if close is not None:
        close()
    del it, loader
    return seconds


def first_batch_scenario(repeats: int = 3, n: int = 2048, shape: tuple = (3, 64, 64), batch_size: int = 256,
                         workers: int = 2) -> dict:
    """Seconds to the first batch: ours with a committed store, ours with an empty one, torch.

    Each measurement is repeated `repeats` times after an untimed warm-up;
    the runs of the three alternate.
    """
    import torch.utils.data as tud

    kwargs = {"n": n, "shape": shape}
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    committed = f"{tmp}/committed"
    fresh = iter(range(10**6))

    def ours(prefix: str) -> CachedLoader:
        return CachedLoader(StoredSamples, kwargs, batch_size=batch_size, nb_worker=workers,
                            cache_setting={"prefix": prefix, "update_frequency": math.inf})

    makers = {
        "ours_committed_store": lambda: ours(committed),
        "ours_empty_store": lambda: ours(f"{tmp}/empty-{next(fresh)}"),
        "torch": lambda: tud.DataLoader(StoredSamples(**kwargs), batch_size=batch_size, shuffle=True,
                                        num_workers=workers),
    }
    times: dict[str, list[float]] = {name: [] for name in makers}
    try:
        with ours(committed) as loader:  # commit the store the first maker reads
            for _ in loader:
                pass
        for rep in range(repeats + 1):
            for name, make in makers.items():
                seconds = _first_batch(make)
                if rep:  # the first round warms the page cache
                    times[name].append(seconds)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"n": n, "shape": list(shape), "batch_size": batch_size, "workers": workers, "repeats": repeats,
            **{name: summarize(values) for name, values in times.items()}}


def _idle_cpu(loader: Any, epochs: int) -> tuple[float, float]:
    """(CPU seconds, wall seconds) of this process over `epochs` epochs after an untimed first one."""
    for _batch in loader:
        pass
    cpu, wall = time.process_time(), time.perf_counter()
    for _ in range(epochs):
        for _batch in loader:
            pass
    return time.process_time() - cpu, time.perf_counter() - wall


def idle_cpu_scenario(n: int = 48, delay: float = 0.1, batch_size: int = 4, workers: int = 2,
                      epochs: int = 2, repeats: int = 1) -> dict:
    """Share of a core the training process uses while it waits: ours (no cache) vs torch.

    With `n` samples sleeping `delay` s each, a batch arrives every
    ``batch_size * delay / workers`` seconds; the loop does nothing with it.
    """
    import torch.utils.data as tud

    kwargs = {"n": n, "delay": delay}
    shares: dict[str, list[float]] = {"ours": [], "torch": []}
    wall_s: dict[str, list[float]] = {"ours": [], "torch": []}
    for _ in range(repeats):
        with CachedLoader(SleepyDataset, kwargs, batch_size=batch_size, nb_worker=workers) as loader:
            cpu, wall = _idle_cpu(loader, epochs)
        shares["ours"].append(cpu / wall)
        wall_s["ours"].append(wall)
        dl = tud.DataLoader(SleepyDataset(**kwargs), batch_size=batch_size, num_workers=workers,
                            persistent_workers=True)
        cpu, wall = _idle_cpu(dl, epochs)
        del dl
        shares["torch"].append(cpu / wall)
        wall_s["torch"].append(wall)
    return {"n": n, "delay_s": delay, "batch_size": batch_size, "workers": workers, "epochs": epochs,
            "repeats": repeats, "batches_per_s": workers / (batch_size * delay),
            "ours_cpu_share": summarize(shares["ours"]), "torch_cpu_share": summarize(shares["torch"]),
            "ours_wall_s": summarize(wall_s["ours"]), "torch_wall_s": summarize(wall_s["torch"])}
