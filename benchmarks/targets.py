"""The performance targets of docs/ARCHITECTURE.md, checked against one run's results.

Each target becomes one or more rows: what docs/ARCHITECTURE.md asks, what was measured
(median ± half the min-max range over the repetitions), the value the goal is
about (its median, with the min-max range over the repetitions in brackets),
the goal, and whether the median meets it. A report, not a test: nothing fails
when a target is missed.
"""

from __future__ import annotations

from typing import Callable

from .first_epoch import first_epoch_rows
from .memory_objects import target_rows as memory_objects_rows
from .remote import remote_rows
from .streams import target_rows as streams_rows
from .sweep import sweep_rows
from .tables import MIB, TargetRow, percent, pm, row, seconds, times, value
from .torchrun_node import torchrun_rows

def _scaled(summary: dict, factor: float) -> dict:
    return {**summary, **{k: summary[k] * factor for k in ("median", "min", "max", "spread")}}


def _throughput_rows(results: dict) -> list[TargetRow]:
    rows = []
    memcpy = results.get("memcpy", {}).get("memory_bound", {}).get("median")
    for case in results.get("throughput") or []:
        big = case["sample_bytes"] > 1024
        ours, torch = case["ours_samples_per_s"], case["torch_samples_per_s"]
        where = f"{case['backend']} (ours read in {case['ours_reads_in']})"
        if big and memcpy:
            share = _scaled(ours, case["sample_bytes"] / memcpy)
            rows.append(row("cached epoch, 48 KiB samples: >= 0.5x memcpy", where,
                             f"{ours['median'] * case['sample_bytes'] / 1e9:.2f} GB/s vs memcpy "
                             f"{memcpy / 1e9:.2f} GB/s (memory-bound)",
                             times(share), ">= 0.5x", lambda r: r >= 0.5))
        if big and memcpy and case["backend"] == "memmap":
            rows.append(row("cached epoch of the loader, 48 KiB, memmap: >= 0.8x memcpy", where,
                             f"{ours['median'] * case['sample_bytes'] / 1e9:.2f} GB/s vs memcpy "
                             f"{memcpy / 1e9:.2f} GB/s (memory-bound)",
                             times(_scaled(ours, case["sample_bytes"] / memcpy)), ">= 0.8x", lambda r: r >= 0.8))
        if not big and case["backend"] == "memmap":
            rows.append(row("cached epoch, 16-float samples: >= 1.5M samples/s", where,
                             f"{pm(ours, 1e-3, '{:.1f}')} k samples/s", value("{:.2f}", "M/s", _scaled(ours, 1e-6)),
                             ">= 1.5M/s", lambda r: r >= 1.5))
        no_workers = case.get("no_workers_samples_per_s")
        if no_workers:
            rows.append(row("cached epoch: never slower with workers than without",
                             f"{case['backend']}, {'48 KiB' if big else 'small'} samples "
                             f"(gather in {case.get('gather_place')})",
                             f"{pm(ours, 1e-3, '{:.1f}')} vs {pm(no_workers, 1e-3, '{:.1f}')} k samples/s "
                             f"with {case['workers']} vs 0 workers",
                             times(ours["median"] / no_workers["median"]), ">= 1x (noise: >= 0.95x)",
                             lambda r: r >= 0.95))
        goal = 2.0 if big else 10.0
        rows.append(row(f"cached epoch, {'48 KiB' if big else 'small'} samples: >= {goal:g}x torch", where,
                         f"{pm(ours, 1e-3, '{:.1f}')} vs {pm(torch, 1e-3, '{:.1f}')} k samples/s",
                         times(case["ratio"]), f">= {goal:g}x", lambda r: r >= goal))
    return rows


def _expensive_rows(results: dict) -> list[TargetRow]:
    exp = results.get("expensive")
    if not exp:
        return []
    plain = "generate epoch <= 1.15x a plain (torch) epoch"
    rows = [row(f"expensive dataset, {exp['epochs']} epochs, K={exp['update_frequency']}: total <= 0.3x torch",
                 f"{exp['n']} samples, {exp['cost_ms']:g} ms each",
                 f"{pm(exp['ours_total'])} s vs {pm(exp['torch_total'])} s", times(exp["total_ratio"]),
                 "<= 0.3x", lambda r: r <= 0.3),
            row(plain, "epoch 0 (both start their workers)",
                 f"{exp['ours_epoch']['median'][0]:.2f} s vs {exp['torch_epoch']['median'][0]:.2f} s",
                 times(exp["epoch0_ratio"]), "<= 1.15x", lambda r: r <= 1.15,
                 "both fork their workers (ours: start_method='auto')")]
    if exp.get("refresh_ratio"):
        e = exp["refresh_epoch"]
        rows.append(row(plain, f"epoch {e} (refresh)",
                         f"{exp['ours_epoch']['median'][e]:.2f} s vs torch's median epoch "
                         f"{_median(exp['torch_epoch']['median'][1:]):.2f} s",
                         times(exp["refresh_ratio"]), "<= 1.15x", lambda r: r <= 1.15))
    return rows


def _read_transform_rows(results: dict) -> list[TargetRow]:
    rt = results.get("read_transform")
    if not rt:
        return []
    steady = ", ".join(str(e) for e in rt["steady_epochs"])
    distinct, epochs = rt["distinct"], rt["epochs"]
    torch = distinct["torch"]["median"]
    return [row(f"read transform, {epochs} epochs, K={rt['update_frequency']}: total <= 0.35x torch",
                 f"{rt['n']} samples, {rt['cost_ms']:g} ms decode + crop and flip",
                 f"{pm(rt['ours_total'])} s vs {pm(rt['torch_total'])} s", times(rt["total_ratio"]),
                 "<= 0.35x", lambda r: r <= 0.35,
                 f"without read_transform: {rt['plain_total_ratio']['median']:.2f}x"),
            row("read transform: steady cached epochs >= 0.8x the transform's limit",
                 f"read epochs {steady}, batch {rt['batch_size']}",
                 f"{pm(rt['ours_steady_samples_per_s'], 1, '{:.0f}')} vs "
                 f"{pm(rt['limit_samples_per_s'], 1, '{:.0f}')} samples/s (the transform alone in "
                 f"{rt['workers']} processes)", times(rt["steady_ratio"]), ">= 0.8x", lambda r: r >= 0.8),
            # Crops are drawn among CROP_CHOICES, so even independent draws repeat now and then
            # (expected_distinct_uniform, a little under the epochs): the goal is torch's own figure,
            # within noise.
            row(f"read transform: distinct crops per sample over {epochs} epochs = torch's",
                 "ours with read_transform",
                 f"torch {torch:.3f}, ours without read_transform {distinct['ours_plain']['median']:.3f} "
                 f"(independent draws: {rt['expected_distinct_uniform']:.3f})",
                 value("{:.3f}", f" of {epochs}", distinct["ours"]), f">= torch's - 0.05 ({torch - 0.05:.2f})",
                 lambda d: d >= torch - 0.05)]


def _median(values: list[float]) -> float:
    s = sorted(values)
    return (s[(len(s) - 1) // 2] + s[len(s) // 2]) / 2


def _training_rows(results: dict) -> list[TargetRow]:
    ts = results.get("training_step")
    if not ts:
        return []
    target = "training step: no epoch after the first waits > 5%"
    torch_worst = max(f["median"] for f in ts["torch"]["wait_fraction"][1:])
    rows = []
    for name, how in (("refresh", "background_refresh=True"), ("ours", "default (background_refresh='auto')")):
        fractions, modes = ts[name]["wait_fraction"], ts[name]["modes"]
        worst = max(range(1, ts["epochs"]), key=lambda e: fractions[e]["median"])
        note = f"the cached epochs leave the workers {ts['idle_margin']:.1f}x the time the refresh needs"
        if name == "ours" and modes[worst] == "generate":
            note = "a generate epoch: the loop waited while its samples were computed"
        rows.append(row(target, f"{how}: worst epoch after the first",
                         f"epoch {worst} ({modes[worst]}); torch's worst {torch_worst:.1%}",
                         percent(fractions[worst]), "<= 5%", lambda r: r <= 0.05, note))
    return rows


def _rotation_rows(results: dict) -> list[TargetRow]:
    rot = results.get("rotation")
    if not rot:
        return []
    r, calls = rot["rotation"], rot["dataset_calls_per_served_sample"]
    return [row(f"rotation R={r}: fresh samples per served ~ 1/R", f"{rot['n']} samples, window {rot['window']}",
                 "dataset calls / samples served (steady epochs)", (f"{calls:.3f}", calls), f"{1 / r:.2f} ± 0.02",
                 lambda c: abs(c - 1 / r) <= 0.02),
            row(f"rotation R={r}: served samples/s >= 3x plain", "vs the same loader without cache",
                 f"{pm(rot['served_samples_per_s'], 1, '{:.0f}')} vs "
                 f"{pm(rot['plain_samples_per_s'], 1, '{:.0f}')} samples/s",
                 times(rot["served_ratio"]), ">= 3x", lambda s: s >= 3)]


def _memory_rows(results: dict) -> list[TargetRow]:
    rows = []
    for mem in results.get("memory") or []:
        ours, torch, store = mem["ours_peak"]["median"], mem["torch_peak"]["median"], mem["store_bytes"]
        rows.append(row("peak memory <= torch's + the store's pages",
                         f"{mem['label']}; all processes, sum of {mem['metric'].upper()}",
                         f"{ours / MIB:.0f} MiB vs torch {torch / MIB:.0f} + store {store / MIB:.0f} MiB",
                         times(_scaled(mem["ours_peak"], 1 / (torch + store))), "<= 1x", lambda r: r <= 1,
                         f"added by the loader: {mem['ours_added']['median'] / MIB:.0f} MiB vs "
                         f"torch {mem['torch_added']['median'] / MIB:.0f} MiB"))
    return rows


def _latency_rows(results: dict) -> list[TargetRow]:
    rows = []
    first = results.get("first_batch")
    if first:
        for key, case in (("ours_committed_store", "committed store (read epoch)"),
                          ("ours_empty_store", "empty store (generate epoch)")):
            rows.append(row("first batch within 1 s of construction (warm)", case,
                             f"torch: {first['torch']['median']:.2f} s", seconds(first[key]), "<= 1 s",
                             lambda s: s <= 1.0))
    idle = results.get("idle_cpu")
    if idle:
        rows.append(row("no CPU in the training process while it waits", "sleeping dataset, no cache",
                         f"share of a core; torch: {idle['torch_cpu_share']['median']:.2%}",
                         value("{:.2f}", "%", idle["ours_cpu_share"], 100), "<= 1% of a core", lambda s: s <= 0.01,
                         f"{idle['batches_per_s']:g} batches/s handed over"))
    return rows


def _setup_rows(results: dict) -> list[TargetRow]:
    st = results.get("setup_time")
    if not st:
        return []
    gap, first = st["gap"], st["no_gap"]
    return [row(f"first epoch after a {st['gap_s']:g} s set-up vs torch",
                 f"{st['n']} samples, {st['cost_ms']:g} ms each; {st['gap_s']:g} s CPU between construction "
                 "and loop",
                 f"{pm(gap['ours_first_epoch_s'])} s vs {pm(gap['torch_first_epoch_s'])} s",
                 times(gap["ratio"]), "<= 1.05x", lambda r: r <= 1.05,
                 f"construction to end of epoch, set-up included: {gap['total_ratio']['median']:.2f}x"),
            row("first batch when the loop starts at once",
                 f"expensive dataset, batch {st['batch_size']}, from the start of construction",
                 f"constructor {first['ours_construct_s']['median'] * 1e3:.0f} ms; "
                 f"torch: {first['torch_first_batch_s']['median']:.2f} s",
                 seconds(first["ours_first_batch_s"]), "<= 1 s", lambda s: s <= 1.0,
                 f"the batch itself is {st['batch_size'] * st['cost_ms'] / 1e3:.2f} s of dataset CPU")]


def _larger_than_memory_rows(results: dict) -> list[TargetRow]:
    ltm = results.get("larger_than_memory")
    if not ltm:
        return []
    from .larger_than_memory import ratios

    rows = []
    for c in ltm["cases"]:
        r = ratios(c)
        where = (f"{c['sample']} samples, store {c['store_disk_bytes'] / ltm['limit_bytes']:.1f}x the limit "
                 f"({ltm['mode']})" if "store_disk_bytes" in c else c["sample"])

        def gbps(key: str, sub: str | None = None) -> str:
            figures = c[key][sub] if sub else c[key]
            return f"{figures['gbps']:.3g} GB/s" if "gbps" in figures else "failed"

        for key, target, measured, goal, ok, note in (
                ("block_vs_sequential", "larger than memory: block order >= 0.8x a sequential read",
                 lambda: f"{gbps('block')} vs {gbps('sequential')}", ">= 0.8x", lambda x: x >= 0.8, ""),
                ("random_vs_pread", "larger than memory: random order >= 0.8x parallel random pread",
                 lambda: f"{gbps('random')} vs {gbps('pread')}", ">= 0.8x", lambda x: x >= 0.8, ""),
                ("random_vs_torch", "larger than memory: random order >= 10x torch over the reader",
                 lambda: f"{gbps('random')} vs {gbps('torch')}", ">= 10x", lambda x: x >= 10,
                 "torch timed for a budget, extrapolated"),
                ("block_vs_torch", "larger than memory: block order >= 10x torch over the reader",
                 lambda: f"{gbps('block')} vs {gbps('torch')}", ">= 10x", lambda x: x >= 10,
                 "torch timed for a budget, extrapolated"),
                ("generate_limited_vs_unlimited", "larger than memory: generate epoch <= 1.2x without the limit",
                 lambda: f"{c['generate']['seconds']:.1f} s vs {c['generate_unlimited']['seconds']:.1f} s",
                 "<= 1.2x", lambda x: x <= 1.2, ""),
                ("lmdb_vs_sequential", "larger than memory: lmdb cached epoch >= 0.3x a sequential read",
                 lambda: f"{gbps('lmdb', 'epoch')} vs {gbps('sequential')}", ">= 0.3x", lambda x: x >= 0.3,
                 "else the README says memmap is the backend for caches larger than memory")):
            if r[key] is not None:
                rows.append(row(target, where, measured(), times(r[key]), goal, ok, note))
    return rows


ROW_BUILDERS: list[Callable[[dict], list[TargetRow]]] = [
    _throughput_rows, _expensive_rows, _read_transform_rows, _training_rows, _setup_rows, _rotation_rows,
    _memory_rows, memory_objects_rows, _latency_rows, _larger_than_memory_rows, sweep_rows, torchrun_rows, first_epoch_rows,
    remote_rows, streams_rows]


def target_rows(results: dict) -> list[TargetRow]:
    """Every target row the results allow (a scenario that was not run gives none)."""
    return [r for build in ROW_BUILDERS for r in build(results)]
