"""DESIGN.md's performance targets, checked against one run's results.

Each target becomes one or more rows: what DESIGN.md asks, what was measured
(median ± half the min-max range over the repetitions), the ratio the target
is about, the goal, and whether the median meets it. A report, not a test:
nothing fails when a target is missed.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

MIB = 1 << 20


@dataclass(frozen=True)
class TargetRow:
    """One line of the targets table."""

    target: str  # what DESIGN.md asks, in short
    case: str  # which measurement (backend, epoch, ...)
    measured: str  # the figures behind the value
    value: str  # the figure the goal is about, formatted ("3.4x", "2.1%", "0.27 s")
    number: float  # the same, as a number (for the JSON)
    goal: str  # e.g. ">= 2x"
    met: bool | None  # None: no verdict (informational row)
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pm(summary: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """``median ± spread`` of a :func:`~benchmarks.common.summarize` dict, scaled."""
    return f"{fmt.format(summary['median'] * scale)} ± {fmt.format(summary['spread'] * scale)}"


def times(r: float) -> tuple[str, float]:
    return f"{r:.2f}x", r


def percent(r: float) -> tuple[str, float]:
    return f"{r:.1%}", r


def seconds(r: float) -> tuple[str, float]:
    return f"{r:.2f} s", r


def _throughput_rows(results: dict) -> list[TargetRow]:
    rows = []
    memcpy = results.get("memcpy", {}).get("memory_bound", {}).get("median")
    for case in results.get("throughput", []):
        big = case["sample_bytes"] > 1024
        size = "48 KiB" if big else "small"
        ours, torch = case["ours_samples_per_s"], case["torch_samples_per_s"]
        where = f"{case['backend']} (ours read in {case['ours_reads_in']})"
        if big and memcpy:
            gbps = ours["median"] * case["sample_bytes"] / 1e9
            ratio = ours["median"] * case["sample_bytes"] / memcpy
            rows.append(TargetRow("cached epoch 48 KiB >= 0.5x memcpy", where,
                                  f"{gbps:.2f} GB/s vs memcpy {memcpy / 1e9:.2f} GB/s (memory-bound)",
                                  *times(ratio), ">= 0.5x", ratio >= 0.5))
        goal = 2.0 if big else 10.0
        ratio = case["ratio"]["median"]
        rows.append(TargetRow(f"cached epoch {size} >= {goal:g}x torch", where,
                              f"{pm(ours, 1e-3, '{:.1f}')} vs {pm(torch, 1e-3, '{:.1f}')} k samples/s",
                              *times(ratio), f">= {goal:g}x", ratio >= goal))
    return rows


def _expensive_rows(results: dict) -> list[TargetRow]:
    exp = results.get("expensive")
    if not exp:
        return []
    total, e0 = exp["total_ratio"]["median"], exp["epoch0_ratio"]["median"]
    rows = [TargetRow(f"expensive dataset, {exp['epochs']} epochs, K={exp['update_frequency']}: "
                      "total <= 0.3x torch", f"{exp['n']} samples, {exp['cost_ms']:g} ms each",
                      f"{pm(exp['ours_total'])} s vs {pm(exp['torch_total'])} s", *times(total), "<= 0.3x", total <= 0.3),
            TargetRow("generate epoch <= 1.15x a plain (torch) epoch", "epoch 0 (both start workers)",
                      f"{exp['ours_epoch']['median'][0]:.2f} s vs {exp['torch_epoch']['median'][0]:.2f} s",
                      *times(e0), "<= 1.15x", e0 <= 1.15, "ours spawns its workers, torch forks")]
    if exp.get("refresh_ratio"):
        e, ratio = exp["refresh_epoch"], exp["refresh_ratio"]["median"]
        rows.append(TargetRow("generate epoch <= 1.15x a plain (torch) epoch", f"epoch {e} (refresh)",
                              f"{exp['ours_epoch']['median'][e]:.2f} s vs torch's median epoch",
                              *times(ratio), "<= 1.15x", ratio <= 1.15))
    return rows


def _training_rows(results: dict) -> list[TargetRow]:
    ts = results.get("training_step")
    if not ts:
        return []
    worst = ts["ours_worst_after_first"]
    worst_e = max(range(1, ts["epochs"]), key=lambda e: ts["ours_wait_fraction"][e]["median"])
    rows = [TargetRow("training step: no epoch after the first waits > 5%", "worst epoch after the first",
                      f"epoch {worst_e} ({ts['modes'][worst_e]}) waits {worst:.1%}; torch "
                      f"{max(f['median'] for f in ts['torch_wait_fraction'][1:]):.1%}",
                      *percent(worst), "<= 5%", worst <= 0.05,
                      "background refresh is not implemented: refresh epochs compute while the loop waits")]
    cached = ts.get("ours_worst_cached_after_first")
    if cached is not None:
        rows.append(TargetRow("training step: no epoch after the first waits > 5%", "worst cached (read) epoch",
                              f"waits {cached:.1%} of the epoch", *percent(cached), "<= 5%", cached <= 0.05))
    return rows


def _rotation_rows(results: dict) -> list[TargetRow]:
    rot = results.get("rotation")
    if not rot:
        return []
    r, calls, served = rot["rotation"], rot["dataset_calls_per_served_sample"], rot["served_ratio"]["median"]
    return [TargetRow(f"rotation R={r}: fresh samples per served ~ 1/R", f"{rot['n']} samples, window {rot['window']}",
                      "dataset calls / samples served (steady epochs)", f"{calls:.3f}", calls, f"{1 / r:.2f} ± 0.02",
                      abs(calls - 1 / r) <= 0.02),
            TargetRow(f"rotation R={r}: served samples/s >= 3x plain", "vs the same loader without cache",
                      f"{pm(rot['served_samples_per_s'], 1, '{:.0f}')} vs "
                      f"{pm(rot['plain_samples_per_s'], 1, '{:.0f}')} samples/s",
                      *times(served), ">= 3x", served >= 3)]


def _memory_rows(results: dict) -> list[TargetRow]:
    mem = results.get("memory")
    if not mem:
        return []
    ours, torch, store = mem["ours_peak"]["median"], mem["torch_peak"]["median"], mem["store_bytes"]
    ratio = ours / (torch + store)
    return [TargetRow("peak memory <= torch's + the store's pages",
                      f"all processes, sum of {mem['metric'].upper()}",
                      f"{ours / MIB:.0f} MiB vs torch {torch / MIB:.0f} + store {store / MIB:.0f} MiB",
                      *times(ratio), "<= 1x", ratio <= 1,
                      f"added by the loader: {mem['ours_added']['median'] / MIB:.0f} MiB vs "
                      f"torch {mem['torch_added']['median'] / MIB:.0f} MiB")]


def _latency_rows(results: dict) -> list[TargetRow]:
    rows = []
    first = results.get("first_batch")
    if first:
        for key, case in (("ours_committed_store", "committed store (read epoch)"),
                          ("ours_empty_store", "empty store (generate epoch)")):
            s = first[key]["median"]
            rows.append(TargetRow("first batch within 1 s of construction (warm)", case,
                                  f"{pm(first[key])} s (torch: {first['torch']['median']:.2f} s)",
                                  *seconds(s), "<= 1 s", s <= 1.0))
    idle = results.get("idle_cpu")
    if idle:
        share = idle["ours_cpu_share"]["median"]
        rows.append(TargetRow("no CPU in the training process while it waits", "sleeping dataset, no cache",
                              f"{share:.2%} of a core (torch: {idle['torch_cpu_share']['median']:.2%})",
                              *percent(share), "<= 1% of a core", share <= 0.01,
                              f"{idle['batches_per_s']:g} batches/s handed over"))
    return rows


ROW_BUILDERS: list[Callable[[dict], list[TargetRow]]] = [
    _throughput_rows, _expensive_rows, _training_rows, _rotation_rows, _memory_rows, _latency_rows]


def target_rows(results: dict) -> list[TargetRow]:
    """Every target row the results allow (a scenario that was not run gives none)."""
    return [row for build in ROW_BUILDERS for row in build(results)]
