"""Expensive dataset: CachedLoader against torch's DataLoader, as ratios in one run.

Scenario (issue targets, DESIGN.md):

1. A dataset burning ~5 ms of CPU per sample (N=1000, 48 KiB samples),
   10 epochs, ``update_frequency=5``, 2 workers, against
   ``torch.utils.data.DataLoader(num_workers=2)``: total time <= 0.3x torch's,
   the refresh epoch <= 1.15x torch's mean epoch.
2. Cached-epoch throughput: a committed store of 48 KiB samples read by a
   CachedLoader (2 workers) vs a torch ``DataLoader(num_workers=2)`` reading
   the same generation through ``store.reader()``: >= 2x torch's samples/s;
   the same with small samples (16 float32 + a label): >= 10x.
3. Rotation R=4 against the plain loader (no cache): the dataset is called for
   ~1/4 of the served samples, and served samples/s >= 3x the plain loader's.

Run ``python -m benchmarks.expensive_dataset`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
import time
from typing import Any

import numpy as np

from loader import CachedLoader

from .common import median_spread, table, verdict
from .datasets import ExpensiveDataset


def torch_epochs(dataset_kwargs: dict, epochs: int, batch_size: int, workers: int) -> list[float]:
    """Per-epoch seconds of torch's DataLoader (epoch 0 includes starting the workers)."""
    import torch.utils.data as tud

    start = time.perf_counter()
    dl = tud.DataLoader(ExpensiveDataset(**dataset_kwargs), batch_size=batch_size, shuffle=True,
                        num_workers=workers, persistent_workers=workers > 0)
    times = []
    for _ in range(epochs):
        for _batch in dl:
            pass
        now = time.perf_counter()
        times.append(now - start)
        start = now
    del dl
    return times


def cached_epochs(dataset_kwargs: dict, epochs: int, batch_size: int, workers: int, k: float,
                  prefix: str, rotation: dict | None = None, cache: bool = True) -> tuple[list[float], list[Any]]:
    """Per-epoch seconds of CachedLoader (epoch 0 includes construction and worker start)."""
    start = time.perf_counter()
    setting = None if rotation or not cache else {"prefix": prefix, "update_frequency": k}
    with CachedLoader(ExpensiveDataset, dataset_kwargs, batch_size=batch_size, nb_worker=workers,
                      cache_setting=setting, rotation_setting=rotation) as loader:
        times = []
        for _ in range(epochs):
            for _batch in loader:
                pass
            now = time.perf_counter()
            times.append(now - start)
            start = now
        stats = list(loader.epoch_stats)
    return times, stats


def expensive_scenario(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int) -> dict:
    kwargs = {"n": n, "cost": cost}
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        ours, stats = cached_epochs(kwargs, epochs, batch_size, workers, k, f"{tmp}/cache")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    theirs = torch_epochs(kwargs, epochs, batch_size, workers)
    refresh = [t for t, s in zip(ours, stats) if s.mode == "generate"]
    torch_epoch = float(np.median(theirs))
    return {
        "n": n, "cost_ms": cost * 1e3, "epochs": epochs, "update_frequency": k, "workers": workers,
        "ours_epochs": ours, "torch_epochs": theirs, "modes": [s.mode for s in stats],
        "total_ratio": sum(ours) / sum(theirs),
        "refresh_ratio": max(refresh) / torch_epoch if refresh else math.nan,
        "refresh_ratio_steady": (refresh[-1] / torch_epoch) if len(refresh) > 1 else math.nan,
    }


def rotation_scenario(n: int, cost: float, rotation: int, workers: int, batch_size: int, epochs: int = 2) -> dict:
    """Rotation R vs the plain loader: dataset cost per served sample and served samples/s."""
    kwargs = {"n": n, "cost": cost}
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        plain, plain_stats = cached_epochs(kwargs, epochs, batch_size, workers, math.inf, f"{tmp}/unused",
                                           rotation=None, cache=False)
        rot, rot_stats = cached_epochs(kwargs, epochs, batch_size, workers, math.inf, f"{tmp}/unused",
                                       rotation={"medium": "memory", "rotation": rotation,
                                                 "size": max(4 * batch_size, n // 4)})
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    # Steady epochs only: the first includes starting the workers.
    plain_rate = n / plain[-1]
    served = rotation * n
    rot_rate = served / rot[-1]
    fresh_per_served = rot_stats[-1].computed / rot_stats[-1].samples
    return {"n": n, "rotation": rotation, "plain_samples_per_s": plain_rate, "rotation_samples_per_s": rot_rate,
            "rotation_fresh_samples_per_s": rot_stats[-1].computed / rot[-1],
            "served_ratio": rot_rate / plain_rate, "dataset_calls_per_served_sample": fresh_per_served,
            "plain_calls_per_served_sample": plain_stats[-1].computed / plain_stats[-1].samples}


class StoredSamples:
    """A cheap dataset of fixed samples, to fill a store fast for throughput runs."""

    def __init__(self, n: int, shape: tuple) -> None:
        self.n = n
        self.base = np.random.default_rng(0).random(tuple(shape), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        return self.base + np.float32(index % 7), index


def throughput_scenario(n: int, shape: tuple, batch_size: int, workers: int, repeats: int = 3) -> dict:
    """Cached-epoch samples/s: ours vs torch DataLoader over store.reader()."""
    import torch.utils.data as tud

    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        with CachedLoader(StoredSamples, {"n": n, "shape": shape}, batch_size=batch_size, nb_worker=workers,
                          device="cpu", cache_setting={"prefix": f"{tmp}/cache", "update_frequency": math.inf}) as loader:
            for _ in loader:  # the generate epoch commits the store
                pass
            ours = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for _batch in loader:
                    pass
                ours.append(time.perf_counter() - t)
            ours = ours[1:]  # the first read epoch warms the page cache and slots
            reader = loader.store.reader()
            dl = tud.DataLoader(reader, batch_size=batch_size, shuffle=True, num_workers=workers,
                                persistent_workers=True)
            theirs = []
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for _batch in dl:
                    pass
                theirs.append(time.perf_counter() - t)
            theirs = theirs[1:]  # the first epoch starts the workers
            del dl
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours_s, ours_spread = median_spread(ours)
    theirs_s, theirs_spread = median_spread(theirs)
    sample_bytes = int(np.prod(shape)) * 4 + 8
    return {"n": n, "shape": list(shape), "sample_bytes": sample_bytes,
            "ours_samples_per_s": n / ours_s, "ours_spread_s": ours_spread,
            "torch_samples_per_s": n / theirs_s, "torch_spread_s": theirs_spread,
            "ratio": theirs_s / ours_s}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about a minute)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    n, big_n, small_n = (400, 4000, 50000) if args.quick else (1000, 10000, 200000)
    exp = expensive_scenario(n=n, cost=0.005, epochs=10, k=5, workers=2, batch_size=64)
    print("Expensive dataset (5 ms CPU/sample), 10 epochs, update_frequency=5, 2 workers")
    rows = [[e, mode, f"{o:.2f}", f"{t:.2f}"]
            for e, (mode, o, t) in enumerate(zip(exp["modes"], exp["ours_epochs"], exp["torch_epochs"]))]
    rows.append(["total", "", f"{sum(exp['ours_epochs']):.2f}", f"{sum(exp['torch_epochs']):.2f}"])
    print(table(["epoch", "mode", "CachedLoader s", "torch DataLoader s"], rows))
    big = throughput_scenario(big_n, (3, 64, 64), 256, 2)
    small = throughput_scenario(small_n, (16,), 256, 2)
    rot = rotation_scenario(n=n, cost=0.005, rotation=4, workers=2, batch_size=64)
    print()
    print(table(["measure", "ratio", "target", ""], [
        ["total time vs torch", f"{exp['total_ratio']:.2f}x", "<= 0.30x", verdict(exp["total_ratio"] <= 0.3)],
        ["refresh epoch vs torch epoch (worst)", f"{exp['refresh_ratio']:.2f}x", "<= 1.15x",
         verdict(exp["refresh_ratio"] <= 1.15)],
        ["refresh epoch vs torch epoch (2nd)", f"{exp['refresh_ratio_steady']:.2f}x", "<= 1.15x",
         verdict(exp["refresh_ratio_steady"] <= 1.15)],
        [f"cached 48 KiB samples/s vs torch ({big['ours_samples_per_s']:.0f} vs {big['torch_samples_per_s']:.0f})",
         f"{big['ratio']:.1f}x", ">= 2x", verdict(big["ratio"] >= 2)],
        [f"cached small samples/s vs torch ({small['ours_samples_per_s']:.0f} vs {small['torch_samples_per_s']:.0f})",
         f"{small['ratio']:.1f}x", ">= 10x", verdict(small["ratio"] >= 10)],
        [f"rotation R=4: dataset calls per served sample (plain: {rot['plain_calls_per_served_sample']:.2f})",
         f"{rot['dataset_calls_per_served_sample']:.2f}", "~0.25", verdict(abs(rot["dataset_calls_per_served_sample"] - 0.25) < 0.02)],
        [f"rotation R=4: served samples/s vs plain ({rot['rotation_samples_per_s']:.0f} vs {rot['plain_samples_per_s']:.0f})",
         f"{rot['served_ratio']:.1f}x", ">= 3x", verdict(rot["served_ratio"] >= 3)],
    ]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"expensive": exp, "cached_48k": big, "cached_small": small, "rotation": rot}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
