"""The ``cachestore`` command: look into stores and clean them up.

::

    cachestore inspect PATH [--json] [--verify]
    cachestore prune PATH [--keep N] [--max-bytes SIZE] [--dry-run] [--partial]

PATH is what the loader got as ``prefix``: a store (a directory with
``store.json``), or a directory whose subdirectories are stores (a loader
with several consumers keeps one store per consumer there); then every one of
them is inspected or pruned.

Exit status: 0 ok; 1 problems found (corrupt samples, a store that cannot be
read, something that could not be removed); 2 usage error or PATH is not a
store. Results go to stdout, errors to stderr.

Every command is a thin layer over the library (:func:`cachestore.open_store`,
:meth:`Store.generations`, :meth:`Store.verify`, :meth:`Store.prune`), so what
it shows is what a program would see.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Any, Sequence, TypeAlias

from . import __version__, cli_remote, safefs
from .backends.base import GenerationInfo
from .backends.directory import META_NAME
from .disk import format_size, parse_size, remove_paths
from .errors import CacheStoreError, NotAStoreError
from .locking import LOCK_NAME, SHARED_WRITERS, lock_holder
from .scratch import dead_windows, list_windows, pid_alive
from .pruning import Removed
from .store import Store, open_store

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

#: A JSON document of ``inspect`` or ``prune`` (what ``--json`` prints).
Doc: TypeAlias = dict[str, Any]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cachestore`` command line; return its exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if cli_remote.handles(args):  # push, pull, or a remote URL (s3://, file://): cachestore/cli_remote.py
        return cli_remote.run(args)
    try:
        roots, is_parent = find_stores(args.path)
    except NotAStoreError as exc:
        _error(str(exc))
        return EXIT_USAGE
    try:
        status: int = args.run(args, roots, is_parent)
        return status
    except BrokenPipeError:  # `cachestore inspect ... | head`: the reader left, which is fine
        # Point stdout at /dev/null so the interpreter's final flush does not fail again.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_OK


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="cachestore", description="Inspect and prune cachestore stores (a loader's cache prefix).",
        epilog="exit status: 0 ok, 1 problems found, 2 usage error or PATH is not a store")
    parser.add_argument("--version", action="version", version=f"cachestore {__version__}")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    inspect = commands.add_parser(
        "inspect", help="show generations, staging areas, rotation windows and stale locks",
        description="Show what a store holds: backend, fingerprint and producer, generations (committed or "
                    "staging), rotation windows and stale locks. Never writes anything.")
    inspect.add_argument("path", metavar="PATH", help="the store (the loader's prefix)")
    inspect.add_argument("--json", action="store_true", help="print one JSON document instead of tables")
    inspect.add_argument("--verify", action="store_true",
                         help="check every checksum; exit 1 naming each bad sample")
    inspect.set_defaults(run=_inspect)

    prune = commands.add_parser(
        "prune", help="remove old generations, crash debris, dead rotation windows and stale locks",
        description="Remove committed generations beyond the newest N, staging areas left by crashed writers, "
                    "rotation windows of dead processes and stale locks. What a live writer holds is kept.")
    prune.add_argument("path", metavar="PATH", help="the store (the loader's prefix)")
    prune.add_argument("--keep", type=_non_negative_int, default=1, metavar="N",
                       help="newest committed generations to keep (default: 1)")
    prune.add_argument("--max-bytes", type=_size, default=None, metavar="SIZE",
                       help="then remove the oldest generations until the store fits, e.g. 20GB or 512MiB")
    prune.add_argument("--dry-run", action="store_true", help="only show what would be removed")
    prune.add_argument("--partial", action="store_true",
                       help="also remove partial generations of this store's dataset (kept by an interrupted "
                            "run for the next one to complete); those of another dataset always go")
    prune.set_defaults(run=_prune)
    cli_remote.add_commands(commands)
    return parser


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"expected a non-negative integer, got {text!r}")
    return value


def _size(text: str) -> int:
    try:
        return parse_size(text)  # type: ignore[return-value]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _error(message: str) -> None:
    print(f"cachestore: error: {message}", file=sys.stderr)


def find_stores(path: str) -> tuple[list[str], bool]:
    """The stores at `path`: ``([path], False)``, or ``(subdirectory stores, True)`` for a parent
    (``([], True)`` for a rotation prefix that holds only ``rotation-*`` windows).

    Raises
    ------
    NotAStoreError
        `path` holds no ``store.json``, and neither does any of its subdirectories.
    """
    root = Path(path)
    if (root / META_NAME).is_file():
        return [path], False
    if not root.exists():
        raise NotAStoreError(f"{path} does not exist; give the path the loader got as prefix")
    if root.is_dir():
        # Symlinked subdirectories are not followed: prune must not reach outside PATH.
        subs = [e for e in root.iterdir() if e.is_dir() and not e.is_symlink() and (e / META_NAME).is_file()]
        if subs:
            return [str(e) for e in sorted(subs, key=lambda e: _natural_key(e.name))], True
        if list_windows(root):  # a rotation_setting prefix: windows only, no store
            return [], True
    raise NotAStoreError(f"{path} is not a cachestore store: no {META_NAME} in it or in its subdirectories; "
                         "give the path the loader got as prefix")


def _natural_key(name: str) -> list[int | str]:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name)]


# inspect ---------------------------------------------------------------------

def describe_store(path: str, verify: bool = False) -> Doc:
    """Everything ``inspect`` shows about the store at `path`, as JSON-ready data (read-only)."""
    with open_store(path, readonly=True, verify=True) as store:
        holder = lock_holder(path) if store.backend.persistent else None
        meta = store.meta
        lock_file = Path(path) / LOCK_NAME
        stale_lock = None
        if holder is None and os.path.lexists(lock_file):
            pid = _recorded_pid(lock_file)
            stale_lock = {"path": str(lock_file), "pid": pid, "pid_alive": pid is not None and pid_alive(pid)}
        # A partial generation of this store's producer is not debris: the next run completes it.
        debris = [] if holder is not None and holder < 0 else store.backend.debris(
            keep_pid=holder, keep_record=store.partial_record())
        doc: dict[str, Any] = {
            "path": path, "backend": store.backend_name, "format": meta.get("format"),
            "compression": meta.get("compression"), "created": meta.get("created"),
            "fingerprint": meta.get("fingerprint"), "producer": meta.get("producer"),
            # Processes writing together have no one pid: null, and shared_writers says they write.
            "bytes": store.usage(), "writer_pid": None if holder == SHARED_WRITERS else holder,
            "shared_writers": holder == SHARED_WRITERS,
            "generations": [_describe_generation(g, holder) for g in store.generations()],
            "rotation_windows": [_describe_window(*w) for w in list_windows(path)],
            "stale_lock": stale_lock,
            "debris": [{"path": p, "bytes": n} for p, n in debris],
            "corrupt": None,
        }
        if verify:
            doc["corrupt"] = [{"generation": exc.generation, "index": exc.index, "message": str(exc)}
                              for exc in store.verify()]
    return doc


def _describe_generation(g: GenerationInfo, holder: int | None) -> Doc:
    doc = {"id": g.id, "state": "committed" if g.committed else "damaged" if g.damaged else "staging",
           "damaged": g.damaged,
           "epochs": g.extra.get("epochs") if g.committed else None,
           "serves_epochs": served_epochs(g.extra) if g.committed else None,
           "num_samples": g.num_samples if g.committed else None, "bytes": g.nbytes,
           "raw_bytes": g.raw_bytes, "stored_bytes": g.stored_bytes, "compression_ratio": g.compression_ratio,
           "layout": g.layout, "created": g.created, "path": g.path,
           "owner_pid": None, "owner_alive": None, "writing": False,
           "shared": bool(g.extra.get("shared")), "members": bool(g.extra.get("members"))}
    if not g.committed and g.owner_pid:
        doc.update(owner_pid=g.owner_pid, owner_alive=pid_alive(g.owner_pid), writing=g.owner_pid == holder)
    return doc


def _describe_window(path: str, nbytes: int, pid: int | None) -> Doc:
    return {"path": path, "bytes": nbytes, "owner_pid": pid, "owner_alive": None if pid is None else pid_alive(pid)}


def _recorded_pid(lock_file: Path) -> int | None:
    try:
        return int((safefs.read_bytes(lock_file).decode().split() or ["0"])[0]) or None
    except (OSError, ValueError):
        return None


def _inspect(args: argparse.Namespace, roots: list[str], is_parent: bool) -> int:
    status, stores = EXIT_OK, []
    for root in roots:
        try:
            stores.append(describe_store(root, verify=args.verify))
        except (CacheStoreError, OSError, ValueError) as exc:
            _error(f"cannot read store {root}: {exc}")
            status = EXIT_PROBLEMS
    parent_windows = [_describe_window(*w) for w in list_windows(args.path)] if is_parent else []
    if args.json:
        print(json.dumps({"path": args.path, "stores": stores, "rotation_windows": parent_windows},
                         indent=2, default=str))
    else:
        if is_parent and roots:
            print(f"{args.path}: {len(roots)} stores\n")
        print("\n\n".join("\n".join(_render_store(doc)) for doc in stores))
        if parent_windows:
            print(f"\nrotation windows in {args.path}")
            print("\n".join(_window_table(parent_windows, args.path)))
    found = [bad for doc in stores for bad in doc["corrupt"] or ()]
    if found:
        _error(f"{_problems(found)} in {args.path}")
        status = EXIT_PROBLEMS
    return status


def _problems(found: list[Doc]) -> str:
    """``"1 damaged generation and 2 corrupt samples"``: what ``--verify`` found."""
    whole = sum(bad["index"] is None for bad in found)
    samples = len(found) - whole
    parts = [f"{whole} damaged generation{'s' * (whole != 1)}"] if whole else []
    parts += [f"{samples} corrupt sample{'s' * (samples != 1)}"] if samples else []
    return " and ".join(parts)


def _render_store(doc: Doc) -> list[str]:
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
        lines += ["  " + line for line in _table(headers, rows, right={0, 3, 4, 5})]
        lines += [f"  damaged: generation {g['id']}: {g['damaged']}; `cachestore prune` removes it"
                  for g in doc["generations"] if g["damaged"]]
    else:
        lines.append("  no generations yet")
    lines.append("")
    if doc["rotation_windows"]:
        lines.append("  rotation windows")
        lines += ["  " + line for line in _window_table(doc["rotation_windows"], path)]
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
            lines.append(f"  verify: {_problems(doc['corrupt'])}")
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


def served_epochs(extra: dict[str, object]) -> list[int | None] | None:
    """``[first, last]`` epochs a generation serves (``last`` ``None``: every later epoch), from its commit's
    ``extra``; ``None`` when the commit did not record them.

    The loader records the epoch that wrote the generation and ``update_frequency`` K
    (``None`` for "never refresh"): with K, generation ``e // K`` serves epochs
    ``[(e // K) * K, (e // K) * K + K)``, whichever of them wrote it.
    """
    epochs = extra.get("epochs")
    if not (isinstance(epochs, list) and epochs and all(type(e) is int for e in epochs)):
        return None
    if "update_frequency" not in extra:  # recorded by hand: what was recorded, if it is a range
        return [min(epochs), max(epochs)] if sorted(epochs) == list(range(min(epochs), max(epochs) + 1)) else None
    k = extra["update_frequency"]
    if isinstance(k, (int, float)) and not isinstance(k, bool) and 1 <= k < float("inf"):
        first = epochs[0] // int(k) * int(k)
        return [first, max(first + int(k) - 1, max(epochs))]
    return [epochs[0], None]


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


def _window_table(windows: list[Doc], root: str) -> list[str]:
    rows = []
    for w in windows:
        pid = w["owner_pid"]
        owner = "unknown" if pid is None else f"pid {pid} ({'alive' if w['owner_alive'] else 'dead'})"
        rows.append([os.path.relpath(w["path"], root), format_size(w["bytes"]), owner])
    return _table(["NAME", "SIZE", "OWNER"], rows, right={1})


def _when(timestamp: float | None) -> str:
    return "-" if timestamp is None else time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(timestamp))


def _table(headers: list[str], rows: list[list[str]], right: set[int] = frozenset()) -> list[str]:  # type: ignore[assignment]
    widths = [max(len(row[i]) for row in [headers, *rows]) for i in range(len(headers))]
    return ["  ".join(cell.rjust(w) if i in right else cell.ljust(w)
                      for i, (cell, w) in enumerate(zip(row, widths))).rstrip()
            for row in [headers, *rows]]


# prune -----------------------------------------------------------------------

def _prune(args: argparse.Namespace, roots: list[str], is_parent: bool) -> int:
    status, freed = EXIT_OK, 0
    would = "would remove" if args.dry_run else "removed"
    for n, root in enumerate(roots):
        try:
            with open_store(root) as store:
                removed = store.prune(keep=args.keep, dry_run=args.dry_run, max_bytes=args.max_bytes,
                                      partial=args.partial)
                kept = _kept(store, {r.path for r in removed})
        except (CacheStoreError, OSError, ValueError) as exc:
            _error(f"cannot prune store {root}: {exc}")
            status = EXIT_PROBLEMS
            continue
        failed = [] if args.dry_run else _still_there(removed)
        for r in failed:
            _error(f"could not remove {r.path}")
        status = EXIT_PROBLEMS if failed else status
        freed += sum(r.nbytes for r in removed if r not in failed)
        print(("\n" if n else "") + root)
        print("\n".join(_prune_table(root, would, removed, kept)))
    if is_parent:  # rotation windows may also sit next to the consumer stores
        found = dead_windows(args.path)
        if not args.dry_run:
            remove_paths([p for p, _ in found])
        removed = [Removed("rotation", p, nbytes) for p, nbytes in found]
        failed = [] if args.dry_run else _still_there(removed)
        for r in failed:
            _error(f"could not remove {r.path}")
        status = EXIT_PROBLEMS if failed else status
        freed += sum(r.nbytes for r in removed if r not in failed)
        if removed:
            print(f"\n{args.path}")
            print("\n".join(_prune_table(args.path, would, removed, [])))
    verb = "would free" if args.dry_run else "freed"
    print(f"\n{verb} {format_size(freed)}" + (" (dry run: nothing was removed)" if args.dry_run else ""))
    return status


def _kept(store: Store, removed: set[str]) -> list[tuple[str, str, int, str]]:
    """``(kind, path, bytes, why)`` of what prune left on purpose: a live process's staging area or
    rotation window, and partial generations of this store's dataset (the next run completes them)."""
    holder = lock_holder(store.path)
    kept = []
    for g in store.generations():
        if g.committed or g.damaged or not g.path or g.path in removed:
            continue
        if g.owner_pid and g.owner_pid == holder:
            kept.append(("staging", g.path, g.nbytes, f"live writer pid {g.owner_pid} holds it"))
        elif g.extra.get("shared") and g.extra.get("members"):
            kept.append(("staging", g.path, g.nbytes, "processes writing it together hold it"))
        else:
            kept.append(("partial", g.path, g.nbytes, "partial generation of this dataset: the next run "
                                                      "completes it (--partial removes it)"))
    kept += [("rotation", path, nbytes, f"pid {pid} is alive")
             for path, nbytes, pid in list_windows(store.path) if pid is not None and pid_alive(pid)]
    return kept


def _still_there(removed: list[Removed]) -> list[Removed]:
    # The lock file is left out: a writer that started right after the prune recreates it.
    return [r for r in removed if r.kind != "lock" and os.path.lexists(r.path)]


def _prune_table(root: str, would: str, removed: list[Removed], kept: list[tuple[str, str, int, str]]) -> list[str]:
    if not removed and not kept:
        return ["  nothing to remove"]
    rows = [[would, r.kind, os.path.relpath(r.path, root), format_size(r.nbytes), ""] for r in removed]
    rows += [["kept", kind, os.path.relpath(path, root), format_size(nbytes), why] for kind, path, nbytes, why in kept]
    return ["  " + line for line in _table(["ACTION", "KIND", "NAME", "SIZE", "NOTE"], rows, right={3})]
