"""Streams: webdataset tar shards, cached by CachedLoader, against webdataset's own shuffle buffer.

Set-up (config ``streams``): 8 local tar shards of 1000 samples (48 KiB each: a float32 3x64x64 array
and its label), written with ``webdataset.TarWriter``; 6 epochs, 2 workers, batches of 64. Measured in
one run, ours and theirs taking turns:

- *webdataset*: ``WebDataset(urls, shardshuffle=True).shuffle(1000).decode().to_tuple("npy", "cls")``
  through torch's ``DataLoader(num_workers=2)``: every epoch reads and decodes the tar files, mixed by a
  buffer of 1000 samples in each worker;
- *ours*: ``CachedLoader(WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls"),
  shuffle=True, cache_setting=...)``: epoch 0 iterates the stream and writes it (through a shuffle
  buffer of ``stream_buffer`` = 1000 samples), epochs 1-5 read the cache in a new global permutation.

Figures: the cached epochs' samples/s over webdataset's (target >= 5x), the generate epoch's time over
webdataset's mean epoch (target <= 1.15x), and the shuffle quality: the mean number of distinct shards
in a batch of 64, ours (cached epochs) and webdataset's, over that of a uniform permutation of all the
samples (target >= 0.95x for ours).

Run ``python -m benchmarks --only streams`` (``--quick``: 8 shards of 250 samples).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from typing import Any

import numpy as np

from .common import summarize

SHAPE = (3, 64, 64)  # float32: 48 KiB


def write_shards(root: str, shards: int, per_shard: int) -> list[str]:
    """`shards` tar files of `per_shard` samples each; sample ``i`` holds ``i`` everywhere and label ``i``."""
    import webdataset as wds

    urls = []
    for shard in range(shards):
        path = os.path.join(root, f"shard-{shard:06d}.tar")
        with wds.TarWriter(path) as sink:
            for k in range(per_shard):
                i = shard * per_shard + k
                sink.write({"__key__": f"{i:08d}", "npy": np.full(SHAPE, i, dtype=np.float32), "cls": i})
        urls.append(path)
    return urls


def distinct_shards(labels: list[np.ndarray], per_shard: int) -> float:
    """Mean number of distinct shards among the samples of each full batch."""
    full = [b for b in labels if len(b) == len(labels[0])]
    return float(np.mean([len(np.unique(b // per_shard)) for b in full]))


def uniform_distinct(n: int, per_shard: int, batch: int, draws: int = 20) -> float:
    """The same figure for uniform permutations of all `n` samples (a mean over `draws` of them)."""
    rng = np.random.default_rng(0)
    return float(np.mean([distinct_shards(np.array_split(rng.permutation(n), n // batch), per_shard)
                          for _ in range(draws)]))


def _epochs(loader: Any, epochs: int, n: int) -> tuple[list[float], list[list[np.ndarray]]]:
    """Seconds of each epoch and the labels of its batches (every sample checked to come once)."""
    seconds, labels = [], []
    for _ in range(epochs):
        t0 = time.perf_counter()
        batches = [np.asarray(y).astype(np.int64) for _x, y in loader]
        seconds.append(time.perf_counter() - t0)
        served = np.concatenate(batches)
        if len(served) != n or len(np.unique(served)) != n:
            raise RuntimeError(f"an epoch served {len(served)} samples, {len(np.unique(served))} distinct, of {n}")
        labels.append(batches)
    return seconds, labels


def _webdataset(urls: list[str], epochs: int, n: int, workers: int, batch: int, buffer: int) -> tuple:
    import webdataset as wds
    from torch.utils.data import DataLoader

    stream = (wds.WebDataset(urls, shardshuffle=len(urls), seed=1).shuffle(buffer).decode()
              .to_tuple("npy", "cls"))
    loader = DataLoader(stream, batch_size=batch, num_workers=workers, persistent_workers=True)
    try:
        return _epochs(loader, epochs, n)
    finally:
        del loader


def _ours(urls: list[str], epochs: int, n: int, workers: int, batch: int, buffer: int, prefix: str) -> tuple:
    import webdataset as wds

    from loader import CachedLoader

    stream = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls")
    with CachedLoader(stream, batch_size=batch, num_workers=workers, shuffle=True, seed=1,
                      cache_setting={"prefix": prefix, "stream_buffer": buffer}) as loader:
        seconds, labels = _epochs(loader, epochs, n)
        modes = [s.mode.value for s in loader.epoch_stats]
    return seconds, labels, modes


def streams_scenario(shards: int, per_shard: int, epochs: int, workers: int, batch_size: int, buffer: int,
                     repeats: int) -> dict:
    """Ours and webdataset's, `repeats` times each, taking turns (see the module docstring)."""
    root = tempfile.mkdtemp(prefix="bench-streams-")
    n = shards * per_shard
    runs: dict[str, list] = {"wds": [], "ours": [], "modes": []}
    try:
        urls = write_shards(root, shards, per_shard)
        for r in range(repeats):
            runs["wds"].append(_webdataset(urls, epochs, n, workers, batch_size, buffer))
            prefix = os.path.join(root, f"cache-{r}")
            seconds, labels, modes = _ours(urls, epochs, n, workers, batch_size, buffer, prefix)
            runs["ours"].append((seconds, labels))
            runs["modes"].append(modes)
            shutil.rmtree(prefix, ignore_errors=True)
    finally:
        shutil.rmtree(root, ignore_errors=True)
    wds_epoch = [statistics.mean(s) for s, _ in runs["wds"]]
    ours_generate = [s[0] for s, _ in runs["ours"]]
    ours_cached = [statistics.mean(s[1:]) for s, _ in runs["ours"]]
    uniform = uniform_distinct(n, per_shard, batch_size)
    wds_distinct = [statistics.mean(distinct_shards(b, per_shard) for b in labels) for _, labels in runs["wds"]]
    ours_distinct = [statistics.mean(distinct_shards(b, per_shard) for b in labels[1:]) for _, labels in runs["ours"]]
    ours_generate_distinct = [distinct_shards(labels[0], per_shard) for _, labels in runs["ours"]]
    return {"shards": shards, "per_shard": per_shard, "n": n, "epochs": epochs, "workers": workers,
            "batch_size": batch_size, "buffer": buffer, "repeats": repeats, "sample_bytes": int(np.prod(SHAPE)) * 4,
            "modes": runs["modes"][-1],
            "wds_epoch_s": summarize(wds_epoch), "ours_generate_s": summarize(ours_generate),
            "ours_cached_epoch_s": summarize(ours_cached),
            "wds_samples_per_s": summarize([n / s for s in wds_epoch]),
            "ours_cached_samples_per_s": summarize([n / s for s in ours_cached]),
            "cached_ratio": summarize([w / o for w, o in zip(wds_epoch, ours_cached)]),
            "generate_ratio": summarize([g / w for g, w in zip(ours_generate, wds_epoch)]),
            "distinct_uniform": uniform, "distinct_wds": summarize(wds_distinct),
            "distinct_ours": summarize(ours_distinct), "distinct_ours_generate": summarize(ours_generate_distinct),
            "distinct_ratio": summarize([d / uniform for d in ours_distinct]),
            "wds_seconds": [s for s, _ in runs["wds"]], "ours_seconds": [s for s, _ in runs["ours"]]}


def markdown_section(st: dict) -> list[str]:
    """The scenario's section of the report."""
    from .tables import md_table, pm

    rows = [["webdataset + shuffle(%d), torch DataLoader" % st["buffer"], pm(st["wds_epoch_s"]), "-",
             pm(st["wds_samples_per_s"], 1, "{:.0f}"), f"{st['distinct_wds']['median']:.2f}"],
            ["ours, generate epoch (stream_buffer=%d)" % st["buffer"], pm(st["ours_generate_s"]),
             f"{st['generate_ratio']['median']:.2f}x", "-", f"{st['distinct_ours_generate']['median']:.2f}"],
            ["ours, cached epochs (global permutation)", pm(st["ours_cached_epoch_s"]),
             f"{1 / st['cached_ratio']['median']:.2f}x", pm(st["ours_cached_samples_per_s"], 1, "{:.0f}"),
             f"{st['distinct_ours']['median']:.2f}"],
            ["uniform permutation (expected)", "-", "-", "-", f"{st['distinct_uniform']:.2f}"]]
    return [f"### Streams: {st['shards']} tar shards x {st['per_shard']} samples of {st['sample_bytes'] // 1024} KiB, "
            f"{st['epochs']} epochs, {st['workers']} workers, batch {st['batch_size']}", "",
            f"Median of {st['repeats']} run(s) of each, taking turns. *s / epoch vs webdataset*: over webdataset's "
            "mean epoch; *distinct shards*: mean number of shards the samples of a batch come from.", "",
            md_table(["", "s / epoch", "vs webdataset", "samples/s", "distinct shards / batch"], rows, "lrrrr"), "",
            f"Cached epochs {st['cached_ratio']['median']:.2f}x webdataset's samples/s (target >= 5x); generate "
            f"epoch {st['generate_ratio']['median']:.2f}x webdataset's epoch (target <= 1.15x); shuffle quality "
            f"{st['distinct_ratio']['median']:.3f}x a uniform permutation's (target >= 0.95x; webdataset's "
            f"{st['distinct_wds']['median'] / st['distinct_uniform']:.3f}x)."]


def target_rows(results: dict) -> list:
    """The scenario's rows of the targets table."""
    from .tables import row, times

    st = results.get("streams")
    if not st:
        return []
    case = f"{st['shards']}x{st['per_shard']} samples, {st['workers']} workers"
    wds_share = st["distinct_wds"]["median"] / st["distinct_uniform"]
    return [row("stream, cached epoch: >= 5x webdataset + shuffle buffer", case,
                f"{st['ours_cached_samples_per_s']['median']:.0f} vs {st['wds_samples_per_s']['median']:.0f} samples/s",
                times(st["cached_ratio"]), ">= 5x", lambda r: r >= 5),
            row("stream, distinct shards per batch: >= 0.95x a uniform permutation", case,
                f"{st['distinct_ours']['median']:.2f} vs {st['distinct_uniform']:.2f} (webdataset "
                f"{st['distinct_wds']['median']:.2f}, {wds_share:.2f}x)", times(st["distinct_ratio"]), ">= 0.95x",
                lambda r: r >= 0.95),
            row("stream, generate epoch: <= 1.15x webdataset's epoch", case,
                f"{st['ours_generate_s']['median']:.2f} s vs {st['wds_epoch_s']['median']:.2f} s",
                times(st["generate_ratio"]), "<= 1.15x", lambda r: r <= 1.15)]
