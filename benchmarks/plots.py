"""The panels of the benchmark plot (matplotlib axes in, nothing out); used by :func:`benchmarks.report.plot`."""

from __future__ import annotations

from typing import Any

import numpy as np

OURS, TORCH, GATHER = "#1f77b4", "#d62728", "#7f7f7f"


def _empty(ax: Any, title: str) -> None:
    ax.set_title(title)
    ax.text(0.5, 0.5, "not run", ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()


def _bars(ax: Any, x: np.ndarray, width: float, values: list[float], lo: list[float], hi: list[float],
          **kw: Any) -> None:
    """Bars at the medians with error bars from min to max."""
    values, lo, hi = (np.asarray(v, dtype=float) for v in (values, lo, hi))
    ax.bar(x, values, width, yerr=[values - lo, hi - values], capsize=2, **kw)


def epochs_panel(ax: Any, exp: dict | None) -> None:
    """Seconds per epoch of the expensive dataset, ours vs torch (log scale)."""
    title = "Expensive dataset: seconds per epoch (median, min-max)"
    if not exp:
        return _empty(ax, title)
    x = np.arange(len(exp["modes"]))
    for offset, key, color, label in ((-0.2, "ours_epoch", OURS, "CachedLoader"),
                                      (0.2, "torch_epoch", TORCH, "torch DataLoader")):
        e = exp[key]
        _bars(ax, x + offset, 0.4, e["median"], e["min"], e["max"], color=color, label=label)
    ax.set_yscale("log")
    ax.set_ylim(top=20 * max(exp["torch_epoch"]["max"] + exp["ours_epoch"]["max"]))  # room for the legend
    ax.set_xticks(x, [f"{e}\n{'gen' if m == 'generate' else m}" for e, m in enumerate(exp["modes"])])
    ax.set_xlabel("epoch (CachedLoader mode)")
    ax.set_ylabel("seconds (log scale)")
    ax.set_title(f"{title}\n{exp['n']} samples x {exp['cost_ms']:g} ms, K={exp['update_frequency']}, "
                 f"{exp['workers']} workers; total {exp['total_ratio']['median']:.2f}x torch")
    ax.legend(loc="upper center", ncol=2, fontsize="small")


def throughput_panel(ax: Any, cases: list[dict] | None, memcpy: dict | None) -> None:
    """GB/s of cached 48 KiB epochs per backend: ours, the raw store gather, torch; memcpy lines."""
    title = "Cached epoch, 48 KiB samples: GB/s vs memcpy"
    big = [c for c in cases or [] if c["sample_bytes"] > 1024]
    if not big:
        return _empty(ax, title)
    x = np.arange(len(big))
    for offset, key, color, label in ((-0.27, "ours_samples_per_s", OURS, "CachedLoader"),
                                      (0.0, "gather_samples_per_s", GATHER, "store gather (no loader)"),
                                      (0.27, "torch_samples_per_s", TORCH, "torch DataLoader")):
        scale = [c["sample_bytes"] / 1e9 for c in big]
        _bars(ax, x + offset, 0.27, [c[key]["median"] * s for c, s in zip(big, scale)],
              [c[key]["min"] * s for c, s in zip(big, scale)], [c[key]["max"] * s for c, s in zip(big, scale)],
              color=color, label=label)
    if memcpy:
        bound = memcpy["memory_bound"]["median"] / 1e9
        ax.axhline(bound, color="black", linestyle="--",
                   label=f"memcpy, memory-bound: {bound:.1f}")
        ax.axhline(bound / 2, color="black", linestyle=":", label="target: 0.5x memcpy")
        resident = memcpy["cache_resident"]["median"] / 1e9
        ax.set_title(f"{title}\n(cache-resident memcpy, {memcpy['cache_resident_nbytes'] >> 20} MiB: "
                     f"{resident:.1f} GB/s, off the chart)" if resident > 2 * bound else title)
        if resident <= 2 * bound:
            ax.axhline(resident, color="gray", linestyle="-.", label=f"memcpy, cache-resident: {resident:.1f}")
    else:
        ax.set_title(title)
    ax.set_xticks(x, [c["backend"] for c in big])
    ax.set_ylabel("GB/s")
    ax.set_ylim(0, ax.get_ylim()[1] * 1.5)  # room for the legend
    ax.legend(fontsize="small", loc="upper left", ncol=2)


def small_panel(ax: Any, cases: list[dict] | None) -> None:
    """Samples/s of cached epochs of small samples per backend (log scale)."""
    title = "Cached epoch, small samples (16 float32 + label): samples/s"
    small = [c for c in cases or [] if c["sample_bytes"] <= 1024]
    if not small:
        return _empty(ax, title)
    x = np.arange(len(small))
    for offset, key, color, label in ((-0.27, "ours_samples_per_s", OURS, "CachedLoader"),
                                      (0.0, "gather_samples_per_s", GATHER, "store gather (no loader)"),
                                      (0.27, "torch_samples_per_s", TORCH, "torch DataLoader")):
        _bars(ax, x + offset, 0.27, [c[key]["median"] for c in small], [c[key]["min"] for c in small],
              [c[key]["max"] for c in small], color=color, label=label)
    ax.set_yscale("log")
    ax.set_ylim(top=ax.get_ylim()[1] * 100)  # room for the legend
    ax.set_xticks(x, [f"{c['backend']}\n{c['ratio']['median']:.1f}x torch" for c in small])
    ax.set_ylabel("samples/s (log scale)")
    ax.set_title(title)
    ax.legend(fontsize="small", loc="upper center", ncol=2)


def wait_panel(ax: Any, ts: dict | None) -> None:
    """Share of each epoch the training loop waited on data: ours with and without background refresh, torch."""
    title = "Simulated training step: share of the epoch spent waiting for data"
    if not ts:
        return _empty(ax, title)
    x = np.arange(ts["epochs"])
    for offset, key, color, label in ((-0.27, "refresh", OURS, "CachedLoader, background_refresh"),
                                      (0.0, "ours", GATHER, "CachedLoader, default"),
                                      (0.27, "torch", TORCH, "torch DataLoader")):
        f = ts[key]["wait_fraction"]
        _bars(ax, x + offset, 0.27, [100 * s["median"] for s in f], [100 * s["min"] for s in f],
              [100 * s["max"] for s in f], color=color, label=label)
    ax.axhline(5, color="black", linestyle=":", label="target: <= 5% after the first epoch")
    modes = ts["ours"]["modes"]
    ax.set_xticks(x, [f"{e}\n{'gen' if m == 'generate' else m}" for e, m in enumerate(modes)])
    ax.set_xlabel("epoch (mode of the default CachedLoader)")
    ax.set_ylabel("% of the epoch waiting")
    ax.set_ylim(0, 135)  # room for the legend
    ax.set_yticks(range(0, 101, 20))
    ax.set_title(f"{title}\n{ts['step_ms']:g} ms step per batch, {ts['n']} samples x {ts['cost_ms']:g} ms, "
                 f"K={ts['update_frequency']}")
    ax.legend(fontsize="small", loc="upper center", ncol=2)
