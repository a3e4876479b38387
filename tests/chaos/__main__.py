"""``python -m tests.chaos`` (``make chaos``): run chaos scenarios, print the table of fault x outcome.

Environment:

``CHAOS_SEED``  seed of the first scenario (default: random, printed); scenario ``i`` uses ``CHAOS_SEED + i``,
                so ``CHAOS_SEED=<a failing seed> CHAOS_N=1`` runs that scenario again
``CHAOS_N``     number of scenarios (default 200)
``CHAOS_DIR``   where scenario directories go (default: a new temporary directory); those of failing
                scenarios are kept, with each run's spec, event log and stderr
``CHAOS_KEEP``  ``1``: keep the directories of passing scenarios too
``CHAOS_FAULTS`` ``original``: draw only the faults of the suite's first version (the seeds named in
                ``test_regressions.py`` call their scenario so)

Exit status: 0 when every scenario passed, was skipped (with the reason) or failed only by bugs
already known (``checks.KNOWN_BUGS``, each a strict xfail in ``test_regressions.py``); 1 otherwise.
Known-bug failures are still counted as failures in the table and listed with their seeds.
"""

from __future__ import annotations

import os
import random
import sys
import tempfile
import time
from pathlib import Path

from .checks import KNOWN_BUGS
from .runner import ScenarioResult, run_scenario, summary_line
from .scenario import FAULTS, ORIGINAL, draw

DEFAULT_N = 200


def table(results: list[ScenarioResult]) -> str:
    """Fault x outcome: scenarios with the fault, how many passed, failed, were skipped, and in how
    many the fault took effect (``fired``)."""
    rows = [("fault", "scenarios", "fired", "pass", "fail", "of which known bugs", "skip")]
    for fault in (*FAULTS, "(all)"):
        mine = [r for r in results if fault == "(all)" or fault in r.scenario["faults"]]
        rows.append((fault, len(mine), sum(fault in r.fired or fault == "(all)" and bool(r.fired) for r in mine),
                     sum(r.passed for r in mine), sum(bool(r.problems) for r in mine),
                     sum(bool(r.known_bugs) for r in mine), sum(r.skipped is not None for r in mine)))
    widths = [max(len(str(row[k])) for row in rows) for k in range(len(rows[0]))]
    lines = ["  ".join(str(v).rjust(w) if k else str(v).ljust(w) for k, (v, w) in enumerate(zip(row, widths)))
             for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    lines.insert(len(lines) - 1, "-" * len(lines[0]))
    return "\n".join(lines)


def main() -> int:
    seed = int(os.environ["CHAOS_SEED"]) if os.environ.get("CHAOS_SEED") else random.randrange(1, 10**6)
    n = int(os.environ.get("CHAOS_N", DEFAULT_N))
    keep = os.environ.get("CHAOS_KEEP") == "1"
    kinds = ORIGINAL if os.environ.get("CHAOS_FAULTS") == "original" else FAULTS
    workdir = Path(os.environ.get("CHAOS_DIR") or tempfile.mkdtemp(prefix="cachestore-chaos-"))
    workdir.mkdir(parents=True, exist_ok=True)
    print(f"chaos: CHAOS_SEED={seed} CHAOS_N={n} (scenario i uses seed {seed} + i); directories under {workdir}",
          flush=True)
    results: list[ScenarioResult] = []
    start = time.monotonic()
    for i in range(n):
        result = run_scenario(draw(seed + i, kinds), workdir, keep=keep)
        results.append(result)
        print(summary_line(result), flush=True)
        for problem in result.problems:
            print("        " + problem.replace("\n", "\n        "), flush=True)
        for note in result.notes:
            print("        note: " + note, flush=True)
        if result.skipped:
            print(f"        skipped: {result.skipped}", flush=True)
    wall = time.monotonic() - start
    print()
    print(table(results))
    failed = [r for r in results if r.problems]
    new = [r for r in failed if not r.known_bugs]
    if not os.environ.get("CHAOS_DIR"):
        try:
            workdir.rmdir()  # every scenario removed its own directory: leave no empty one behind
        except OSError:
            pass  # a failing scenario's directory is kept for its logs
    print(f"\n{len(results)} scenarios in {wall:.0f} s (CHAOS_SEED={seed} CHAOS_N={n}): "
          f"{len(results) - len(failed)} passed or skipped, {len(failed)} failed "
          f"({len(failed) - len(new)} of them by known bugs only)")
    for r in failed:
        known = f"  known bug: {', '.join(r.known_bugs)}" if r.known_bugs else ""
        print(f"  failing: CHAOS_SEED={r.scenario['seed']} CHAOS_N=1  ({r.directory}){known}")
    seen = sorted({bug for r in failed for bug in r.known_bugs})
    if seen:
        print("\nknown bugs met (each a strict xfail in tests/chaos/test_regressions.py):")
        for bug in seen:
            print(f"  {bug}: {KNOWN_BUGS[bug][1]}")
    return 1 if new else 0


if __name__ == "__main__":
    sys.exit(main())
