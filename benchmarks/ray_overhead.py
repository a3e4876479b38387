"""What Ray costs: a generate epoch computed by 2 Ray actors against 2 local worker processes.

Same machine, same dataset (:class:`~benchmarks.datasets.ExpensiveDataset`: ~5 ms of CPU per
48 KiB sample), same cache settings; the figure is the ratio of the two epoch times in one run,
so the machine's speed cancels out. What the ratio contains: batches and records travelling
through Ray's object store instead of shared memory and the workers' own shards, the training
process writing every record into the store itself (an actor may be on another machine), and
Ray's per-call overhead. See ``loader/ray_executor.py``.

Workers are warm in every timed epoch: with ``update_frequency=2`` epochs 0, 2, 4 ... generate;
epoch 0 (which includes starting the workers) is reported apart and the later ones are timed.
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


def generate_epochs(executor: str, n: int, cost: float, epochs: int, root: str) -> dict[str, Any]:
    """Seconds of each generate epoch of one loader (first one apart), its cached epochs' too."""
    options = {"executor": executor}
    if executor == "ray":
        options["executor_options"] = {"num_workers": WORKERS, "start_timeout": 120}
    else:
        options["nb_worker"] = WORKERS
    prefix = tempfile.mkdtemp(prefix=f"{executor}-", dir=root)
    cache = {"prefix": prefix, "update_frequency": 2}
    times: dict[str, list[float]] = {"generate": [], "read": []}
    with CachedLoader(ExpensiveDataset, {"n": n, "cost": cost}, batch_size=BATCH, seed=0, cache_setting=cache,
                      **options) as loader:
        for _ in range(epochs):
            start = time.perf_counter()
            for _batch in loader:
                pass
            stats = loader.epoch_stats[-1]
            times[str(stats.mode)].append(time.perf_counter() - start)
    shutil.rmtree(prefix, ignore_errors=True)
    return {"first": times["generate"][0], "generate": times["generate"][1:], "read": times["read"]}


def run(n: int = 400, cost: float = 0.005, rounds: int = 2, epochs: int = 5) -> dict[str, Any]:
    """Alternate process and Ray loaders `rounds` times; the median warm generate epoch of each."""
    import ray

    # One Ray instance for every Ray loader of the run (a loader borrows this process's connection).
    ray.init(address="local", _node_ip_address="127.0.0.1", include_dashboard=False,
             num_cpus=max(WORKERS, os.cpu_count() or 1), object_store_memory=200 << 20, log_to_driver=False)
    root = tempfile.mkdtemp(prefix="ray-overhead-")
    results: dict[str, dict[str, list[float]]] = {e: {"first": [], "generate": [], "read": []}
                                                   for e in ("process", "ray")}
    try:
        for _ in range(rounds):
            for executor in ("process", "ray"):
                out = generate_epochs(executor, n, cost, epochs, root)
                results[executor]["first"].append(out["first"])
                results[executor]["generate"] += out["generate"]
                results[executor]["read"] += out["read"]
    finally:
        shutil.rmtree(root, ignore_errors=True)
        ray.shutdown()
    summary = {e: {k: statistics.median(v) for k, v in r.items()} | {"epochs": len(r["generate"])}
               for e, r in results.items()}
    summary["ratio"] = summary["ray"]["generate"] / summary["process"]["generate"]
    summary["setup"] = {"n": n, "cost": cost, "workers": WORKERS, "batch_size": BATCH}
    return summary


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--n", type=int, default=400, help="samples (default 400)")
    parser.add_argument("--cost", type=float, default=0.005, help="CPU seconds per sample (default 0.005)")
    parser.add_argument("--rounds", type=int, default=2, help="loaders of each kind, alternated (default 2)")
    args = parser.parse_args(argv)
    s = run(args.n, args.cost, args.rounds)
    print(f"generate epoch: {args.n} samples of 48 KiB, {args.cost * 1000:.0f} ms CPU each, {WORKERS} workers, "
          f"batch {BATCH} (median of {s['ray']['epochs']} warm epochs each)")
    for executor, label in (("process", "2 local worker processes"), ("ray", "2 Ray actors (local Ray)")):
        r = s[executor]
        print(f"  {label:26s} {r['generate']:6.2f} s   (first epoch, workers starting: {r['first']:.2f} s; "
              f"cached epoch read here: {r['read']:.3f} s)")
    print(f"  ratio Ray / process: {s['ratio']:.2f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
