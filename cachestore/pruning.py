"""Removing what a store no longer needs: old generations, damaged ones, and crash debris.

:meth:`cachestore.Store.prune` is the entry point (its docstring says what goes); the writer lock
keeps a prune from removing a staging area a writer is about to use.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from .backends.base import Backend, GenerationInfo, ProducerRecord
from .errors import StoreLockedError
from .guard.locking import LOCK_NAME, WriterLock, lock_holder
from .space.disk import allocated_bytes, parse_size
from .space.scratch import is_window_name


class Prunable(Protocol):
    """What a prune needs of a store (:class:`cachestore.Store` is one)."""

    path: str
    backend: Backend

    @property
    def writing(self) -> bool:
        """Whether this process holds the store's writer lease now."""

    def partial_record(self) -> ProducerRecord | None:
        """What the partial generations of this store's producer have in common."""

    def generations(self) -> list[GenerationInfo]:
        """The store's generations, oldest first."""


@dataclass(frozen=True)
class Removed:
    """One thing :meth:`Store.prune` removed (or would remove with ``dry_run``)."""

    kind: str  # "generation", "damaged" (generation), "staging", "temp", "rotation", "lock"
    path: str
    nbytes: int
    generation: int | None = None


def prune_store(store: Prunable, keep: int, dry_run: bool, max_bytes: int | str | None,
                partial: bool) -> list[Removed]:
    """What :meth:`cachestore.Store.prune` does (see there)."""
    if isinstance(keep, bool) or not isinstance(keep, int) or keep < 0:
        raise ValueError(f"keep must be a non-negative int, got {keep!r}")
    max_bytes = parse_size(max_bytes)
    persistent = store.backend.persistent
    lock_file = Path(store.path) / LOCK_NAME
    had_lock = persistent and os.path.lexists(lock_file)  # looked at before our guard creates one
    lock_bytes = allocated_bytes(lock_file) if had_lock else 0
    guard: WriterLock | None = None
    mine = None if partial else store.partial_record()
    if store.writing:
        holder: int | None = os.getpid()
    elif persistent and not dry_run:
        guard, holder = _prune_guard(store)
    else:
        holder = lock_holder(store.path) if persistent else None
    try:
        # Under `guard` no writer can start, so no staging area listed here can become live
        # before it is removed (without it a writer starting mid-prune lost its staging).
        if holder is not None and holder < 0:
            found = []  # a live writer whose pid is not written yet: whose staging is whose is unknown
        elif dry_run:
            found = store.backend.debris(keep_pid=holder, keep_record=mine)
        else:
            found = store.backend.remove_debris(keep_pid=holder, keep_record=mine)
        # Only without a live writer (or as it): one may be replacing a damaged generation right now.
        damaged = [g for g in store.generations() if g.damaged] if holder in (None, os.getpid()) else []
        if not dry_run:
            for g in damaged:
                store.backend.remove_generation(g.id)
    finally:
        if guard is not None:
            guard.release()  # unlinks writer.lock: a stale one goes with it
    removed = [Removed(_debris_kind(path), path, nbytes) for path, nbytes in found]
    removed += [Removed("damaged", g.path or "", g.nbytes, g.id) for g in damaged]
    committed = [g for g in store.generations() if g.committed]
    doomed = committed[:max(0, len(committed) - keep)]
    kept = committed[len(doomed):]
    if max_bytes is not None:
        total = sum(g.nbytes for g in kept)
        while kept and total > max_bytes:
            total -= kept[0].nbytes
            doomed.append(kept.pop(0))
    removed += [Removed("generation", g.path or f"memory:{g.id}", g.nbytes, g.id) for g in doomed]
    if had_lock and holder is None:  # a lock file nobody held: a dead writer's
        removed.append(Removed("lock", str(lock_file), lock_bytes))
    if not dry_run:
        for g in doomed:
            store.backend.remove_generation(g.id)
    return removed


def _prune_guard(store: Prunable) -> tuple[WriterLock | None, int | None]:
    """Take the writer lock for a prune: ``(lock, None)``, or ``(None, pid)`` of the live writer."""
    for _ in range(100):
        lock = WriterLock(store.path, brief=True)
        try:
            lock.acquire()
            return lock, None
        except StoreLockedError:
            holder = lock_holder(store.path)
            if holder is not None:
                return None, holder
    raise StoreLockedError(f"store {store.path} is busy: writers keep starting; prune later")  # pragma: no cover


def _debris_kind(path: str) -> str:
    name = os.path.basename(path)
    return "temp" if name.endswith(".tmp") else "rotation" if is_window_name(name) else "staging"
