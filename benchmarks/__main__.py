"""``python -m benchmarks``: every scenario in one run, written as JSON, Markdown and a PNG plot.

How much faster than torch's ``DataLoader`` is CachedLoader, and how close to
the machine's limits (memcpy bandwidth) does it get? Each scenario lives in its
own module; this one picks the sizes (on 2 cores a full run takes about 24
minutes, ``--quick`` about 6), runs them and hands the results to
:mod:`benchmarks.report`. Results go to ``benchmarks/results/<date>.{json,md,png}``.

Only light imports at module level: loader workers start with spawn and import
this module again.
"""

from __future__ import annotations

import argparse
import datetime
import math
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any, Callable

from .config import BACKENDS, BATCH, COST, RESULTS, SCENARIOS, SETUP_GAP, SIZES, STEP, TP_BATCH, WORKERS


def _meta(argv: list[str], quick: bool) -> dict:
    """The machine, the versions and the load average: what a reader needs to weigh the figures."""
    import multiprocessing as mp

    import numpy
    import psutil
    import torch

    from cachestore.format.native import native_gather

    from .common import llc_bytes

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return {"date": datetime.date.today().isoformat(), "started": datetime.datetime.now().isoformat(timespec="seconds"),
            "command": " ".join(["python -m benchmarks", *argv]).strip(), "quick": quick,
            "cpu": cpu, "cores": os.cpu_count(), "ram_bytes": psutil.virtual_memory().total, "llc_bytes": llc_bytes(),
            "platform": platform.platform(), "python": platform.python_version(), "numpy": numpy.__version__,
            "torch": torch.__version__, "torch_start_method": mp.get_start_method(), "ours_start_method": "spawn",
            "loadavg_start": list(os.getloadavg()),
            "verified_gather": "compiled" if native_gather() is not None else "pure Python"}


def _memcpy(results: dict, sizes: dict) -> None:
    from .common import memcpy_bandwidth, memory_bound_nbytes

    big = memory_bound_nbytes()
    results["memcpy"] = {"memory_bound_nbytes": big, "cache_resident_nbytes": 12 << 20,
                         "memory_bound": [memcpy_bandwidth(big, repeats=7)],
                         "cache_resident": [memcpy_bandwidth(12 << 20, repeats=30)]}


def _throughput(results: dict, sizes: dict) -> None:
    from .common import memcpy_bandwidth
    from .throughput import throughput_scenario

    cases = []
    mc = results.get("memcpy")
    for shape, n in (((3, 64, 64), sizes["big_n"]), ((16,), sizes["small_n"])):
        for backend in BACKENDS:
            if mc is not None:  # memcpy again before every case: its median is the run's figure
                mc["memory_bound"].append(memcpy_bandwidth(mc["memory_bound_nbytes"], repeats=7))
                mc["cache_resident"].append(memcpy_bandwidth(mc["cache_resident_nbytes"], repeats=30))
            _log(f"  throughput {backend} {shape} n={n}")
            cases.append(throughput_scenario(n, shape, TP_BATCH, WORKERS, backend, sizes["tp_repeats"]))
    results["throughput"] = cases


def _expensive(results: dict, sizes: dict) -> None:
    from .expensive_dataset import expensive_scenario

    results["expensive"] = expensive_scenario(cost=COST, epochs=10, k=5, workers=WORKERS, batch_size=BATCH,
                                              **sizes["expensive"])


def _rotation(results: dict, sizes: dict) -> None:
    from .expensive_dataset import rotation_scenario

    results["rotation"] = rotation_scenario(cost=COST, rotation=4, workers=WORKERS, batch_size=BATCH,
                                            **sizes["rotation"])


def _read_transform(results: dict, sizes: dict) -> None:
    from .read_transform import read_transform_scenario

    results["read_transform"] = read_transform_scenario(cost=COST, epochs=10, k=5, workers=WORKERS, batch_size=BATCH,
                                                        **sizes["read_transform"])


def _memory(results: dict, sizes: dict) -> None:
    from .datasets import ExpensiveDataset, StoredSamples
    from .memory import memory_scenario

    m = sizes["memory"]
    results["memory"] = [
        memory_scenario(ExpensiveDataset, {"n": m["n"], "cost": COST}, m["epochs"], m["k"], WORKERS, BATCH,
                        m["repeats"], label=f"expensive dataset, batches of {BATCH} x 48 KiB"),
        memory_scenario(StoredSamples, {"n": m["cached_n"], "shape": (3, 64, 64)}, 3, math.inf, WORKERS, TP_BATCH,
                        m["repeats"],
                        label=f"cheap dataset, 1 generate + 2 cached epochs, batches of {TP_BATCH} x 48 KiB"),
    ]


def _memory_objects(results: dict, sizes: dict) -> None:
    from .memory_objects import memory_objects_scenario

    results["memory_objects"] = memory_objects_scenario(batch_size=TP_BATCH, log=_log, **sizes["memory_objects"])


def _training_step(results: dict, sizes: dict) -> None:
    from .training_step import training_step_scenario

    results["training_step"] = training_step_scenario(cost=COST, workers=WORKERS, batch_size=BATCH, step=STEP,
                                                      **sizes["training_step"])


def _setup_time(results: dict, sizes: dict) -> None:
    from .setup_time import setup_time_scenario

    results["setup_time"] = setup_time_scenario(cost=COST, workers=WORKERS, batch_size=BATCH, gap=SETUP_GAP,
                                                **sizes["setup_time"])


def _latency(results: dict, sizes: dict) -> None:
    from .latency import first_batch_scenario, idle_cpu_scenario

    results["first_batch"] = first_batch_scenario(sizes["first_batch_repeats"], workers=WORKERS)
    results["idle_cpu"] = idle_cpu_scenario(workers=WORKERS, **sizes["idle"])


def _larger_than_memory(results: dict, sizes: dict) -> None:
    from .larger_than_memory import larger_than_memory_scenario

    s = sizes["larger_than_memory"]
    results["larger_than_memory"] = larger_than_memory_scenario(s["limit_mib"] << 20, s["store_mb"] * 10**6,
                                                                s["budget_s"], log=_log)


def _sweep(results: dict, sizes: dict) -> None:
    from .sweep import sweep_scenario

    results["sweep"] = sweep_scenario(cost=COST, jobs=4, workers=1, batch_size=BATCH, **sizes["sweep"])


def _torchrun(results: dict, sizes: dict) -> None:
    from .torchrun_node import torchrun_scenario

    results["torchrun"] = torchrun_scenario(cost=COST, ranks=4, workers=0, batch_size=16, read_epochs=5,
                                            **sizes["torchrun"])


def _remote(results: dict, sizes: dict) -> None:
    from .remote import remote_scenario

    results["remote"] = remote_scenario(log=_log, **sizes["remote"])


def _first_epoch(results: dict, sizes: dict) -> None:
    from .first_epoch import first_epoch_scenario

    results["first_epoch"] = first_epoch_scenario(cost=COST, workers=WORKERS, batch_size=BATCH,
                                                  **sizes["first_epoch"])


#: Each scenario's runner, in the order of :data:`benchmarks.config.SCENARIOS`.
def _streams(results: dict, sizes: dict) -> None:
    from .streams import streams_scenario

    _log("  streams")
    results["streams"] = streams_scenario(workers=WORKERS, batch_size=BATCH, **sizes["streams"])


RUNNERS: dict[str, Callable[[dict, dict], None]] = {
    "memcpy": _memcpy, "memory": _memory, "memory_objects": _memory_objects, "expensive": _expensive,
    "rotation": _rotation,
    "read_transform": _read_transform, "training_step": _training_step, "setup_time": _setup_time,
    "throughput": _throughput, "latency": _latency, "larger_than_memory": _larger_than_memory, "sweep": _sweep,
    "torchrun": _torchrun, "remote": _remote, "first_epoch": _first_epoch, "streams": _streams}


_T0 = [time.perf_counter()]  # reset by main()


def _log(message: str) -> None:
    print(f"[{time.perf_counter() - _T0[0]:6.1f}s] {message}", file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    """Run the scenarios and write the reports; returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks",
        description="Run every benchmark scenario (CachedLoader vs torch's DataLoader, and vs memcpy) and write "
                    "benchmarks/results/<date>.json, .md and .png. A report, not a test: missed targets do not "
                    "change the exit status.")
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repetitions (about 6 minutes)")
    parser.add_argument("--out", type=Path, default=RESULTS, help=f"output directory (default {RESULTS})")
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, metavar="SCENARIO",
                        help=f"run only these scenarios (of: {', '.join(SCENARIOS)})")
    parser.add_argument("--from-json", type=Path, metavar="JSON",
                        help="run nothing: rewrite the .md and .png of an earlier run from its JSON, beside it")
    args = parser.parse_args(argv)
    if args.from_json is not None:
        import json

        from .report import write_reports

        results = json.loads(args.from_json.read_text())
        paths = write_reports(results, args.from_json.parent, args.from_json.stem)
        _log("wrote " + ", ".join(str(p) for p in paths.values()))
        return 0
    _T0[0] = time.perf_counter()
    sizes = SIZES["quick" if args.quick else "full"]
    results: dict[str, Any] = {"meta": _meta(argv, args.quick)}
    for name in args.only or SCENARIOS:
        _log(f"{name} ...")
        RUNNERS[name](results, sizes)
    if "memcpy" in results:  # measured at the start and before every throughput case
        from .common import memcpy_bandwidth, summarize

        mc = results["memcpy"]
        mc["memory_bound"].append(memcpy_bandwidth(mc["memory_bound_nbytes"], repeats=7))
        mc["cache_resident"].append(memcpy_bandwidth(mc["cache_resident_nbytes"], repeats=30))
        for key in ("memory_bound", "cache_resident"):
            mc[key] = summarize(mc[key])
    meta = results["meta"]
    meta["duration_s"] = time.perf_counter() - _T0[0]
    meta["loadavg_end"] = list(os.getloadavg())
    from .report import write_reports

    # A partial run is named by its scenarios: two on one day must not overwrite each other's report.
    stem = meta["date"] + ("-quick" if args.quick else "") + ("-" + "-".join(args.only) if args.only else "")
    paths = write_reports(results, args.out, stem)
    print(paths["md"].read_text())
    _log("wrote " + ", ".join(str(p) for p in paths.values()))
    if "png" not in paths:
        _log("no plot: matplotlib is not installed (pip install -e '.[bench]')")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
