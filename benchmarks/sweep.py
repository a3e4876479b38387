"""Sweep: 4 jobs started together on one cache prefix compute each sample once in total.

A hyper-parameter sweep starts several training jobs on the same dataset at
once. With ``cache_setting["shared"]=True`` (the default) the jobs that write
the same generation of one prefix write it together (cachestore/write/shared.py):
each sample is claimed before it is computed, a job that needs a sample
another is computing waits for it and reads it back, the last job out commits.

What runs (``python -m benchmarks --only sweep``, or ``python -m benchmarks.sweep``):

* ``jobs`` (4) separate processes (``python -m benchmarks.sweep --job CONFIG``),
  each a CachedLoader over :class:`~benchmarks.counting.CountedExpensiveDataset`
  (``n`` samples of 48 KiB, ``cost`` seconds of CPU each; the same parameters
  in every job, so the same fingerprint), ``nb_worker=1``, batch ``batch_size``,
  ``update_frequency=inf``. Each job builds its loader (its worker starts),
  then waits at a file barrier until every job has built its own; the jobs
  then run their generate epoch (epoch 0) together.
* Variants, taking turns in each repetition: *shared*: one prefix, seeds
  ``100 + job`` (each job walks its own order); *private*: the baseline, a
  prefix per job, the same seeds (every sample computed ``jobs`` times);
  *same seed*: one prefix, seed 100 in every job (they walk the same order, so
  they split each batch between them instead of meeting at the end).

How to read the rows: *calls per generation* is the count of ``__getitem__``
calls logged by the dataset itself (one file per process), over ``n``: 1.00
means every sample was computed once in total (target <= 1.05), the private
baseline gives ``jobs``. *generate epoch* is each job's wall time from the
barrier's release to the end of its epoch 0 (worker start-up is before the
barrier: each job waits for its worker to be started and idle first, the
same in every variant); its *ratio* is a job's time over the mean time of the
4 private jobs of the same repetition (the mean, not the same job's private
time: on a shared machine one private job often finishes well before the
others); the targets are on the mean over the jobs and on the worst job (<=
0.35x: 4 jobs on 2 cores doing a quarter of the work each would give 0.25x).
*makespan*: from the first job's release to the last job's end. *computed / read /
waited* are the job's ``epoch_stats[0]`` (waited: samples another job was
computing when this one needed them).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from .common import summarize
from .counting import count_calls, file_barrier, stats_dict, wait_children_idle, write_json

ROOT = Path(__file__).resolve().parents[1]
#: Seconds one set of jobs may take before they are killed and the scenario fails.
JOB_TIMEOUT = 300.0
#: Seed of job ``j`` is ``SEED + j`` (``SEED`` for all in the same-seed variant).
SEED = 100
VARIANTS = ("shared", "private", "same_seed")


def run_job(config: dict) -> dict:
    """One job: build the loader, wait for the others, time its generate epoch; returns what it saw."""
    from loader import CachedLoader

    from .counting import CountedExpensiveDataset

    params = {"n": config["n"], "cost": config["cost"], "counter_dir": config["calls"]}
    cache = {"prefix": config["prefix"], "update_frequency": math.inf}
    t = time.perf_counter()
    with CachedLoader(CountedExpensiveDataset, params, batch_size=config["batch_size"],
                      nb_worker=config["workers"], seed=config["seed"], cache_setting=cache,
                      timeout=JOB_TIMEOUT / 2, progress=False) as loader:
        construct = time.perf_counter() - t
        warm = wait_children_idle(config["workers"]) + construct
        released = file_barrier(config["barrier"], config["id"], config["jobs"])
        t = last = time.perf_counter()
        served = 0
        for batch in loader:
            served += len(batch[1])
            last = time.perf_counter()
        end = time.perf_counter()
        epoch_s = end - t
        stats = stats_dict(loader.epoch_stats[0])
    return {"id": config["id"], "seed": config["seed"], "pid": os.getpid(), "construct_s": construct, "startup_s": warm,
            "released": released, "ended": released + epoch_s, "epoch_s": epoch_s,
            "end_s": end - last, "served": served, **stats}


def _launch(configs: list[dict], tmp: Path) -> list[dict]:
    """Start one process per config, wait for all; any failure kills the rest and raises with its stderr."""
    procs = []
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for config in configs:
        err = (tmp / f"job-{config['id']}.stderr").open("w")
        procs.append((subprocess.Popen([sys.executable, "-m", "benchmarks.sweep", "--job", json.dumps(config)],
                                       cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=err), err, config))
    deadline = time.monotonic() + JOB_TIMEOUT
    failed = None
    try:
        for proc, _err, config in procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                failed = f"job {config['id']} still running after {JOB_TIMEOUT:g} s"
                break
            if proc.returncode != 0:
                failed = f"job {config['id']} exited with {proc.returncode}"
                break
    finally:
        for proc, err, _config in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            err.close()
    if failed:
        tails = "\n".join(f"--- job {c['id']} stderr:\n" + (tmp / f"job-{c['id']}.stderr").read_text()[-3000:]
                          for _p, _e, c in procs)
        raise RuntimeError(f"sweep: {failed}\n{tails}")
    return [json.loads(Path(c["out"]).read_text()) for _p, _e, c in procs]


def run_variant(variant: str, n: int, cost: float, jobs: int, workers: int, batch_size: int) -> dict:
    """Start `jobs` jobs together in one variant (see the module docstring); returns their results and counts."""
    from cachestore import open_store

    tmp = Path(tempfile.mkdtemp(prefix=f"cachestore-sweep-{variant}-"))
    try:
        calls, barrier = tmp / "calls", tmp / "barrier"
        calls.mkdir()
        barrier.mkdir()
        prefixes = [tmp / ("cache" if variant != "private" else f"cache-{j}") for j in range(jobs)]
        configs = [{"id": j, "jobs": jobs, "n": n, "cost": cost, "workers": workers, "batch_size": batch_size,
                    "seed": SEED if variant == "same_seed" else SEED + j, "prefix": str(prefixes[j]),
                    "calls": str(calls), "barrier": str(barrier), "out": str(tmp / f"job-{j}.json")}
                   for j in range(jobs)]
        results = _launch(configs, tmp)
        counted = count_calls(calls)
        committed = []
        for prefix in sorted(set(prefixes)):
            store = open_store(prefix)
            try:
                committed.append([g.id for g in store.generations() if g.committed])
            finally:
                store.close()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    start = min(r["released"] for r in results)
    return {"variant": variant, "jobs": results, **counted, "calls_per_n": counted["calls"] / n,
            "committed_generations": committed, "makespan_s": max(r["ended"] for r in results) - start,
            "release_spread_s": max(r["released"] for r in results) - start}


def sweep_scenario(n: int, cost: float, jobs: int = 4, workers: int = 1, batch_size: int = 64,
                   repeats: int = 1, same_seed: bool = True) -> dict:
    """The sweep scenario: each variant `repeats` times, taking turns (the order rotates each repetition).

    Returns
    -------
    dict
        Per repetition and variant, each job's figures and the call counts;
        summaries over the repetitions of the calls per generation over `n`
        and of the shared / private ratio of the generate epoch (per job, then
        the mean and the max over the jobs; over the mean private job).
    """
    variants = [v for v in VARIANTS if same_seed or v != "same_seed"]
    runs: list[dict[str, dict]] = []
    for rep in range(repeats):
        order = variants[rep % len(variants):] + variants[:rep % len(variants)]
        runs.append({v: run_variant(v, n, cost, jobs, workers, batch_size) for v in order})
    out: dict[str, Any] = {"n": n, "cost_ms": cost * 1e3, "jobs": jobs, "workers": workers,
                           "batch_size": batch_size, "repeats": repeats, "variants": variants, "runs": runs}
    for v in variants:
        out[f"{v}_calls_per_n"] = summarize([r[v]["calls_per_n"] for r in runs])
        out[f"{v}_makespan_s"] = summarize([r[v]["makespan_s"] for r in runs])
        out[f"{v}_epoch_s"] = summarize([statistics.mean(j["epoch_s"] for j in r[v]["jobs"]) for r in runs])
        if v == "private":
            continue
        ratios = [[j["epoch_s"] / statistics.mean(p["epoch_s"] for p in r["private"]["jobs"]) for j in r[v]["jobs"]]
                  for r in runs]
        out[f"{v}_ratio_mean"] = summarize([statistics.mean(x) for x in ratios])
        out[f"{v}_ratio_max"] = summarize([max(x) for x in ratios])
    return out


_LABELS = {"shared": "one prefix, seeds 100-103", "private": "a prefix per job (baseline)",
           "same_seed": "one prefix, seed 100 in every job"}


def sweep_section(sw: dict) -> list[str]:
    """The report's section: one row per variant (medians over the repetitions), then each job of the last."""
    from .tables import md_table
    from .tables import pm

    rows = []
    for v in sw["variants"]:
        ratio = ("-" if v == "private" else
                 f"{sw[f'{v}_ratio_mean']['median']:.2f}x / {sw[f'{v}_ratio_max']['median']:.2f}x")
        repeated = ", ".join(str(r[v]["repeated"]) for r in sw["runs"])
        rows.append([_LABELS[v], f"{sw[f'{v}_calls_per_n']['median']:.2f}", repeated, pm(sw[f"{v}_epoch_s"]),
                     ratio, pm(sw[f"{v}_makespan_s"])])
    last = sw["runs"][-1]
    private = statistics.mean(j["epoch_s"] for j in last["private"]["jobs"])
    job_rows = [[_LABELS[v].split(" (")[0], j["id"], j["seed"], j["computed"], j["read"], j["waited"], j["written"],
                 "yes" if j["committed"] else "", f"{j['startup_s']:.2f}", f"{j['epoch_s']:.2f}",
                 f"{j['end_s']:.2f}", f"{j['epoch_s'] / private:.2f}x"]
                for v in sw["variants"] for j in last[v]["jobs"]]
    return [f"### Sweep: {sw['jobs']} jobs started together, {sw['n']} samples of 48 KiB, {sw['cost_ms']:g} ms "
            f"each, nb_worker={sw['workers']}, batch {sw['batch_size']}, K=inf", "",
            f"Separate processes; each builds its loader, waits for its worker, then meets the others at a file "
            f"barrier and runs its generate epoch (epoch 0). Median ± half-range of {_runs(sw['repeats'])} of "
            "each variant, taking turns. *calls / N*: `__getitem__` calls of all jobs over N, counted by the "
            "dataset itself; *repeated*: indices computed more than once, per run. *generate s*: mean over the "
            "jobs of each one's epoch 0 (from the barrier); *x private*: a job's time over the mean private "
            "job's, mean over the jobs / worst job. *makespan*: first release to last job's end.", "",
            md_table(["variant", "calls / N", "repeated", "generate s", "x private (mean / worst)", "makespan s"],
                     rows, "lrrrrr"), "",
            "Each job of the last repetition: its `epoch_stats[0]` (computed, read, waited: samples another job "
            "was computing when it needed them, written, committed), start-up (construction and the wait for "
            "its worker, before the barrier), its generate epoch, and of that the time from its last batch to "
            "the end of the epoch (*end s*: leaving the shared area; the last job out commits the generation).",
            "",
            md_table(["variant", "job", "seed", "computed", "read", "waited", "written", "committed", "start-up s",
                      "generate s", "end s", "x private"], job_rows, "lrrrrrrlrrrr")]


def _runs(n: int) -> str:
    return f"{n} run" + ("s" if n != 1 else "")


def sweep_rows(results: dict) -> list:
    """Target rows: calls per generation with one prefix, and each job's generate epoch against private ones."""
    from .tables import row, times, value

    sw = results.get("sweep")
    if not sw:
        return []
    where = f"{sw['jobs']} jobs, {sw['n']} samples, {sw['cost_ms']:g} ms each"
    rows = []
    for v in (x for x in sw["variants"] if x != "private"):
        label = "different seeds" if v == "shared" else "same seed"
        rows.append(row(f"sweep, {sw['jobs']} jobs on one prefix: dataset calls per generation <= 1.05 N",
                         f"{label}; {where}",
                         f"private prefixes: {sw['private_calls_per_n']['median']:.2f} N",
                         value("{:.2f}", " N", sw[f"{v}_calls_per_n"]), "<= 1.05 N", lambda c: c <= 1.05))
        for key, which in (("mean", "mean of the jobs"), ("max", "worst job")):
            rows.append(row(f"sweep: each job's generate epoch <= 0.35x {sw['jobs']} jobs with private prefixes",
                             f"{label}, {which}",
                             f"{sw[f'{v}_epoch_s']['median']:.2f} s vs {sw['private_epoch_s']['median']:.2f} s "
                             "(mean job)", times(sw[f"{v}_ratio_{key}"]), "<= 0.35x", lambda r: r <= 0.35))
    return rows


def main(argv: list[str] | None = None) -> int:
    """``--job CONFIG``: run one job (the scenario starts these); else run the scenario and print it."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.sweep", description=__doc__.split("\n\n")[0])
    parser.add_argument("--job", help="run one job of the scenario, configured by this JSON")
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args(argv)
    if args.job:
        config = json.loads(args.job)
        write_json(config["out"], run_job(config))
        return 0
    from .config import COST, SIZES

    result = sweep_scenario(cost=COST, **SIZES["quick" if args.quick else "full"]["sweep"])
    print("\n".join(sweep_section(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
