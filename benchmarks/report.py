"""Writing one run's results: JSON, a Markdown report and a PNG plot.

matplotlib is imported only by :func:`plot` (it is a benchmark extra, not a
dependency of the package).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from .first_epoch import first_epoch_section
from .sweep import sweep_section
from .tables import MIB, TargetRow, md_table, pm
from .targets import target_rows
from .torchrun_node import torchrun_section


def _write_atomic(path: Path, data: bytes) -> None:
    """Write `data` to `path` through a ``.tmp`` name and a rename (results/*.tmp is git-ignored)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


def targets_table(rows: list[TargetRow]) -> str:
    """The table of the performance targets (docs/ARCHITECTURE.md; also pasted into the README)."""
    def verdict(met: bool) -> str:
        return "met" if met else "**not met**"

    return md_table(["target (ARCHITECTURE.md)", "case", "measured", "value", "goal", "result"],
                    [[r.target, r.case, r.measured + (f" — {r.note}" if r.note else ""), r.value, r.goal,
                      verdict(r.met)] for r in rows], "lllrrl")


def _runs(n: int) -> str:
    return f"{n} run" + ("s" if n != 1 else "")


def _machine(meta: dict) -> str:
    llc = f"{meta['llc_bytes'] / MIB:.0f} MiB" if meta.get("llc_bytes") else "unknown"
    return (f"{meta['cpu']}, {meta['cores']} cores, {meta['ram_bytes'] / 2**30:.1f} GiB RAM, last-level cache {llc}; "
            f"Python {meta['python']}, numpy {meta['numpy']}, torch {meta['torch']}; "
            f"load average {meta['loadavg_start'][0]:.2f} at the start, {meta['loadavg_end'][0]:.2f} at the end")


def _memcpy(results: dict) -> str:
    mc = results["memcpy"]
    return (f"memcpy (`np.copyto`, bytes copied per second): **memory-bound {pm(mc['memory_bound'], 1e-9)} GB/s** "
            f"({mc['memory_bound_nbytes'] / MIB:.0f} MiB buffers, far beyond the last-level cache, like a random "
            f"gather from a store that does not fit in it; the ratios use this one) and cache-resident "
            f"{pm(mc['cache_resident'], 1e-9)} GB/s ({mc['cache_resident_nbytes'] / MIB:.0f} MiB buffers, for "
            "reference).")


def _expensive_section(exp: dict) -> list[str]:
    rows = []
    for e, mode in enumerate(exp["modes"]):
        o, t = exp["ours_epoch"]["median"][e], exp["torch_epoch"]["median"][e]
        rows.append([e, mode, f"{o:.2f}", f"{t:.2f}", f"{o / t:.2f}x"])
    rows.append(["total", "", pm(exp["ours_total"]), pm(exp["torch_total"]), f"{exp['total_ratio']['median']:.2f}x"])
    return [f"### 1. Expensive dataset: {exp['n']} samples of 48 KiB, {exp['cost_ms']:g} ms CPU each, "
            f"{exp['epochs']} epochs, update_frequency={exp['update_frequency']}, {exp['workers']} workers, "
            f"batch {exp['batch_size']}", "",
            f"Seconds per epoch, median of {_runs(exp['repeats'])} of each (alternating). Epoch 0 includes starting "
            "the workers (both fork them: ours with start_method='auto').", "",
            md_table(["epoch", "CachedLoader mode", "CachedLoader s", "torch DataLoader s", "ours / torch"], rows,
                     "llrrr")]


def _back_to_back(case: dict, memcpy: float | None) -> str:
    """Our epochs one after another: samples/s and x memcpy (runs before this figure: "-")."""
    b2b = case.get("ours_back_to_back_samples_per_s")
    if not b2b:
        return "-"
    ratio = f" ({b2b['median'] * case['sample_bytes'] / memcpy:.2f}x)" if memcpy else ""
    return pm(b2b, 1e-3, "{:.1f}") + ratio


def _throughput_section(cases: list[dict], memcpy: float | None) -> list[str]:
    rows = []
    for c in cases:
        ours, gather = c["ours_samples_per_s"]["median"], c["gather_samples_per_s"]["median"]
        size = f"{c['sample_bytes'] / 1024:.1f} KiB" if c["sample_bytes"] > 1024 else f"{c['sample_bytes']} B"
        gbps = ours * c["sample_bytes"]
        no_workers = c.get("no_workers_samples_per_s")
        split = c.get("split_s_per_batch")
        rows.append([c["backend"], size, c["n"], c["ours_reads_in"], pm(c["ours_samples_per_s"], 1e-3, "{:.1f}"),
                     f"{gbps / 1e9:.2f}", f"{gbps / memcpy:.2f}x" if memcpy else "-",
                     _back_to_back(c, memcpy),
                     pm(no_workers, 1e-3, "{:.1f}") if no_workers else "(same)", f"{gather / 1e3:.1f}",
                     " / ".join(f"{split[k] * 1e6:.0f}" for k in ("gather", "verify", "hand_off")) if split else "-",
                     pm(c["torch_samples_per_s"], 1e-3, "{:.1f}"), f"{c['ratio']['median']:.1f}x"])
    c0 = cases[0]
    return [f"### 2. Cached-epoch throughput: batch {c0['batch_size']}, {c0['workers']} workers, random order", "",
            "k samples/s, median ± half-range of the epochs after a warm-up epoch, ours and torch alternating. "
            "*ours reads in*: where the loader chose to gather (loader/epochs/reads/placement.py); *0 workers*: "
            "the same store read by a loader with `nb_worker=0`. *store gather*: `reader.get_batch` (verified) into "
            "reused buffers in one process, no loader. *split*: microseconds per batch of the store gather "
            "without checksums / what verifying them adds / the rest of a loader epoch (hand-off, reorder, "
            "tensor wrap) over the verified gather. *ours back to back*: the same loader's epochs one after "
            "another, nothing in between, as a training run has them (the targets use the alternating "
            "figure). "
            "torch: `DataLoader(store.reader(), num_workers=2)`, one sample at a time.", "",
            md_table(["backend", "sample", "samples", "ours reads in", "ours k/s", "ours GB/s", "x memcpy",
                      "ours back to back k/s", "0 workers k/s", "store gather k/s",
                      "split us/batch: gather / verify / hand-off", "torch k/s", "ours / torch"], rows,
                     "lrrlrrrrrrlrr")]


def _rotation_section(rot: dict) -> list[str]:
    return [f"### 3. Rotation R={rot['rotation']}: {rot['n']} samples, {rot['cost_ms']:g} ms each, "
            f"window {rot['window']} samples in RAM", "",
            md_table(["loader", "served samples/s", "fresh (computed) samples/s", "dataset calls per served"], [
                ["plain (no cache)", pm(rot["plain_samples_per_s"], 1, "{:.0f}"),
                 pm(rot["plain_samples_per_s"], 1, "{:.0f}"), f"{rot['plain_calls_per_served_sample']:.3f}"],
                [f"rotation R={rot['rotation']}", pm(rot["served_samples_per_s"], 1, "{:.0f}"),
                 pm(rot["fresh_samples_per_s"], 1, "{:.0f}"), f"{rot['dataset_calls_per_served_sample']:.3f}"]])]


def _gather_note(epoch: dict) -> str:
    """Where a read epoch gathered, and what each place cost per batch when the loader timed them."""
    place = epoch.get("gather", "-")
    if epoch.get("gather_split"):
        place = " then ".join(epoch["gather_split"])
    costs = epoch.get("gather_costs")
    if costs:
        place += " (" + ", ".join(f"{k} {v * 1e3:.1f}" for k, v in sorted(costs.items())) + " ms/batch)"
    return place


def _read_transform_section(rt: dict) -> list[str]:
    stats = rt["ours_stats"][-1]
    rows = []
    for e, epoch in enumerate(stats):
        o, p, t = (rt[f"{name}_epoch"]["median"][e] for name in ("ours", "ours_plain", "torch"))
        mode = epoch["mode"] + (" (steady)" if e in rt["steady_epochs"] else "")
        rows.append([e, mode, f"{o:.2f}", _gather_note(epoch) if epoch["mode"] == "read" else "-",
                     epoch.get("background_computed", "-"), f"{p:.2f}", f"{t:.2f}", f"{o / t:.2f}x"])
    rows.append(["total", "", pm(rt["ours_total"]), "", "", pm(rt["ours_plain_total"]), pm(rt["torch_total"]),
                 f"{rt['total_ratio']['median']:.2f}x"])
    distinct, epochs = rt["distinct"], rt["epochs"]
    side, crop = rt["image_side"], rt["crop_side"]
    return [f"### 7. Read transform: {rt['n']} samples, {rt['cost_ms']:g} ms CPU decode each ({side}x{side}x3 "
            f"uint8), random {crop}x{crop} crop and flip, {epochs} epochs, "
            f"update_frequency={rt['update_frequency']}, {rt['workers']} workers, batch {rt['batch_size']}", "",
            f"Seconds per epoch, median of {_runs(rt['repeats'])} of each (taking turns). *ours*: "
            "`read_transform=random_crop_flip` over the cached decode (*gather*: where its last run gathered each "
            "read epoch, and the cost per batch of each place it timed; *refresh*: samples of the next generation "
            "its workers computed beside the epoch's batches, `background_refresh='auto'`); *ours, crop cached*: "
            "the crop in `__getitem__`, no read transform; torch: `DataLoader(shuffle=True)`, decode and crop "
            "in `__getitem__` every epoch (benchmarks/datasets.py). *steady*: read epochs other than the first "
            "read epoch of each generation.", "",
            md_table(["epoch", "ours mode", "ours s", "ours gather", "ours refresh", "ours, crop cached s",
                      "torch s", "ours / torch"], rows, "llrlrrrr"), "",
            f"Steady cached epochs: {pm(rt['ours_steady_samples_per_s'], 1, '{:.0f}')} samples/s; the transform's "
            f"limit, the transform alone in {rt['workers']} processes over images already in their memory, "
            f"stacked into batches of {rt['batch_size']}: {pm(rt['limit_samples_per_s'], 1, '{:.0f}')} samples/s "
            f"(ours / limit {rt['steady_ratio']['median']:.2f}x).", "",
            md_table(["distinct crops per sample", f"of {epochs} epochs"], [
                ["ours, read_transform", f"{distinct['ours']['median']:.3f}"],
                ["ours, crop cached (no read_transform)", f"{distinct['ours_plain']['median']:.3f}"],
                ["torch DataLoader", f"{distinct['torch']['median']:.3f}"],
                [f"independent uniform draws among {rt['crop_choices']} crops (expected)",
                 f"{rt['expected_distinct_uniform']:.3f}"]], "lr")]


def _memory_section(cases: list[dict]) -> list[str]:
    def mib(s: dict) -> str:
        return pm(s, 1 / MIB, "{:.0f}")

    metric = cases[0]["metric"].upper()
    how = ("PSS: shared pages split between the processes that map them, so shared memory, forked "
           "copy-on-write pages and the store's mapped files count once" if metric == "PSS"
           else "RSS (no smaps_rollup here: shared pages count once per process)")
    rows = []
    for mem in cases:
        k = mem["update_frequency"] or "inf"
        case = f"{mem['label']}, {mem['kwargs']['n']} samples, {mem['epochs']} epochs, K={k}"
        rows.append([case, "CachedLoader", mib(mem["ours_peak"]), mib(mem["ours_added"]),
                     f"{mem['store_bytes'] / MIB:.0f}", mib(mem["ours_peak_rss"])])
        rows.append([case, "torch DataLoader", mib(mem["torch_peak"]), mib(mem["torch_added"]), "-",
                     mib(mem["torch_peak_rss"])])
    c0 = cases[0]
    return ["### 4. Peak memory, all processes", "",
            f"Sum over the training process and all its children, sampled every {c0['interval_s']:g} s by a "
            "process of its own (a thread would make ours spawn its workers); MiB, median of "
            f"{_runs(c0['repeats'])}. Metric: {how}. *added*: peak minus the "
            "same sum just before the loader was built. torch's DataLoader loads the dataset itself (no cache); "
            "the target allows ours one generation of the store more.", "",
            md_table(["case", "loader", f"peak {metric}", f"added {metric}", "store MiB", "peak sum of RSS"], rows,
                     "llrrrr")]


def _training_section(ts: dict) -> list[str]:
    rows = []
    refresh, ours, torch = ts["refresh"], ts["ours"], ts["torch"]
    for e in range(ts["epochs"]):
        rows.append([e, refresh["modes"][e], f"{refresh['epoch_s'][e]:.2f}",
                     f"{refresh['wait_fraction'][e]['median']:.1%}", ours["modes"][e], f"{ours['epoch_s'][e]:.2f}",
                     f"{ours['wait_fraction'][e]['median']:.1%}", f"{torch['epoch_s'][e]:.2f}",
                     f"{torch['wait_fraction'][e]['median']:.1%}"])
    return [f"### 5. Simulated training step: {ts['step_ms']:g} ms sleep per batch of {ts['batch_size']}, "
            f"{ts['n']} samples, {ts['cost_ms']:g} ms each, update_frequency={ts['update_frequency']}", "",
            "Share of each epoch the loop spent waiting in `iter()`/`next()` (median of "
            f"{_runs(ts['repeats'])} of each, taking turns; epoch 0 includes building the loader). CachedLoader with "
            "`background_refresh=True` (its idle workers compute the next generation during the cached epochs), "
            "as configured by default (background_refresh='auto': on when the budget has room), and torch.", "",
            md_table(["epoch", "bg refresh: mode", "s", "waits", "default: mode", "s", "waits", "torch s",
                      "torch waits"], rows, "llrrlrrrr")]


def _ratio(case: dict, key: str) -> float:
    """Ours over torch, of the medians of ``ours_<key>`` and ``torch_<key>``."""
    return case[f"ours_{key}"]["median"] / case[f"torch_{key}"]["median"]


def _setup_section(st: dict) -> list[str]:
    gap, first = st["gap"], st["no_gap"]
    return [f"### 6. Set-up time: {st['n']} samples, {st['cost_ms']:g} ms each, {st['workers']} workers, "
            f"batch {st['batch_size']}", "",
            f"Seconds, median ± half-range of {_runs(st['repeats'])} of each (alternating, fresh loaders and "
            f"cache directories). *gap*: {st['gap_s']:g} s of CPU in the training process's main thread "
            "(building a model) between construction and the loop; both loaders start their workers at "
            "`iter()`, so both first epochs include their workers' start. *no gap*: the loop starts "
            "right after construction. Ours: a cache with default settings, so the first epoch generates "
            "(computes and writes the store); torch: `DataLoader(shuffle=True)`, workers not persistent. *CPU*: "
            "user + system seconds, steadier than wall times when neighbours load the machine; the workers' "
            "includes their start (both fork: ours with start_method='auto').", "",
            md_table(["case", "measure", "CachedLoader", "torch DataLoader", "ours / torch"], [
                ["gap", "first epoch, loop start to end", pm(gap["ours_first_epoch_s"]),
                 pm(gap["torch_first_epoch_s"]), f"{gap['ratio']['median']:.2f}x"],
                ["gap", "construction to end of first epoch", pm(gap["ours_total_s"]), pm(gap["torch_total_s"]),
                 f"{gap['total_ratio']['median']:.2f}x"],
                ["gap", f"wall time of the {st['gap_s']:g} s CPU set-up", pm(gap["ours_gap_wall_s"]),
                 pm(gap["torch_gap_wall_s"]), ""],
                ["gap", "CPU of the workers, start to exit", pm(gap["ours_workers_cpu_s"]),
                 pm(gap["torch_workers_cpu_s"]), f"{_ratio(gap, 'workers_cpu_s'):.2f}x"],
                ["gap", "CPU of the training process during the epoch", pm(gap["ours_epoch_cpu_s"]),
                 pm(gap["torch_epoch_cpu_s"]), ""],
                ["no gap", "construction to first batch", pm(first["ours_first_batch_s"]),
                 pm(first["torch_first_batch_s"]), ""],
                ["no gap", "constructor alone", pm(first["ours_construct_s"], 1e3, "{:.1f}") + " ms",
                 pm(first["torch_construct_s"], 1e3, "{:.1f}") + " ms", ""]], "llrrr")]


def _latency_section(results: dict) -> list[str]:
    lines = ["### Start-up and idle", ""]
    first = results.get("first_batch")
    if first:
        lines.append(f"Seconds from construction to the first batch (batch {first['batch_size']} of "
                     f"{first['shape']} float32, {first['workers']} workers, cheap dataset, warm, median of "
                     f"{first['repeats']}): ours with a committed store {pm(first['ours_committed_store'])}, "
                     f"ours with an empty store {pm(first['ours_empty_store'])}, torch {pm(first['torch'])}.")
    idle = results.get("idle_cpu")
    if idle:
        lines.append("")
        lines.append(f"CPU of the training process while it waits (dataset sleeping {idle['delay_s']:g} s per "
                     f"sample, {idle['batches_per_s']:g} batches/s, no cache): ours "
                     f"{pm(idle['ours_cpu_share'], 100, '{:.2f}')} % of a core, torch "
                     f"{pm(idle['torch_cpu_share'], 100, '{:.2f}')} %.")
    return lines


def markdown(results: dict, rows: list[TargetRow], png_name: str | None) -> str:
    """The full report: machine, memcpy, targets table, one section per scenario, the plot."""
    meta = results["meta"]
    out = [f"# Benchmarks, {meta['date']}", "",
           f"`{meta['command']}` on {_machine(meta)}. Took {meta['duration_s'] / 60:.1f} min. Figures are medians "
           "over repetitions, ± half the min-max range; ours and torch run alternately, so a neighbour's load "
           "hits both." + (f" Verified reads use the {meta['verified_gather']} gather (cachestore/format/_gather.c)."
                           if "verified_gather" in meta else ""), ""]
    if "memcpy" in results:
        out += [_memcpy(results), ""]
    out += ["## Targets", "", targets_table(rows), ""]
    if png_name:
        out += [f"![per-epoch time and throughput]({png_name})", ""]
    out += ["## Details", ""]
    memcpy = results.get("memcpy", {}).get("memory_bound", {}).get("median")
    sections = [("expensive", _expensive_section), ("throughput", lambda cases: _throughput_section(cases, memcpy)),
                ("rotation", _rotation_section), ("memory", _memory_section), ("training_step", _training_section),
                ("setup_time", _setup_section), ("read_transform", _read_transform_section)]
    sections += [("sweep", sweep_section), ("torchrun", torchrun_section), ("first_epoch", first_epoch_section)]
    for key, section in sections:
        if results.get(key):
            out += section(results[key]) + [""]
    if results.get("first_batch") or results.get("idle_cpu"):
        out += _latency_section(results) + [""]
    if results.get("larger_than_memory"):
        from .larger_than_memory import markdown_section

        out += markdown_section(results["larger_than_memory"]) + [""]
    if results.get("memory_objects"):
        from .memory_objects import markdown_section as objects_section

        out += objects_section(results["memory_objects"]) + [""]
    if results.get("streams"):
        from .streams import markdown_section as streams_section

        out += streams_section(results["streams"]) + [""]
    return "\n".join(out).rstrip("\n") + "\n"


def plot(results: dict, path: Path) -> bool:
    """Per-epoch time (ours vs torch), throughput vs memcpy, small samples/s, wait share; False without matplotlib."""
    try:
        import matplotlib
    except ImportError:
        return False
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .plots import epochs_panel, small_panel, throughput_panel, wait_panel

    fig, axes = plt.subplots(2, 2, figsize=(13, 9))
    epochs_panel(axes[0][0], results.get("expensive"))
    throughput_panel(axes[0][1], results.get("throughput"), results.get("memcpy"))
    small_panel(axes[1][0], results.get("throughput"))
    wait_panel(axes[1][1], results.get("training_step"))
    fig.suptitle(f"cachestore CachedLoader vs torch DataLoader, {results['meta']['date']} "
                 f"({results['meta']['cores']} cores)")
    fig.tight_layout()
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, dpi=110, format="png")
    plt.close(fig)
    os.replace(tmp, path)
    return True


def write_reports(results: dict, out_dir: Path, stem: str) -> dict[str, Path]:
    """Write ``<stem>.json``, ``<stem>.md`` and ``<stem>.png`` (when matplotlib is there) into `out_dir`."""
    out_dir.mkdir(parents=True, exist_ok=True)
    rows = target_rows(results)
    results["targets"] = [r.as_dict() for r in rows]
    paths = {"json": out_dir / f"{stem}.json", "md": out_dir / f"{stem}.md"}
    png = out_dir / f"{stem}.png"
    if plot(results, png):
        paths["png"] = png
    _write_atomic(paths["json"], (json.dumps(results, indent=1) + "\n").encode())
    _write_atomic(paths["md"], markdown(results, rows, png.name if "png" in paths else None).encode())
    return paths
