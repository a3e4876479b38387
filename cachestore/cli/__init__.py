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
it shows is what a program would see: this module parses the command line and
runs it, :mod:`.describe` gathers what ``inspect`` shows, :mod:`.render` prints it.
A store is untrusted input (docs/ARCHITECTURE.md, "Untrusted stores"): a malformed
file is an error naming it, never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from pathlib import Path
from typing import Sequence

from . import remote
from .. import __version__
from ..backends.directory import META_NAME
from ..errors import CacheStoreError, NotAStoreError
from ..guard.locking import lock_holder
from ..pruning import Removed
from ..space.disk import format_size, parse_size, remove_paths
from ..space.scratch import dead_windows, list_windows, pid_alive
from ..store import Store, open_local
from .describe import Doc, describe_store, describe_window, served_epochs
from .render import problems, prune_table, render_store, window_table

EXIT_OK, EXIT_PROBLEMS, EXIT_USAGE = 0, 1, 2

__all__ = ["Doc", "EXIT_OK", "EXIT_PROBLEMS", "EXIT_USAGE", "describe_store", "find_stores", "main", "served_epochs"]


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``cachestore`` command line; return its exit status."""
    parser = _parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:  # --help, or a usage error argparse already printed
        return exc.code if isinstance(exc.code, int) else EXIT_USAGE
    if remote.handles(args):  # push, pull, or a remote URL (s3://, file://): cachestore/cli/remote.py
        return remote.run(args)
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
    _trust_option(inspect)
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
    _trust_option(prune)
    prune.set_defaults(run=_prune)
    remote.add_commands(commands)
    return parser


def _trust_option(command: argparse.ArgumentParser) -> None:
    command.add_argument("--trusted-uid", type=_non_negative_int, action="append", dest="trusted_uids",
                         metavar="UID", help="also read generations of this user (repeatable; see the README's "
                                             "Security): another user's are damage otherwise")


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


def _natural_key(name: str) -> tuple[tuple[int, int | str], ...]:
    # ASCII digits only (int() of a part "²" that isdigit() takes is a ValueError); (kind, part)
    # pairs so that numbers and text never meet in a comparison.
    return tuple((0, int(part)) if part.isascii() and part.isdigit() else (1, part)
                 for part in re.split(r"([0-9]+)", name))


# inspect ---------------------------------------------------------------------

def _inspect(args: argparse.Namespace, roots: list[str], is_parent: bool) -> int:
    status, stores = EXIT_OK, []
    for root in roots:
        try:
            stores.append(describe_store(root, verify=args.verify, trusted_uids=args.trusted_uids))
        except (CacheStoreError, OSError, ValueError) as exc:
            _error(f"cannot read store {root}: {exc}")
            status = EXIT_PROBLEMS
    parent_windows = [describe_window(*w) for w in list_windows(args.path)] if is_parent else []
    if args.json:
        print(json.dumps({"path": args.path, "stores": stores, "rotation_windows": parent_windows},
                         indent=2, default=str))
    else:
        if is_parent and roots:
            print(f"{args.path}: {len(roots)} stores\n")
        print("\n\n".join("\n".join(render_store(doc)) for doc in stores))
        if parent_windows:
            print(f"\nrotation windows in {args.path}")
            print("\n".join(window_table(parent_windows, args.path)))
    found = [bad for doc in stores for bad in doc["corrupt"] or ()]
    if found:
        _error(f"{problems(found)} in {args.path}")
        status = EXIT_PROBLEMS
    return status


# prune -----------------------------------------------------------------------

def _prune(args: argparse.Namespace, roots: list[str], is_parent: bool) -> int:
    status, freed = EXIT_OK, 0
    would = "would remove" if args.dry_run else "removed"
    for n, root in enumerate(roots):
        try:
            with open_local(root, trusted_uids=args.trusted_uids) as store:
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
        print("\n".join(prune_table(root, would, removed, kept)))
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
            print("\n".join(prune_table(args.path, would, removed, [])))
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


