"""Writing one generation: the owner's writer and the shard specs it hands out."""

from __future__ import annotations

import os
import weakref
from typing import TYPE_CHECKING, Any

from .backends.base import GenerationInfo, ShardWriter
from .errors import BudgetExceededError, CacheStoreError

if TYPE_CHECKING:
    from .store import Store


class ShardSpec:
    """A picklable ticket to write into a generation from another process.

    ``spec.open(shard_id)`` returns a :class:`~cachestore.backends.ShardWriter`;
    each process (or worker) uses its own `shard_id` and calls ``close()`` when
    done, before the owner commits.
    """

    def __init__(self, store_args: dict, token: Any, backend: Any = None) -> None:
        self.store_args = store_args
        self.token = token
        self._backend = backend  # only meaningful in the owning process

    def __getstate__(self) -> dict:
        return {"store_args": self.store_args, "token": self.token, "_backend": None}

    def open(self, shard_id: str) -> ShardWriter:
        """A shard writer for this process; `shard_id` must be unique per generation."""
        backend = self._backend
        if backend is None:
            from .store import _make_backend

            backend = _make_backend(**self.store_args)
        return backend.shard_writer(self.token, shard_id)


def _abandon(backend: Any, token: Any, lock: Any) -> None:
    """Finalizer of an uncommitted writer: drop its staging, release the lock."""
    try:
        backend.discard(token)
    finally:
        if lock is not None:
            lock.release()


class GenerationWriter:
    """Writes one generation; commits on clean exit of ``with``, discards on error.

    Obtained from :meth:`cachestore.Store.writer`. The owner holds the store's
    writer lock from creation to :meth:`commit` or :meth:`abort`.
    """

    def __init__(self, store: "Store", generation: int, num_samples: int | None) -> None:
        if isinstance(generation, bool) or not isinstance(generation, int) or generation < 0:
            raise ValueError(f"generation must be a non-negative int, got {generation!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(f"num_samples must be a non-negative int or None, got {num_samples!r}")
        self.store = store
        self.generation = generation
        self.num_samples = num_samples
        backend = store.backend
        lock = store._acquire_writer()
        try:
            backend.remove_debris()  # we hold the lock: any staging left is a dead writer's
            self.token = backend.begin(generation, store._budget(), num_samples)
        except BaseException:
            store._release_writer()
            raise
        self._finalizer = weakref.finalize(self, _abandon, backend, self.token, lock)
        self._shard: ShardWriter | None = None
        self.state = "open"

    def __enter__(self) -> "GenerationWriter":
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.state != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self.state != "open":
            raise CacheStoreError(f"this writer of generation {self.generation} is {self.state}")

    def put(self, index: int, sample: Any) -> None:
        """Store `sample` at `index` of this generation."""
        self._check_open()
        if self._shard is None:
            self._shard = self.store.backend.shard_writer(self.token, f"owner-{os.getpid()}")
        try:
            self._shard.put(index, sample)
        except BudgetExceededError:
            # The generation cannot be finished: drop its staging now (as the error says),
            # not when the caller gets round to abort() or the writer is collected.
            self.abort()
            raise

    def shard_spec(self) -> ShardSpec:
        """A picklable spec other processes use to write into this generation."""
        self._check_open()
        return ShardSpec(self.store._args(), self.token, self.store.backend)

    def discard_shard_tail(self, shard_id: str, keep: int) -> None:
        """Keep only the first `keep` samples a dead shard writer recorded."""
        self.store.backend.discard_shard_tail(self.token, shard_id, keep)

    def commit(self, extra: dict | None = None) -> GenerationInfo:
        """Publish the generation atomically; every index ``0..n-1`` must be present once."""
        self._check_open()
        try:
            if self._shard is not None:
                self._shard.close()
            info = self.store.backend.commit(self.token, self.num_samples, dict(extra or {}))
        except BaseException:
            self.abort()
            raise
        self.state = "committed"
        self._finalizer.detach()
        self.store._release_writer()
        return info

    def abort(self) -> None:
        """Discard everything written (idempotent)."""
        if self.state != "open":
            return
        self.state = "aborted"
        try:
            if self._shard is not None:
                self._shard.close()
        except Exception:  # the staging area goes anyway; a close error must not mask the cause
            pass
        self._finalizer.detach()
        try:
            self.store.backend.discard(self.token)
        finally:
            self.store._release_writer()
