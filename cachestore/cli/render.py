"""The text ``cachestore inspect`` and ``prune`` print: a store's fields, its generations and
rotation windows as tables, and what ``--verify`` found (``--json`` prints the data itself,
:mod:`.describe`)."""

from __future__ import annotations

import json
import os
import time
from typing import Any

from ..guard.locking import LOCK_NAME
from ..pruning import Removed
from ..space.disk import format_size
from .describe import Doc


def problems(found: list[Doc]) -> str:
    """``"1 damaged generation and 2 corrupt samples"``: what ``--verify`` found."""
    whole = sum(bad["index"] is None for bad in found)
    samples = len(found) - whole
    parts = [f"{whole} damaged generation{'s' * (whole != 1)}"] if whole else []
    parts += [f"{samples} corrupt sample{'s' * (samples != 1)}"] if samples else []
    return " and ".join(parts)


def render_store(doc: Doc) -> list[str]:
    path = doc["path"]
    lines = [path]
    fields: list[tuple[str, str]] = [
        ("backend", f"{doc['backend']} (format {doc['format']}, compression {doc['compression'] or 'none'})")]
    fields += _dict_fields("producer", doc["producer"])
    fields += _dict_fields("fingerprint", doc["fingerprint"])
    fields += [("created", _when(doc["created"])), ("on disk", format_size(doc["bytes"]))]
    holder = doc["writer_pid"]
    fields.append(("writer", "processes writing together" if doc["shared_writers"] else "none" if holder is None
                   else f"pid {holder} is writing" if holder > 0 else "a live process is writing"))
    lock = doc["stale_lock"]
    if lock is not None:
        who = f"pid {lock['pid']} ({'alive' if lock['pid_alive'] else 'dead'})" if lock["pid"] else "unknown pid"
        fields.append(("stale lock", f"{LOCK_NAME}, left by {who}, not held"))
    if doc["debris"]:
        nbytes = sum(d["bytes"] for d in doc["debris"])
        count = len(doc["debris"])
        fields.append(("debris", f"{count} {'entry' if count == 1 else 'entries'} left by dead processes, "
                                 f"{format_size(nbytes)}: `cachestore prune` removes them"))
    width = max(len(name) for name, _ in fields)
    lines += [f"  {name.ljust(width)}  {value}" for name, value in fields]

    lines.append("")
    if doc["generations"]:
        rows = [_generation_row(g) for g in doc["generations"]]
        headers = ["GEN", "STATE", "EPOCHS", "SAMPLES", "SIZE", "RATIO", "CREATED", "OWNER"]
        lines += ["  " + line for line in table(headers, rows, right={0, 3, 4, 5})]
        lines += [f"  damaged: generation {g['id']}: {g['damaged']}; `cachestore prune` removes it"
                  for g in doc["generations"] if g["damaged"]]
    else:
        lines.append("  no generations yet")
    lines.append("")
    if doc["rotation_windows"]:
        lines.append("  rotation windows")
        lines += ["  " + line for line in window_table(doc["rotation_windows"], path)]
    else:
        lines.append("  rotation windows: none")

    if doc["corrupt"] is not None:
        lines.append("")
        committed = [g for g in doc["generations"] if g["state"] == "committed"]
        if not doc["corrupt"]:
            samples = sum(g["num_samples"] for g in committed)
            gens = f"{len(committed)} generation{'s' * (len(committed) != 1)}"
            lines.append(f"  verify: ok, {samples} samples in {gens} checked")
        else:
            lines.append(f"  verify: {problems(doc['corrupt'])}")
            for bad in doc["corrupt"]:
                where = "whole generation" if bad["index"] is None else f"sample {bad['index']}"
                # the message repeats sample, generation and path; keep only the reason when it does
                if bad["index"] is not None:
                    why = bad["message"].split(" is corrupt: ", 1)[-1]
                else:  # the damaged line above already says how to remove it
                    why = bad["message"].split(" is damaged: ", 1)[-1].split("; `cachestore prune", 1)[0]
                lines.append(f"    generation {bad['generation']}, {where}: {why}")
    return lines


def _dict_fields(label: str, value: Any) -> list[tuple[str, str]]:
    if not isinstance(value, dict) or not value:
        return [(label, "-" if value is None else json.dumps(value, default=str))]
    width = max(len(str(k)) for k in value)
    items = [f"{str(k) + ':':<{width + 1}} {v if isinstance(v, str) else json.dumps(v, default=str)}"
             for k, v in value.items()]
    return [(label, items[0])] + [("", item) for item in items[1:]]


def _generation_row(g: Doc) -> list[str]:
    ratio = g["compression_ratio"]
    if g["state"] in ("committed", "damaged"):
        owner = "-"
    elif g.get("shared"):
        owner = "shared (writers in)" if g.get("members") else "shared (partial)"
    elif g["owner_pid"] is None:
        owner = "- (being removed)"
    else:
        owner = f"pid {g['owner_pid']} ({'writing' if g['writing'] else 'alive' if g['owner_alive'] else 'dead'})"
    return [str(g["id"]), g["state"], _epochs(g["serves_epochs"], g["epochs"]),
            "-" if g["num_samples"] is None else str(g["num_samples"]), format_size(g["bytes"]),
            "-" if ratio is None or g["state"] != "committed" else f"{ratio:.2f}x", _when(g["created"]), owner]


def _epochs(served: list[int | None] | None, epochs: object) -> str:
    if served is not None:
        first, last = served
        return f"{first}-" if last is None else str(first) if last == first else f"{first}-{last}"
    if epochs is None:
        return "-"
    if isinstance(epochs, list) and epochs and all(isinstance(e, int) for e in epochs):
        if epochs == list(range(epochs[0], epochs[0] + len(epochs))):
            return str(epochs[0]) if len(epochs) == 1 else f"{epochs[0]}-{epochs[-1]}"
        return ",".join(map(str, epochs))
    return epochs if isinstance(epochs, str) else json.dumps(epochs)


def window_table(windows: list[Doc], root: str) -> list[str]:
    rows = []
    for w in windows:
        pid = w["owner_pid"]
        owner = "unknown" if pid is None else f"pid {pid} ({'alive' if w['owner_alive'] else 'dead'})"
        rows.append([os.path.relpath(w["path"], root), format_size(w["bytes"]), owner])
    return table(["NAME", "SIZE", "OWNER"], rows, right={1})


def _when(timestamp: float | None) -> str:
    if timestamp is None:
        return "-"
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))
    except (OverflowError, OSError, ValueError):  # a time no clock reaches (read from the store's files)
        return repr(timestamp)


def table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in [headers, *rows]]


def prune_table(root: str, would: str, removed: list[Removed], kept: list[tuple[str, str, int, str]]) -> list[str]:
    if not removed and not kept:
        return ["  nothing to remove"]
    rows = [[would, r.kind, os.path.relpath(r.path, root), format_size(r.nbytes), ""] for r in removed]
    rows += [["kept", kind, os.path.relpath(path, root), format_size(nbytes), why] for kind, path, nbytes, why in kept]
    return ["  " + line for line in table(["ACTION", "KIND", "NAME", "SIZE", "NOTE"], rows, right={3})]
