"""Scenario 2: cached-epoch throughput per backend, against torch's DataLoader and memcpy.

A CachedLoader generates one generation of :class:`~benchmarks.datasets.StoredSamples`
(``update_frequency=inf``), then its cached epochs alternate with the epochs of
a torch ``DataLoader(store.reader(), num_workers=workers)`` reading the same
committed generation one sample at a time, as the performance target says. Both
deliver torch tensors (ours: ``device="cpu"``). The raw store gather
(``reader.get_batch`` into reused buffers, no loader, see
:mod:`benchmarks.store_read`) is timed on the same generation: the ceiling
the loader could reach.

For ``backend="memory"`` the store lives in the training process, so the
loader reads cached epochs there (inline or by its threads); torch's workers are forked
from the training process and inherit the arrays (the reader would pickle
them by value under spawn).
"""

from __future__ import annotations

import math
import shutil
import statistics
import tempfile
import time

import numpy as np

from cachestore import open_store
from loader import CachedLoader

from .common import summarize
from .datasets import StoredSamples
from .store_read import epoch_times


def throughput_scenario(n: int, shape: tuple, batch_size: int, workers: int, backend: str = "memmap",
                        repeats: int = 3) -> dict:
    """Samples/s of cached epochs: ours vs torch's DataLoader over ``store.reader()``, and the raw gather.

    Parameters
    ----------
    n, shape
        Samples in the store and the shape of each float32 array (plus an int label).
    batch_size, workers
        The same for both loaders.
    backend
        ``"memmap"``, ``"lmdb"`` or ``"memory"``.
    repeats
        Timed epochs of each, after one untimed warm-up epoch each (ours: four, its first four
        read epochs measure where to gather; page
        mapping, slots, torch's worker start-up).
    """
    import torch.utils.data as tud

    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    ours, theirs, no_workers, back_to_back = [], [], [], []
    try:
        setting = {"prefix": f"{tmp}/cache", "update_frequency": math.inf, "backend": backend}
        with CachedLoader(StoredSamples, {"n": n, "shape": shape}, batch_size=batch_size, nb_worker=workers,
                          device="cpu", cache_setting=setting) as loader:
            t = time.perf_counter()
            for _ in loader:  # the generate epoch commits the store
                pass
            generate_s = time.perf_counter() - t
            reader = loader.store.reader()
            gather = epoch_times(reader, n, batch_size, repeats, seed=0)
            # The split of a batch's time: the gather alone (verify=False), its checksums, the hand-off.
            unverified = open_store(loader.store.path, backend, verify=False).reader() \
                if backend != "memory" else reader
            raw = epoch_times(unverified, n, batch_size, repeats, seed=1)
            dl = tud.DataLoader(reader, batch_size=batch_size, shuffle=True, num_workers=workers,
                                persistent_workers=workers > 0)
            for _ in range(3):  # the first four read epochs measure where to gather (loader/epochs/reads/placement.py)
                for _batch in loader:
                    pass
            # The same store read by a loader without workers, in the same rounds (a memory store
            # lives in its loader: the one above reads it in-process already).
            inline = None if backend == "memory" else CachedLoader(
                StoredSamples, {"n": n, "shape": shape}, batch_size=batch_size, nb_worker=0, device="cpu",
                cache_setting=setting)
            rounds = [(ours, loader), (theirs, dl)] + ([(no_workers, inline)] if inline is not None else [])
            for _ in range(repeats + 1):  # alternate, so a neighbour's load hits all
                for times, batches in rounds:
                    t = time.perf_counter()
                    for _batch in batches:
                        pass
                    times.append(time.perf_counter() - t)
            del dl
            if inline is not None:
                inline.close()
            # And as a training run has them: our epochs one after another, nothing in between (on
            # this VM an epoch that follows a pause of 0.1 s or more ran slower, threads most).
            for _ in range(repeats + 1):
                t = time.perf_counter()
                for _batch in loader:
                    pass
                back_to_back.append(time.perf_counter() - t)
            modes = [s.mode for s in loader.epoch_stats]
            gather_place = loader.epoch_stats[-1].extra.get("gather")
            loader_costs = loader.epoch_stats[-1].extra.get("gather_costs")
            reader.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    ours, theirs, no_workers, back_to_back = ours[1:], theirs[1:], no_workers[1:], back_to_back[1:]
    sample_bytes = int(np.prod(shape)) * 4 + 8
    batches = -(-n // batch_size)
    per_batch = {k: statistics.median(v) / batches for k, v in (("raw", raw), ("verified", gather), ("ours", ours))}
    return {"backend": backend, "n": n, "shape": list(shape), "sample_bytes": sample_bytes,
            "batch_size": batch_size, "workers": workers, "repeats": repeats, "modes": modes,
            "ours_reads_in": f"{workers} threads" if gather_place == "threads"
            else "training process" if backend == "memory" or gather_place == "main" else f"{workers} workers",
            "generate_samples_per_s": n / generate_s,
            "ours_samples_per_s": summarize([n / s for s in ours]),
            "ours_back_to_back_samples_per_s": summarize([n / s for s in back_to_back]),
            "torch_samples_per_s": summarize([n / s for s in theirs]),
            "gather_samples_per_s": summarize([n / s for s in gather]),
            "gather_place": gather_place,
            "gather_costs": loader_costs,
            "no_workers_samples_per_s": summarize([n / s for s in no_workers]) if no_workers else None,
            # Seconds per batch: store gather without checksums, what checking them adds, and the rest
            # of a loader epoch (hand-off from workers, device move, reorder) over the verified gather.
            "split_s_per_batch": {"gather": per_batch["raw"],
                                  "verify": max(0.0, per_batch["verified"] - per_batch["raw"]),
                                  "hand_off": max(0.0, per_batch["ours"] - per_batch["verified"])},
            "ratio": summarize([t / o for o, t in zip(ours, theirs)])}
