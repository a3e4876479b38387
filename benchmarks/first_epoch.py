"""First epoch: construction and the first (generate) epoch of CachedLoader against torch's DataLoader.

The clock starts before each loader is built and stops at the end of its first
epoch, so the workers' start is in it for both: ours build the dataset, compute
every sample and write it into an empty store (default settings, a cache in a
temporary directory); torch's ``DataLoader(dataset, batch_size, shuffle=True,
num_workers=workers)`` forks its workers at ``iter()``. Target: ours <= 1.15x
torch (docs/ARCHITECTURE.md). Two datasets: one whose module imports only
numpy, and one whose module imports torch (:mod:`benchmarks.torch_datasets`),
as most training code does: a spawned worker imports the dataset's module, and
torch with it, before its first sample. Runs alternate (ours first on even
repetitions), each with a fresh loader and cache directory; the ratio is taken
within each pair. How our workers started is recorded per run (``forked``), and
so are the CPU seconds of the training process and its workers (``cpu_ratio``:
steadier than wall times when neighbours load the machine).

``python -m benchmarks.first_epoch [--repeats R] [--start-method M]``.
"""

from __future__ import annotations

import argparse
import json
import resource
import shutil
import tempfile
import time

import psutil

from loader import CachedLoader

from .common import summarize, table, verdict
from .datasets import ExpensiveDataset


def _cpu() -> float:
    """CPU seconds of this process and of its children that have exited and been waited for (workers)."""
    me, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime + children.ru_utime + children.ru_stime


def _ours(dataset_class: type, kwargs: dict, batch_size: int, workers: int, start_method: str | None) -> dict:
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    try:
        cpu = _cpu()
        start = time.perf_counter()
        with CachedLoader(dataset_class, kwargs, batch_size=batch_size, nb_worker=workers,
                          cache_setting={"prefix": f"{tmp}/cache"}, start_method=start_method) as loader:
            for _batch in loader:
                pass
            seconds = time.perf_counter() - start
            # After the epoch: a spawned child has the parent's command line until it execs.
            forked = not any("spawn_main" in " ".join(psutil.Process(pid).cmdline()) for pid in loader.worker_pids())
            mode = loader.epoch_stats[0].mode
        cpu = _cpu() - cpu  # closed: its workers have exited
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"seconds": seconds, "cpu_s": cpu, "forked": forked, "mode": str(mode)}


def _torch(dataset_class: type, kwargs: dict, batch_size: int, workers: int) -> dict:
    import torch.utils.data as tud

    cpu = _cpu()
    start = time.perf_counter()
    dl = tud.DataLoader(dataset_class(**kwargs), batch_size=batch_size, shuffle=True, num_workers=workers)
    for _batch in dl:
        pass
    seconds = time.perf_counter() - start
    del dl  # not persistent: the exhausted iterator has stopped and joined its workers already
    return {"seconds": seconds, "cpu_s": _cpu() - cpu}


def first_epoch_scenario(n: int = 640, cost: float = 0.005, workers: int = 2, batch_size: int = 64,
                         repeats: int = 3, start_method: str | None = None) -> dict:
    """First epoch (construction included) of ours against torch's, for both datasets.

    Returns
    -------
    dict
        Per dataset (``"numpy module"``, ``"torch module"``): the runs of both, their
        summaries (``ours_s``, ``torch_s``) and ``ratio`` (ours / torch within each pair).
    """
    from .torch_datasets import TorchModuleDataset

    kwargs = {"n": n, "cost": cost}
    cases = {}
    for label, cls in (("numpy module", ExpensiveDataset), ("torch module", TorchModuleDataset)):
        _ours(cls, {"n": 2 * workers * batch_size, "cost": 0.0}, batch_size, workers, start_method)  # warm-up
        runs: dict[str, list[dict]] = {"ours": [], "torch": []}
        for rep in range(repeats):
            for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
                runs[who].append(_ours(cls, kwargs, batch_size, workers, start_method) if who == "ours"
                                 else _torch(cls, kwargs, batch_size, workers))
        ours, theirs = runs["ours"], runs["torch"]
        cases[label] = {"runs": runs, "ours_s": summarize([r["seconds"] for r in ours]),
                        "torch_s": summarize([r["seconds"] for r in theirs]),
                        "ratio": summarize([o["seconds"] / t["seconds"] for o, t in zip(ours, theirs)]),
                        "cpu_ratio": summarize([o["cpu_s"] / t["cpu_s"] for o, t in zip(ours, theirs)]),
                        "forked": [r["forked"] for r in ours]}
    return {"n": n, "cost_ms": cost * 1e3, "workers": workers, "batch_size": batch_size, "repeats": repeats,
            "start_method": start_method or "auto", "cases": cases}


def _workers(case: dict) -> str:
    return "fork" if all(case["forked"]) else "spawn" if not any(case["forked"]) else "fork and spawn"


def first_epoch_rows(results: dict) -> list:
    """Target rows: ours <= 1.15x torch's first epoch, per dataset."""
    from .tables import pm, row, times

    fe = results.get("first_epoch")
    if not fe:
        return []
    return [row("first epoch <= 1.15x torch's (construction and worker start included)",
                 f"dataset module imports {label.split()[0]}; {fe['n']} samples, {fe['cost_ms']:g} ms each",
                 f"{pm(case['ours_s'])} s vs {pm(case['torch_s'])} s", times(case["ratio"]), "<= 1.15x",
                 lambda r: r <= 1.15, f"our workers: {_workers(case)} (start_method={fe['start_method']}); CPU "
                 f"seconds, ours / torch: {case['cpu_ratio']['median']:.2f}x")
            for label, case in fe["cases"].items()]


def first_epoch_section(fe: dict) -> list[str]:
    """The report's section: per dataset, every run of both and the ratios."""
    from .tables import md_table

    rows = [[label, " ".join(f"{v:.2f}" for v in case["ours_s"]["values"]),
             " ".join(f"{v:.2f}" for v in case["torch_s"]["values"]),
             " ".join(f"{v:.2f}x" for v in case["ratio"]["values"]),
             " ".join(f"{v:.2f}x" for v in case["cpu_ratio"]["values"]), _workers(case)]
            for label, case in fe["cases"].items()]
    return ["### First epoch, construction included", "",
            f"{fe['n']} samples of {fe['cost_ms']:g} ms CPU, {fe['workers']} workers, batch {fe['batch_size']}; "
            f"seconds from the start of construction to the end of the first epoch, {fe['repeats']} alternating "
            "runs of each (fresh loaders and cache directories). Ours: default settings (a cache, so the epoch "
            f"also writes the store), start_method={fe['start_method']}; torch: `DataLoader(shuffle=True, "
            "num_workers=2)`, which forks its workers at `iter()`.", "",
            md_table(["dataset module imports", "ours s", "torch s", "ours / torch", "CPU, ours / torch", "our workers"],
                     rows, "lrrrrl")]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.first_epoch", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--start-method", default=None, help="ours: auto (default), fork, spawn or forkserver")
    parser.add_argument("--json", help="also write the results to this file")
    args = parser.parse_args(argv)
    res = first_epoch_scenario(repeats=args.repeats, start_method=args.start_method)
    print(f"First epoch, construction included: {res['n']} samples of {res['cost_ms']:g} ms CPU, "
          f"{res['workers']} workers, batch {res['batch_size']}; ours with start_method={res['start_method']}")
    rows = []
    for label, case in res["cases"].items():
        ratio = case["ratio"]["median"]
        rows.append([label, " ".join(f"{v:.2f}" for v in case["ours_s"]["values"]),
                     " ".join(f"{v:.2f}" for v in case["torch_s"]["values"]),
                     " ".join(f"{v:.2f}x" for v in case["ratio"]["values"]), f"{ratio:.2f}x",
                     f"{case['cpu_ratio']['median']:.2f}x", _workers(case), verdict(ratio <= 1.15)])
    print(table(["dataset", "ours s", "torch s", "ratios", "median", "CPU ratio", "our workers", "<= 1.15x"], rows))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
