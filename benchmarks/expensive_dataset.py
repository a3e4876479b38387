"""Expensive dataset: CachedLoader against torch's DataLoader, as ratios in one run.

Scenarios (their targets: docs/ARCHITECTURE.md):

1. A dataset burning ~5 ms of CPU per sample (N=1000, 48 KiB samples),
   10 epochs, ``update_frequency=5``, 2 workers, against
   ``torch.utils.data.DataLoader(num_workers=2)``: total time <= 0.3x torch's,
   the refresh epoch <= 1.15x torch's epoch.
2. Cached-epoch throughput (:mod:`benchmarks.throughput`): a committed store
   read by a CachedLoader vs a torch ``DataLoader(num_workers=2)`` reading the
   same generation through ``store.reader()``: >= 2x torch's samples/s for
   48 KiB samples, >= 10x for small ones (16 float32 + a label).
3. Rotation R=4 against the plain loader (no cache): the dataset is called for
   ~1/4 of the served samples, and served samples/s >= 3x the plain loader's.

Run ``python -m benchmarks.expensive_dataset`` (``--quick`` for a smaller run);
``python -m benchmarks`` runs these and every other scenario and writes a report.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import tempfile
import time
from typing import Any

from loader import CachedLoader

from .common import per_epoch, summarize, table, verdict
from .datasets import ExpensiveDataset


def _time_epochs(loader: Any, epochs: int, start: float) -> list[float]:
    """Seconds of each of `epochs` full passes over `loader`, the first counted from `start`."""
    times = []
    for _ in range(epochs):
        for _batch in loader:
            pass
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return times


def torch_epochs(dataset_kwargs: dict, epochs: int, batch_size: int, workers: int,
                 dataset_class: type = ExpensiveDataset) -> list[float]:
    """Per-epoch seconds of torch's DataLoader (epoch 0 includes starting the workers)."""
    import torch.utils.data as tud

    start = time.perf_counter()
    dl = tud.DataLoader(dataset_class(**dataset_kwargs), batch_size=batch_size, shuffle=True,
                        num_workers=workers, persistent_workers=workers > 0)
    times = _time_epochs(dl, epochs, start)
    del dl
    return times


def cached_epochs(dataset_kwargs: dict, epochs: int, batch_size: int, workers: int, k: float,
                  prefix: str, rotation: dict | None = None, cache: bool = True,
                  dataset_class: type = ExpensiveDataset) -> tuple[list[float], list[Any]]:
    """Per-epoch seconds of CachedLoader (epoch 0 includes construction and worker start)."""
    start = time.perf_counter()
    setting = None if rotation or not cache else {"prefix": prefix, "update_frequency": k}
    with CachedLoader(dataset_class, dataset_kwargs, batch_size=batch_size, nb_worker=workers,
                      cache_setting=setting, rotation_setting=rotation) as loader:
        times = _time_epochs(loader, epochs, start)
        stats = list(loader.epoch_stats)
    return times, stats


def expensive_scenario(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int,
                       repeats: int = 1) -> dict:
    """Scenario 1: `epochs` epochs of CachedLoader (``update_frequency=k``) vs torch's DataLoader.

    The two alternate, run by run (ours first on even runs, torch first on odd
    ones), so that a neighbour's load on a shared machine hits both. Ratios are
    taken within each pair of runs, then summarised over the `repeats` pairs.

    Returns
    -------
    dict
        Per-run epoch times of both, their per-epoch median/min/max, and the
        ratios: total time, epoch 0 (both start their workers, by fork: ours with
        ``start_method="auto"``) and the first refresh epoch ``k`` against torch's median
        steady epoch (1 and later) of the same pair.
    """
    kwargs = {"n": n, "cost": cost}
    ours_runs, torch_runs, modes = [], [], []
    for rep in range(repeats):
        for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
            if who == "torch":
                torch_runs.append(torch_epochs(kwargs, epochs, batch_size, workers))
                continue
            tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
            try:
                times, stats = cached_epochs(kwargs, epochs, batch_size, workers, k, f"{tmp}/cache")
            finally:
                shutil.rmtree(tmp, ignore_errors=True)
            ours_runs.append(times)
            modes = [s.mode for s in stats]
    refresh = next((e for e, mode in enumerate(modes) if mode == "generate" and e > 0), None)
    steady = [statistics.median(t[1:]) if len(t) > 1 else t[0] for t in torch_runs]
    return {
        "n": n, "cost_ms": cost * 1e3, "epochs": epochs, "update_frequency": k, "workers": workers,
        "batch_size": batch_size, "repeats": repeats, "modes": modes,
        "ours_runs": ours_runs, "torch_runs": torch_runs,
        "ours_epoch": per_epoch(ours_runs), "torch_epoch": per_epoch(torch_runs),
        "ours_total": summarize([sum(t) for t in ours_runs]),
        "torch_total": summarize([sum(t) for t in torch_runs]),
        "total_ratio": summarize([sum(o) / sum(t) for o, t in zip(ours_runs, torch_runs)]),
        "epoch0_ratio": summarize([o[0] / t[0] for o, t in zip(ours_runs, torch_runs)]),
        "refresh_epoch": refresh,
        "refresh_ratio": summarize([o[refresh] / s for o, s in zip(ours_runs, steady)]) if refresh else None,
    }


def rotation_scenario(n: int, cost: float, rotation: int, workers: int, batch_size: int,
                      repeats: int = 3) -> dict:
    """Scenario 3: rotation R against the plain loader (no cache), epoch by epoch.

    Both loaders stay open and their epochs alternate (plain, rotation, plain,
    ...); the first epoch of each (worker start-up) is left out, the next
    `repeats` are summarised. The window holds ``max(4 * batch_size, n // 4)``
    samples in RAM.
    """
    kwargs = {"n": n, "cost": cost}
    window = max(4 * batch_size, n // 4)
    times: dict[str, list[float]] = {"plain": [], "rotation": []}
    with CachedLoader(ExpensiveDataset, kwargs, batch_size=batch_size, nb_worker=workers) as plain, \
            CachedLoader(ExpensiveDataset, kwargs, batch_size=batch_size, nb_worker=workers,
                         rotation_setting={"medium": "memory", "rotation": rotation, "size": window}) as rot:
        for _ in range(repeats + 1):
            for name, loader in (("plain", plain), ("rotation", rot)):
                t = time.perf_counter()
                for _batch in loader:
                    pass
                times[name].append(time.perf_counter() - t)
        plain_stats, rot_stats = plain.epoch_stats[1:], rot.epoch_stats[1:]
    plain_rate = [s.samples / t for s, t in zip(plain_stats, times["plain"][1:])]
    served_rate = [s.samples / t for s, t in zip(rot_stats, times["rotation"][1:])]
    fresh_rate = [s.computed / t for s, t in zip(rot_stats, times["rotation"][1:])]
    return {"n": n, "cost_ms": cost * 1e3, "rotation": rotation, "window": window, "workers": workers,
            "batch_size": batch_size, "repeats": repeats,
            "plain_samples_per_s": summarize(plain_rate), "served_samples_per_s": summarize(served_rate),
            "fresh_samples_per_s": summarize(fresh_rate),
            "served_ratio": summarize([s / p for s, p in zip(served_rate, plain_rate)]),
            "fresh_ratio": summarize([f / p for f, p in zip(fresh_rate, plain_rate)]),
            "dataset_calls_per_served_sample": sum(s.computed for s in rot_stats) / sum(s.samples for s in rot_stats),
            "plain_calls_per_served_sample": sum(s.computed for s in plain_stats) / sum(s.samples for s in plain_stats)}


def main(argv: list[str] | None = None) -> int:
    from .throughput import throughput_scenario

    parser = argparse.ArgumentParser(prog="python -m benchmarks.expensive_dataset",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes (about a minute)")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    n, big_n, small_n = (400, 4000, 50000) if args.quick else (1000, 10000, 200000)
    exp = expensive_scenario(n=n, cost=0.005, epochs=10, k=5, workers=2, batch_size=64)
    print("Expensive dataset (5 ms CPU/sample), 10 epochs, update_frequency=5, 2 workers")
    rows = [[e, mode, f"{o:.2f}", f"{t:.2f}"] for e, (mode, o, t) in
            enumerate(zip(exp["modes"], exp["ours_epoch"]["median"], exp["torch_epoch"]["median"]))]
    rows.append(["total", "", f"{exp['ours_total']['median']:.2f}", f"{exp['torch_total']['median']:.2f}"])
    print(table(["epoch", "mode", "CachedLoader s", "torch DataLoader s"], rows))
    big = throughput_scenario(big_n, (3, 64, 64), 256, 2)
    small = throughput_scenario(small_n, (16,), 256, 2)
    rot = rotation_scenario(n=n, cost=0.005, rotation=4, workers=2, batch_size=64)
    total, epoch0, refresh = (exp[key]["median"] for key in ("total_ratio", "epoch0_ratio", "refresh_ratio"))
    calls, served = rot["dataset_calls_per_served_sample"], rot["served_ratio"]["median"]
    print()
    print(table(["measure", "ratio", "target", ""], [
        ["total time vs torch", f"{total:.2f}x", "<= 0.30x", verdict(total <= 0.3)],
        ["epoch 0 (generate, worker start-up) vs torch epoch 0", f"{epoch0:.2f}x", "<= 1.15x", verdict(epoch0 <= 1.15)],
        [f"epoch {exp['refresh_epoch']} (refresh) vs torch epoch", f"{refresh:.2f}x", "<= 1.15x",
         verdict(refresh <= 1.15)],
        [f"cached 48 KiB samples/s vs torch ({big['ours_samples_per_s']['median']:.0f} vs "
         f"{big['torch_samples_per_s']['median']:.0f})", f"{big['ratio']['median']:.1f}x", ">= 2x",
         verdict(big["ratio"]["median"] >= 2)],
        [f"cached small samples/s vs torch ({small['ours_samples_per_s']['median']:.0f} vs "
         f"{small['torch_samples_per_s']['median']:.0f})", f"{small['ratio']['median']:.1f}x", ">= 10x",
         verdict(small["ratio"]["median"] >= 10)],
        [f"rotation R=4: dataset calls per served sample (plain: {rot['plain_calls_per_served_sample']:.2f})",
         f"{calls:.2f}", "~0.25", verdict(abs(calls - 0.25) < 0.02)],
        ["rotation R=4: served samples/s vs plain", f"{served:.1f}x", ">= 3x", verdict(served >= 3)],
    ]))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"expensive": exp, "cached_48k": big, "cached_small": small, "rotation": rot}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
