"""Torchrun: 4 ranks on one node, one node store against a store per rank.

``cache_setting["scope"]="node"`` (the default) gives the ranks of a node one
store, written together (each sample computed once, by whichever rank needs
it first) and split anew every epoch: every epoch a rank serves a different
quarter of a new permutation of the node's data, as ``DistributedSampler``
with ``set_epoch`` would. ``scope="rank"`` is the old behaviour: a store per
rank, each holding its rank's quarter, pinned for good.

What runs (``python -m benchmarks --only torchrun``, or ``python -m benchmarks.torchrun_node``):
``torchrun --standalone --nproc_per_node=4 -m benchmarks.torchrun_job`` (gloo,
CPU, ``OMP_NUM_THREADS=1``) once per scope, the two taking turns over the
repetitions. Each rank: :class:`~benchmarks.counting.CountedExpensiveDataset`
(``n`` samples of 48 KiB, ``cost`` seconds of CPU each), ``nb_worker=0``
(2 cores for 4 ranks), the same seed on every rank, ``update_frequency=inf``,
1 generate epoch then 5 read epochs, an ``all_reduce`` per step.

How to read the rows: *calls per generation* counts the dataset's
``__getitem__`` calls (logged by the dataset itself) over ``n``: 1.00 is every
sample once. *generate s* is the slowest rank's epoch 0, *read s* the mean
over ranks and read epochs. *seen over the read epochs* is the share of the
node's ``n`` samples a rank served at least once in epochs 1-5 (the worst
rank; the target asks >= 90 % with the node store, a store per rank pins 25
%). With independent random quarters each epoch, a rank would see
``1 - (3/4)**5`` = 76 % of the data on average; the figure beside it is that
expectation. *committed (epoch)* is the epoch at whose end a rank published
the generation, and *epochs 1+* the modes of the later epochs: ``read`` from
the committed generation, or ``generate`` when the ranks are still members of
the staging area and read their samples back from it (nothing computed).
"""

from __future__ import annotations

import argparse
import json
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
from .counting import count_calls

ROOT = Path(__file__).resolve().parents[1]
SCOPES = ("node", "rank")
#: Seconds one torchrun launch may take before it is killed and the scenario fails.
LAUNCH_TIMEOUT = 300.0
SEED = 7


def run_scope(scope: str, n: int, cost: float, ranks: int, workers: int, batch_size: int, epochs: int) -> dict:
    """One ``torchrun`` launch of `ranks` ranks with ``cache_setting["scope"]=scope``; aggregated results."""
    tmp = Path(tempfile.mkdtemp(prefix=f"cachestore-torchrun-{scope}-"))
    try:
        calls, out = tmp / "calls", tmp / "out"
        calls.mkdir()
        out.mkdir()
        config = {"n": n, "cost": cost, "workers": workers, "batch_size": batch_size, "epochs": epochs,
                  "seed": SEED, "scope": scope, "prefix": str(tmp / "cache"), "calls": str(calls), "out": str(out)}
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ranks}",
               "-m", "benchmarks.torchrun_job", json.dumps(config)]
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        t = time.perf_counter()
        with (tmp / "torchrun.log").open("w") as log:
            proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                proc.wait(timeout=LAUNCH_TIMEOUT)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)  # torchrun and the ranks it started: its own session
                proc.wait()
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            raise RuntimeError(f"torchrun ({scope} scope) exited with {proc.returncode} after {wall:.0f} s:\n"
                               + (tmp / "torchrun.log").read_text()[-6000:])
        rank_results = [json.loads((out / f"rank-{r}.json").read_text()) for r in range(ranks)]
        counted = count_calls(calls)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return _aggregate(scope, n, ranks, rank_results, counted, wall)


def _aggregate(scope: str, n: int, ranks: int, results: list[dict], counted: dict, wall: float) -> dict:
    per_rank = []
    for r in results:
        seen = set().union(*(set(e) for e in r["epochs"][1:]))
        per_rank.append({"rank": r["rank"], "startup_s": r["startup_s"], "epoch_s": r["epoch_s"],
                         "samples_per_epoch": [len(e) for e in r["epochs"]],
                         "seen_read_share": len(seen) / n,
                         "seen_all_share": len(seen.union(r["epochs"][0])) / n,
                         "stats": r["stats"]})
    read_epochs = len(results[0]["epochs"]) - 1
    # Which epoch's end published the generation (a rank's stats say committed), and what the later
    # epochs were: "read" from the committed generation, or "generate" reading back from the staging area.
    committed = [e for e in range(read_epochs + 1) if any(r["stats"][e]["committed"] for r in results)]
    modes = sorted({r["stats"][e]["mode"] for r in results for e in range(1, read_epochs + 1)})
    return {"scope": scope, "ranks": ranks, "wall_s": wall, **counted, "calls_per_n": counted["calls"] / n,
            "committed_epoch": committed[0] if committed else None, "later_modes": modes,
            "generate_s": max(r["epoch_s"][0] for r in per_rank),
            "read_s": statistics.mean(s for r in per_rank for s in r["epoch_s"][1:]),
            "seen_min": min(r["seen_read_share"] for r in per_rank),
            "seen_mean": statistics.mean(r["seen_read_share"] for r in per_rank),
            "expected_independent": 1 - (1 - 1 / ranks) ** read_epochs, "per_rank": per_rank}


def torchrun_scenario(n: int, cost: float, ranks: int = 4, workers: int = 0, batch_size: int = 16,
                      read_epochs: int = 5, repeats: int = 1) -> dict:
    """Both scopes, `repeats` times each, taking turns; summaries over the repetitions.

    Returns
    -------
    dict
        Each launch's aggregate (``runs``: one dict of scope -> aggregate per
        repetition) and, per scope, summaries of the calls per generation over
        `n`, the generate and read epoch seconds, and the worst rank's share of
        the data seen over the read epochs.
    """
    runs = []
    for rep in range(repeats):
        order = SCOPES if rep % 2 == 0 else SCOPES[::-1]
        runs.append({scope: run_scope(scope, n, cost, ranks, workers, batch_size, 1 + read_epochs)
                     for scope in order})
    out: dict[str, Any] = {"n": n, "cost_ms": cost * 1e3, "ranks": ranks, "workers": workers,
                           "batch_size": batch_size, "read_epochs": read_epochs, "repeats": repeats, "runs": runs}
    for scope in SCOPES:
        for key in ("calls_per_n", "generate_s", "read_s", "seen_min", "seen_mean"):
            out[f"{scope}_{key}"] = summarize([r[scope][key] for r in runs])
    out["expected_independent"] = runs[0]["node"]["expected_independent"]
    return out


def torchrun_section(tr: dict) -> list[str]:
    """The report's section: one row per scope (medians over the repetitions), then each rank of the last."""
    from .tables import md_table
    from .tables import pm

    rows = []
    for scope, label in (("node", "node store (default)"), ("rank", "store per rank")):
        committed = ", ".join("never" if r[scope]["committed_epoch"] is None else str(r[scope]["committed_epoch"])
                              for r in tr["runs"])
        modes = ", ".join(sorted({m for r in tr["runs"] for m in r[scope]["later_modes"]}))
        rows.append([label, f"{tr[f'{scope}_calls_per_n']['median']:.2f}", committed, modes,
                     pm(tr[f"{scope}_generate_s"]), pm(tr[f"{scope}_read_s"], 1, "{:.3f}"),
                     f"{tr[f'{scope}_seen_min']['median']:.1%}", f"{tr[f'{scope}_seen_mean']['median']:.1%}"])
    last = tr["runs"][-1]
    rank_rows = []
    for scope in SCOPES:
        for r in last[scope]["per_rank"]:
            s0 = r["stats"][0]
            rank_rows.append([scope, r["rank"], s0["computed"], s0["read"], s0["waited"], f"{r['epoch_s'][0]:.2f}",
                              f"{statistics.mean(r['epoch_s'][1:]):.3f}", f"{r['seen_read_share']:.1%}",
                              f"{r['seen_all_share']:.1%}"])
    return [f"### Torchrun: {tr['ranks']} ranks on one node (gloo, CPU), {tr['n']} samples of 48 KiB, "
            f"{tr['cost_ms']:g} ms each, nb_worker={tr['workers']}, batch {tr['batch_size']}, K=inf, "
            f"1 generate + {tr['read_epochs']} read epochs", "",
            f"Median ± half-range of {tr['repeats']} launch(es) per scope, taking turns; an `all_reduce` per "
            "step. *calls / N*: the dataset's own count of `__getitem__` calls over N. *committed*: the epoch "
            "at whose end a rank committed the generation, per launch; *epochs 1+*: the modes of the later "
            "epochs (`read`: from the committed generation; `generate`: read back from the staging area the "
            "ranks still share, nothing computed). *generate s*: the "
            "slowest rank's epoch 0; *read s*: mean read epoch. *seen*: share of the node's N samples a rank "
            f"served over the {tr['read_epochs']} read epochs (worst rank, mean of ranks); independent random "
            f"quarters would give {tr['expected_independent']:.1%} on average.", "",
            md_table(["scope", "calls / N", "committed (epoch)", "epochs 1+", "generate s", "read s",
                      "seen, worst rank", "seen, mean"], rows, "lrrlrrrr"), "",
            "Each rank of the last launch: epoch 0's `computed` / `read` / `waited`, its epoch times, and the "
            "share of N it served over the read epochs and over all epochs.", "",
            md_table(["scope", "rank", "computed", "read", "waited", "generate s", "read s", "seen (read epochs)",
                      "seen (all epochs)"], rank_rows, "lrrrrrrrr")]


def torchrun_rows(results: dict) -> list:
    """Target rows: every sample computed once per generation, and the share of the data a rank sees."""
    from .tables import row, value

    tr = results.get("torchrun")
    if not tr:
        return []
    where = f"{tr['ranks']} ranks, {tr['n']} samples, {tr['cost_ms']:g} ms each"
    rows = [row("torchrun, one node: dataset calls per generation <= 1.05 N", f"{scope} scope, {where}",
                 "the dataset's own count of calls / N", value("{:.2f}", " N", tr[f"{scope}_calls_per_n"]),
                 "<= 1.05 N", lambda c: c <= 1.05) for scope in SCOPES]
    node, rank = tr["node_seen_min"], tr["rank_seen_min"]
    rows.append(row(f"torchrun, node store: a rank sees >= 90% of the node's data over {tr['read_epochs']} "
                     "read epochs", f"worst rank; {where}",
                     f"store per rank: {rank['median']:.1%}; independent random quarters: "
                     f"{tr['expected_independent']:.1%}", value("{:.1f}", "%", node, 100), ">= 90%",
                     lambda s: s >= 0.9))
    return rows


def main(argv: list[str] | None = None) -> int:
    """Run the scenario alone and print its section."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.torchrun_node", description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="smaller sizes")
    args = parser.parse_args(argv)
    from .config import COST, SIZES

    result = torchrun_scenario(cost=COST, **SIZES["quick" if args.quick else "full"]["torchrun"])
    print("\n".join(torchrun_section(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
