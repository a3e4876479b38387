"""Scenario ``memory_objects``: a dataset of Python objects, and what its workers copy of it.

A dataset that indexes its samples with a list of dicts (a path, a label, a box:
:class:`~benchmarks.datasets.IndexedObjects`) is built in the training process,
which then iterates torch's ``DataLoader`` or CachedLoader (``update_frequency=inf``:
epoch 0 generates, the later epochs read) with 2 or 8 workers. A forked worker
shares the training process's pages until it writes one, and reading a dict
from Python writes its reference count: each worker ends up with its own copy of
the pages it visited (torch's issue 13246). The measure is the peak of the summed
PSS of the training process and its children per epoch, sampled every 0.2 s from
``/proc/PID/smaps_rollup`` (:class:`benchmarks.memory.PeakMemory`), against the
training process alone once the dataset is built (*alone*).

Each run is a fresh Python process (``python -m benchmarks.memory_objects run ...``):
a training process that ran another loader before keeps heap the next one would
be charged for.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile

from .common import summarize


def run(who: str, n: int, workers: int, epochs: int, batch_size: int, interval: float) -> dict:
    """One run in this process: build the dataset, then `epochs` epochs of `who`, each under its own
    :class:`~benchmarks.memory.PeakMemory`. Bytes: ``alone`` and one peak per epoch (pss and rss)."""
    import torch.utils.data as tud

    from .datasets import IndexedObjects
    from .memory import PeakMemory, process_memory, tree_memory

    import psutil

    dataset = IndexedObjects(n)
    gc.collect()
    alone = process_memory(psutil.Process())
    tmp = tempfile.mkdtemp(prefix="cachestore-bench-")
    peaks: list[dict] = []
    try:
        if who == "torch":
            batches = tud.DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                                     persistent_workers=True)
        else:
            from loader import CachedLoader

            batches = CachedLoader(dataset, batch_size=batch_size, nb_worker=workers,
                                   cache_setting={"prefix": f"{tmp}/cache", "update_frequency": math.inf,
                                                  # by value, a million dicts take minutes to hash
                                                  "fingerprint": f"indexed-objects-{n}"})
        modes = []
        for epoch in range(epochs):
            with PeakMemory(interval) as mem:
                for _batch in batches:
                    pass
            peaks.append(mem.peak)
            if who == "ours":
                stats = batches.epoch_stats[-1]  # type: ignore[union-attr]
                modes.append(f"{stats.mode}" + (f" ({stats.extra['gather']})" if "gather" in stats.extra else ""))
        after = tree_memory()
        if who == "ours":
            batches.close()  # type: ignore[union-attr]
        del batches
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return {"who": who, "n": n, "workers": workers, "alone": alone, "peaks": peaks, "modes": modes,
            "after": after}


def _run_child(who: str, n: int, workers: int, epochs: int, batch_size: int, interval: float) -> dict:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-m", "benchmarks.memory_objects", "run", who, str(n), str(workers),
                          str(epochs), str(batch_size), str(interval)], cwd=root, capture_output=True, text=True,
                         timeout=1800)
    if out.returncode != 0:
        raise RuntimeError(f"memory_objects run {who} n={n} workers={workers} failed:\n{out.stderr[-3000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


#: Bytes the training process holds per object of :class:`IndexedObjects` (697 MiB a million, measured).
BYTES_PER_OBJECT = 731
#: What each worker adds to a generate epoch, as a share of the dataset alone (torch's: 0.48 with 2 workers,
#: 0.45 with 8, in the 2026-12-08 run).
WORKER_SHARE = 0.5


def too_large(n: int, workers: int, available: int) -> str | None:
    """Why (n, workers) does not fit `available` bytes of memory (the generate epoch's estimated peak, torch's or
    ours, with a fifth spare), ``None`` when it does."""
    need = n * BYTES_PER_OBJECT * (1 + WORKER_SHARE * workers)
    if need * 1.25 <= available:
        return None
    return (f"its generate epoch needs about {need / (1 << 30):.1f} GiB ({n:,} objects of {BYTES_PER_OBJECT} bytes, "
            f"and {workers} workers copying about half of them each), more than this machine's "
            f"{available / (1 << 30):.1f} GiB available leaves with a fifth spare")


def memory_objects_scenario(sizes: list[int], workers: list[int], epochs: int = 3, batch_size: int = 256,
                            repeats: int = 1, interval: float = 0.2, log=None) -> list[dict]:
    """Peak summed PSS per epoch of CachedLoader and torch's DataLoader over :class:`IndexedObjects`.

    One case per (size, workers); in each, the two take turns (`repeats` runs each).
    Ratios are against *alone*: the training process with the dataset built, before any loader.
    A case the machine's memory cannot hold (:func:`too_large`) is recorded with ``skipped`` saying why.
    """
    import psutil

    cases: list[dict] = []
    for n in sizes:
        for w in workers:
            why = too_large(n, w, psutil.virtual_memory().available)
            if why is not None:
                if log is not None:
                    log(f"  memory_objects n={n} workers={w} left out: {why}")
                cases.append({"n": n, "workers": w, "epochs": epochs, "batch_size": batch_size, "skipped": why})
                continue
            runs: dict[str, list[dict]] = {"ours": [], "torch": []}
            for rep in range(repeats):
                for who in (("ours", "torch") if rep % 2 == 0 else ("torch", "ours")):
                    if log is not None:
                        log(f"  memory_objects {who} n={n} workers={w}")
                    runs[who].append(_run_child(who, n, w, epochs, batch_size, interval))
            cases.append(summarize_case(n, w, epochs, batch_size, runs))
    return cases


def summarize_case(n: int, workers: int, epochs: int, batch_size: int, runs: dict[str, list[dict]]) -> dict:
    """Per loader: the generate (first) epoch's peak and the later epochs' peak, in bytes and against alone."""
    case: dict = {"n": n, "workers": workers, "epochs": epochs, "batch_size": batch_size, "runs": runs}
    for who, rs in runs.items():
        first = [r["peaks"][0]["pss"] for r in rs]
        later = [max(p["pss"] for p in r["peaks"][1:]) for r in rs]
        alone = [r["alone"]["pss"] for r in rs]
        case[who] = {"alone": summarize(alone), "first_peak": summarize(first), "later_peak": summarize(later),
                     "first_vs_alone": summarize([f / a for f, a in zip(first, alone)]),
                     "later_vs_alone": summarize([x / a for x, a in zip(later, alone)]),
                     "modes": rs[0].get("modes", [])}
    case["first_vs_torch"] = summarize([o["peaks"][0]["pss"] / t["peaks"][0]["pss"]
                                        for o, t in zip(runs["ours"], runs["torch"])])
    return case


def markdown_section(cases: list[dict]) -> list[str]:
    """The scenario's section of the report."""
    return ["### Peak memory with a dataset of Python objects (memory_objects)", "",
            "The training process builds a list of dicts (a path, a label, a box) and iterates 3 epochs, batches of "
            f"{cases[0]['batch_size']}; peak of the summed PSS of it and its children per epoch, sampled every 0.2 s; "
            "*alone*: the training process with the dataset built, before any loader. Each run is a fresh process "
            "(`python -m benchmarks.memory_objects`).", "", *markdown(cases),
            *([""] + [f"- {c['n']:,} objects, {c['workers']} workers: not run, {c['skipped']}."
                      for c in cases if "skipped" in c] if any("skipped" in c for c in cases) else [])]


def target_rows(results: dict) -> list:
    """The scenario's targets: cached epochs <= 1.15x alone, the generate epoch's peak <= torch's."""
    from .tables import row, times

    rows = []
    for c in results.get("memory_objects") or []:
        case = f"{c['n']:,} dicts, {c['workers']} workers"
        if "skipped" in c:
            continue  # said under the scenario's table
        ours, torch = c["ours"], c["torch"]
        rows.append(row("cached epochs of a dataset of Python objects: peak <= 1.15x the training process alone",
                        case, f"{ours['later_peak']['median'] / (1 << 20):.0f} MiB vs alone "
                        f"{ours['alone']['median'] / (1 << 20):.0f} MiB",
                        times(ours["later_vs_alone"]), "<= 1.15x", lambda r: r <= 1.15,
                        f"torch: {torch['later_vs_alone']['median']:.2f}x"))
        rows.append(row("generate epoch of a dataset of Python objects: peak <= torch's", case,
                        f"{ours['first_peak']['median'] / (1 << 20):.0f} MiB vs torch "
                        f"{torch['first_peak']['median'] / (1 << 20):.0f} MiB",
                        times(c["first_vs_torch"]), "<= 1x", lambda r: r <= 1))
    return rows


def markdown(cases: list[dict]) -> list[str]:
    """The scenario's table."""
    mib = 1 << 20
    lines = ["| objects | workers | loader | alone MiB | epoch 0 peak MiB (x alone) | epochs 1+ peak MiB (x alone) | "
             "epoch 0 vs torch's |", "| ---: | ---: | :--- | ---: | ---: | ---: | ---: |"]
    for c in cases:
        if "skipped" in c:
            continue
        for who, name in (("torch", "torch DataLoader"), ("ours", "CachedLoader, update_frequency=inf")):
            s = c[who]
            vs = f"{c['first_vs_torch']['median']:.2f}x" if who == "ours" else "-"
            lines.append(f"| {c['n']:,} | {c['workers']} | {name} | {s['alone']['median'] / mib:.0f} | "
                         f"{s['first_peak']['median'] / mib:.0f} ({s['first_vs_alone']['median']:.2f}x) | "
                         f"{s['later_peak']['median'] / mib:.0f} ({s['later_vs_alone']['median']:.2f}x) | {vs} |")
    return lines


def main(argv: list[str] | None = None) -> int:
    """``run WHO N WORKERS EPOCHS BATCH INTERVAL``: one run, as JSON on stdout; ``--sizes ... --workers ...``:
    the scenario, its table printed."""
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "run":
        who, n, w, epochs, batch, interval = argv[1], *map(int, argv[2:6]), float(argv[6])
        print(json.dumps(run(who, n, w, epochs, batch, interval)))
        return 0
    parser = argparse.ArgumentParser(prog="python -m benchmarks.memory_objects")
    parser.add_argument("--sizes", type=int, nargs="+", default=[1_000_000])
    parser.add_argument("--workers", type=int, nargs="+", default=[2, 8])
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", help="write the cases here")
    args = parser.parse_args(argv)
    cases = memory_objects_scenario(args.sizes, args.workers, repeats=args.repeats,
                                    log=lambda s: print(s, file=sys.stderr, flush=True))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(cases, f)
    print("\n".join(markdown(cases)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
