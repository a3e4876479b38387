"""Read transform: the decode cached, a fresh random crop every epoch, against torch's DataLoader.

The dataset "decodes" (:class:`~benchmarks.datasets.DecodedImages`: 5 ms of CPU
per sample, a 256x256x3 uint8 image); ``read_transform`` takes a random 224x224
crop and a random horizontal flip (:func:`~benchmarks.datasets.random_crop_flip`).
torch's ``DataLoader(num_workers=2, shuffle=True)`` has no read transform: its
dataset decodes and crops in ``__getitem__``, every epoch
(:class:`~benchmarks.datasets.DecodedCroppedImages`). Measured in one run:

- the total time of 10 epochs (``update_frequency=5``), ours over torch's;
- the steady cached epochs' samples/s (read epochs other than the first read
  epoch of each generation, which times where to gather) against the
  transform's limit: the transform alone in 2 processes, over images already in
  their memory, stacked into batches as the default collate does;
- the augmentation diversity: distinct crops (offset and flip, which the
  transform writes into the sample as ``"crop"``) per sample over the 10 epochs,
  ours with ``read_transform``, ours without it (the crop done in
  ``__getitem__`` and cached with the decode: one crop per generation) and torch's.

Run ``python -m benchmarks --only read_transform`` (``--quick`` for a smaller run).
"""

from __future__ import annotations

import multiprocessing as mp
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from .common import per_epoch, summarize
from .datasets import CROP_SIDE, IMAGE_SIDE, DecodedCroppedImages, DecodedImages, decoded_image, random_crop_flip

#: How many different crops the transform draws from: every offset, flipped or not.
CROP_CHOICES = (IMAGE_SIDE - CROP_SIDE + 1) ** 2 * 2
#: Timed passes of the transform's limit (each over every sample once); the median is its figure.
LIMIT_PASSES = 5
#: What of ``EpochStats.extra`` the report keeps: where the epoch gathered, what each place cost per
#: batch, and the samples of the next generation the workers computed beside its batches.
EXTRA_KEYS = ("gather", "gather_costs", "gather_split", "gather_probed", "background_computed")


class CropLog:
    """The crop each sample got in each epoch, as one code per (epoch, sample)."""

    def __init__(self, epochs: int, n: int) -> None:
        self.codes = np.full((epochs, n), -1, dtype=np.int64)

    def record(self, epoch: int, batch: dict) -> None:
        index, crop = np.asarray(batch["index"]), np.asarray(batch["crop"])
        self.codes[epoch, index] = (crop[:, 0] * IMAGE_SIDE + crop[:, 1]) * 2 + crop[:, 2]

    def distinct_per_sample(self) -> float:
        """Mean over the samples of the distinct crops each got over the epochs."""
        if (self.codes < 0).any():
            missing = int((self.codes < 0).sum())
            raise RuntimeError(f"{missing} (epoch, sample) pairs were never served")
        ordered = np.sort(self.codes, axis=0)
        return float((1 + (np.diff(ordered, axis=0) != 0).sum(axis=0)).mean())


def expected_distinct(epochs: int, choices: int = CROP_CHOICES) -> float:
    """Distinct crops per sample expected from `epochs` independent uniform draws among `choices`."""
    return choices * (1 - (1 - 1 / choices) ** epochs)


def _epochs(loader: Any, epochs: int, start: float, log: CropLog) -> list[float]:
    """Seconds of each of `epochs` passes over `loader` (the first counted from `start`), logging crops."""
    times = []
    for e in range(epochs):
        for batch in loader:
            log.record(e, batch)
        now = time.perf_counter()
        times.append(now - start)
        start = now
    return times


def ours_run(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int,
             read_transform: bool) -> dict:
    """One CachedLoader run of `epochs` epochs: with ``read_transform`` (the decode cached, the crop
    drawn per epoch) or without (the crop in ``__getitem__``, cached with the decode)."""
    from loader import CachedLoader

    log = CropLog(epochs, n)
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        start = time.perf_counter()
        dataset = DecodedImages if read_transform else DecodedCroppedImages
        with CachedLoader(dataset, {"n": n, "cost": cost}, batch_size=batch_size, nb_worker=workers,
                          cache_setting={"prefix": f"{tmp}/cache", "update_frequency": k},
                          read_transform=random_crop_flip if read_transform else None) as loader:
            times = _epochs(loader, epochs, start, log)
            stats = list(loader.epoch_stats)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"epoch_s": times, "distinct": log.distinct_per_sample(),
            "epochs": [{"mode": str(s.mode), "generation": s.generation, "computed": s.computed, "read": s.read,
                        "wait_s": s.wait_seconds, **{key: s.extra[key] for key in EXTRA_KEYS if key in s.extra}}
                       for s in stats]}


def torch_run(n: int, cost: float, epochs: int, workers: int, batch_size: int) -> dict:
    """One run of torch's ``DataLoader(shuffle=True)``, decode and crop in ``__getitem__`` every epoch."""
    import torch.utils.data as tud

    log = CropLog(epochs, n)
    start = time.perf_counter()
    dl = tud.DataLoader(DecodedCroppedImages(n, cost), batch_size=batch_size, shuffle=True,
                        num_workers=workers, persistent_workers=workers > 0)
    times = _epochs(dl, epochs, start, log)
    del dl
    return {"epoch_s": times, "distinct": log.distinct_per_sample()}


def steady_epochs(epochs: list[dict]) -> list[int]:
    """Read epochs that computed nothing and whose generation an earlier read epoch already read."""
    seen: set[int | None] = set()
    steady = []
    for e, s in enumerate(epochs):
        if s["mode"] != "read":
            continue
        if s["generation"] in seen and s["computed"] == 0:
            steady.append(e)
        seen.add(s["generation"])
    return steady


def _limit_process(rank: int, n: int, workers: int, batch_size: int, barrier: Any, out: Any) -> None:
    """One process of the transform's limit: its share of the batches, over images it holds."""
    from cachestore.format.collate import stack_samples

    order = np.random.default_rng(rank).permutation(n)
    batches = [order[b:b + batch_size] for b in range(0, n, batch_size)][rank::workers]
    images = {int(i): {"image": decoded_image(int(i)), "index": int(i)} for b in batches for i in b}
    rng = np.random.default_rng()
    for p in range(LIMIT_PASSES + 1):  # pass 0 warms up (allocator, page faults), untimed
        barrier.wait()
        start = time.perf_counter()
        for b in batches:
            stack_samples([random_crop_flip(images[int(i)], rng) for i in b])
        if p:
            out.put((rank, p, start, time.perf_counter()))


def transform_limit(n: int, workers: int, batch_size: int) -> dict:
    """Samples/s of the transform alone in `workers` processes, each over its share of `n` images
    already in its memory, collated into batches of `batch_size`: per pass, `n` over the time from
    the first process's start to the last one's end (``perf_counter`` is one clock for all)."""
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(workers), ctx.Queue()
    procs = [ctx.Process(target=_limit_process, args=(r, n, workers, batch_size, barrier, out), daemon=True)
             for r in range(workers)]
    for proc in procs:
        proc.start()
    try:
        ends = [out.get(timeout=300) for _ in range(workers * LIMIT_PASSES)]
    finally:
        for proc in procs:
            proc.join(timeout=30)
            if proc.is_alive():
                proc.terminate()
    rates = []
    for p in range(1, LIMIT_PASSES + 1):
        spans = [(start, end) for _, q, start, end in ends if q == p]
        rates.append(n / (max(e for _, e in spans) - min(s for s, _ in spans)))
    return {"samples_per_s": statistics.median(rates), "passes": rates}


def read_transform_scenario(n: int, cost: float, epochs: int, k: int, workers: int, batch_size: int,
                            repeats: int = 1) -> dict:
    """`epochs` epochs of CachedLoader with ``read_transform``, of CachedLoader without it, and of
    torch's DataLoader, plus the transform's limit, `repeats` times.

    Each repeat runs the four in turn, starting one later each time, so that a neighbour's load
    on a shared machine hits them all; ratios are taken within a repeat, then summarised.

    Returns
    -------
    dict
        Per-run epoch times and per-epoch stats, their per-epoch median/min/max, the totals and the
        ratios (total time, steady cached samples/s over the transform's limit), the distinct crops
        per sample of each loader.
    """
    runs: dict[str, list[dict]] = {"ours": [], "ours_plain": [], "torch": [], "limit": []}
    jobs = {"ours": lambda: ours_run(n, cost, epochs, k, workers, batch_size, read_transform=True),
            "ours_plain": lambda: ours_run(n, cost, epochs, k, workers, batch_size, read_transform=False),
            "torch": lambda: torch_run(n, cost, epochs, workers, batch_size),
            "limit": lambda: transform_limit(n, workers, batch_size)}
    names = list(jobs)
    for rep in range(repeats):
        for name in names[rep % len(names):] + names[:rep % len(names)]:
            runs[name].append(jobs[name]())
    ours, plain, torch, limit = (runs[name] for name in names)
    steady = [steady_epochs(r["epochs"]) for r in ours]
    steady_rates = [statistics.median(n / r["epoch_s"][e] for e in s) for r, s in zip(ours, steady)]
    epoch_times = {name: [r["epoch_s"] for r in runs[name]] for name in ("ours", "ours_plain", "torch")}
    return {
        "n": n, "cost_ms": cost * 1e3, "epochs": epochs, "update_frequency": k, "workers": workers,
        "batch_size": batch_size, "repeats": repeats, "image_side": IMAGE_SIDE, "crop_side": CROP_SIDE,
        "crop_choices": CROP_CHOICES, "expected_distinct_uniform": expected_distinct(epochs),
        "modes": [s["mode"] for s in ours[-1]["epochs"]], "steady_epochs": steady[-1],
        "ours_stats": [r["epochs"] for r in ours], "ours_plain_stats": [r["epochs"] for r in plain],
        **{f"{name}_runs": times for name, times in epoch_times.items()},
        **{f"{name}_epoch": per_epoch(times) for name, times in epoch_times.items()},
        **{f"{name}_total": summarize([sum(t) for t in times]) for name, times in epoch_times.items()},
        "total_ratio": summarize([sum(o["epoch_s"]) / sum(t["epoch_s"]) for o, t in zip(ours, torch)]),
        "plain_total_ratio": summarize([sum(o["epoch_s"]) / sum(t["epoch_s"]) for o, t in zip(plain, torch)]),
        "ours_steady_samples_per_s": summarize(steady_rates),
        "limit_samples_per_s": summarize([r["samples_per_s"] for r in limit]),
        "limit_passes": [r["passes"] for r in limit],
        "steady_ratio": summarize([o / r["samples_per_s"] for o, r in zip(steady_rates, limit)]),
        "distinct": {name: summarize([r["distinct"] for r in runs[name]]) for name in ("ours", "ours_plain", "torch")},
    }
