"""What ``cachestore inspect`` shows of a store, as JSON-ready data (what ``--json`` prints).

Read-only: a store is opened ``readonly=True`` and without ``allow_pickle``, so neither
listing nor ``--verify`` loads a pickled leaf (its checksum is checked, docs/ARCHITECTURE.md,
"Untrusted stores"). Every field comes through the library (:meth:`Store.generations`,
:meth:`Store.verify`), whose parsers have checked the store's files.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, TypeAlias

from ..backends.base import GenerationInfo
from ..guard import safefs, untrusted
from ..guard.locking import LOCK_NAME, SHARED_WRITERS, lock_holder
from ..space.scratch import list_windows, pid_alive
from ..store import open_local

#: A JSON document of ``inspect`` or ``prune`` (what ``--json`` prints).
Doc: TypeAlias = dict[str, Any]


def describe_store(path: str, verify: bool = False, trusted_uids: list[int] | None = None) -> Doc:
    """Everything ``inspect`` shows about the store at `path`, as JSON-ready data (read-only); generations of
    users other than this one and `trusted_uids` show as damaged."""
    with open_local(path, readonly=True, verify=True, trusted_uids=trusted_uids) as store:
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
            "generations": [describe_generation(g, holder) for g in store.generations()],
            "rotation_windows": [describe_window(*w) for w in list_windows(path)],
            "stale_lock": stale_lock,
            "debris": [{"path": p, "bytes": n} for p, n in debris],
            "corrupt": None,
        }
        if verify:
            doc["corrupt"] = [{"generation": exc.generation, "index": exc.index, "message": str(exc)}
                              for exc in store.verify()]
    return doc


def describe_generation(g: GenerationInfo, holder: int | None) -> Doc:
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


def describe_window(path: str, nbytes: int, pid: int | None) -> Doc:
    return {"path": path, "bytes": nbytes, "owner_pid": pid, "owner_alive": None if pid is None else pid_alive(pid)}


def _recorded_pid(lock_file: Path) -> int | None:
    try:
        with open(safefs.open_nofollow(lock_file, os.O_RDONLY | os.O_NONBLOCK), "rb") as f:
            head = f.read(64)  # a pid and a word: a lock file of gigabytes is not read whole
        return untrusted.decimal((head.decode("ascii").split() or ["0"])[0]) or None
    except (OSError, ValueError):
        return None



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
