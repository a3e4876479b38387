"""The figures of a report: a target row, a value with its range, a Markdown table.

Shared by :mod:`benchmarks.targets`, :mod:`benchmarks.report` and the scenarios that report their
own rows and sections (sweep, torchrun, first epoch, larger than memory).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Callable

MIB = 1 << 20

Figure = float | dict  # a single number, or a summary (median, min, max, ...) of repetitions


@dataclass(frozen=True)
class TargetRow:
    """One line of the targets table."""

    target: str  # what docs/ARCHITECTURE.md asks, in short
    case: str  # which measurement (backend, epoch, ...)
    measured: str  # the figures behind the value
    value: str  # the figure the goal is about, formatted ("3.4x (3.1-3.6)", "2.1%", "0.27 s")
    number: float  # its median, as a number (for the JSON)
    goal: str  # e.g. ">= 2x"
    met: bool  # whether the median meets the goal
    note: str = ""

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def pm(summary: dict, scale: float = 1.0, fmt: str = "{:.2f}") -> str:
    """``median ± spread`` of a :func:`~benchmarks.common.summarize` dict, scaled."""
    return f"{fmt.format(summary['median'] * scale)} ± {fmt.format(summary['spread'] * scale)}"


def value(fmt: str, unit: str, figure: Figure, scale: float = 1.0) -> tuple[str, float]:
    """``(text, median)``: a summary shows its min-max range after the median, e.g. ``3.40x (3.10-3.62)``."""
    if not isinstance(figure, dict):
        return f"{fmt.format(figure * scale)}{unit}", figure
    text = f"{fmt.format(figure['median'] * scale)}{unit}"
    if figure["n"] > 1:
        text += f" ({fmt.format(figure['min'] * scale)}–{fmt.format(figure['max'] * scale)})"
    return text, figure["median"]


def times(figure: Figure) -> tuple[str, float]:
    """A ratio, e.g. ``1.05x (0.99-1.11)``."""
    return value("{:.2f}", "x", figure)


def percent(figure: Figure) -> tuple[str, float]:
    """A fraction as a percentage."""
    return value("{:.1f}", "%", figure, 100)


def seconds(figure: Figure) -> tuple[str, float]:
    """A duration in seconds."""
    return value("{:.2f}", " s", figure)


def row(target: str, case: str, measured: str, shown: tuple[str, float], goal: str,
        ok: Callable[[float], bool], note: str = "") -> TargetRow:
    """A :class:`TargetRow`; `shown` is ``(text, median)`` as :func:`value` gives it."""
    text, number = shown
    return TargetRow(target, case, measured, text, number, goal, bool(ok(number)), note)


def md_table(headers: list[str], rows: list[list[Any]], align: str | None = None) -> str:
    """A Markdown table; `align` has one letter per column (``l`` or ``r``, default: first left, rest right)."""
    align = align or "l" + "r" * (len(headers) - 1)
    rule = ["---:" if a == "r" else ":---" for a in align]
    lines = ["| " + " | ".join(headers) + " |", "| " + " | ".join(rule) + " |"]
    lines += ["| " + " | ".join(str(c).replace("|", "\\|") for c in row) + " |" for row in rows]
    return "\n".join(lines)


