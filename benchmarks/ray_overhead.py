"""What Ray costs: a generate epoch computed by 2 Ray actors against 2 local worker processes.

Same machine, same dataset (:class:`~benchmarks.datasets.ExpensiveDataset`: ~5 ms of CPU per
48 KiB sample), same cache settings; the figure is the ratio of the two epoch times in one run,
so the machine's speed cancels out. What the ratio contains: batches and records travelling
through Ray's object store instead of shared memory and the workers' own shards, the training
process writing every record into the store itself (an actor may be on another machine), and
Ray's per-call overhead. See ``loader/executors/ray.py``.

Workers are warm in every timed epoch: with ``update_frequency=2`` epochs 0, 2, 4 ... generate;
epoch 0 (which includes starting the workers) is reported apart and the later ones are timed,
the two loaders taking turns epoch by epoch.
Runs on a local Ray instance bound to 127.0.0.1 (``python -m benchmarks.ray_overhead``; needs
``pip install "cachestore[ray]"``). Not part of ``python -m benchmarks``: starting Ray takes
seconds and half a GiB.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import tempfile
import time
from typing import Any

# Read by Ray when it is imported: no usage reports, and 127.0.0.1 stays 127.0.0.1.
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")

from loader import CachedLoader  # noqa: E402

from .datasets import ExpensiveDataset  # noqa: E402

WORKERS = 2
BATCH = 32


def make_loader(executor: str, n: int, cost: float, prefix: str) -> CachedLoader:
    """A loader with 2 workers of `executor` whose even epochs generate (``update_frequency=2``)."""
    options: dict[str, Any] = {"executor": executor}
    if executor == "ray":
        options["executor_options"] = {"num_workers": WORKERS, "start_timeout": 120}
    else:
        options["nb_worker"] = WORKERS
    return CachedLoader(ExpensiveDataset, {"n": n, "cost": cost}, batch_size=BATCH, seed=0,
                        cache_setting={"prefix": prefix, "update_frequency": 2}, **options)


def timed_epoch(loader: CachedLoader) -> tuple[str, float]:
    start = time.perf_counter()
    for _batch in loader:
        pass
    return str(loader.epoch_stats[-1].mode), time.perf_counter() - start


def run(n: int = 400, cost: float = 0.005, pairs: int = 4) -> dict[str, Any]:
    """Generate epochs of a process loader and a Ray loader, alternated: `pairs` warm pairs.

    The two loaders live side by side (idle workers cost nothing) and take turns epoch by
    epoch, so each pair of epochs sees the same load on this shared machine; the ratio is the
    median of the pairs' ratios.
    """
    import ray

    # One Ray instance for the run; the Ray loader borrows this process's connection.
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=max(WORKERS, os.cpu_count() or 1), object_store_memory=200 << 20, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="ray-overhead-")
    times: dict[str, dict[str, list[float]]] = {e: {"generate": [], "read": []} for e in ("process", "ray")}
    try:
        loaders = {e: make_loader(e, n, cost, os.path.join(root, e)) for e in ("process", "ray")}
        try:
            for _ in range(2 * pairs + 1):
                for executor, loader in loaders.items():
                    mode, seconds = timed_epoch(loader)
                    times[executor][mode].append(seconds)
        finally:
            for loader in loaders.values():
                loader.close()
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()
    ratios = [r / p for r, p in zip(times["ray"]["generate"][1:], times["process"]["generate"][1:])]
    summary: dict[str, Any] = {
        e: {"first": t["generate"][0], "generate": statistics.median(t["generate"][1:]),
            "read": statistics.median(t["read"]), "epochs": len(t["generate"]) - 1}
        for e, t in times.items()}
    summary["ratio"] = statistics.median(ratios)
    summary["ratios"] = ratios
    summary["setup"] = {"n": n, "cost": cost, "workers": WORKERS, "batch_size": BATCH}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="samples (default 400)")
    parser.add_argument("--cost", type=float, default=0.005, help="CPU seconds per sample (default 0.005)")
    parser.add_argument("--pairs", type=int, default=4, help="warm generate epochs of each (default 4)")
    args = parser.parse_args(argv)
    s = run(args.n, args.cost, args.pairs)
    print(f"generate epoch: {args.n} samples of 48 KiB, {args.cost * 1000:.0f} ms CPU each, {WORKERS} workers, "
          f"batch {BATCH} (median of {s['ray']['epochs']} warm epochs each)")
    for executor, label in (("process", "2 local worker processes"), ("ray", "2 Ray actors (local Ray)")):
        r = s[executor]
        print(f"  {label:26s} {r['generate']:6.2f} s   (first epoch, workers starting: {r['first']:.2f} s; "
              f"cached epoch read here: {r['read']:.3f} s)")
    print(f"  ratio Ray / process: {s['ratio']:.2f}x (median of the pairs: "
          f"{', '.join(f'{r:.2f}' for r in s['ratios'])})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
