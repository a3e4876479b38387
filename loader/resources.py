"""What a loader owns and must release, and how its workers are configured.

Kept apart from the loader on purpose: the ``weakref.finalize`` that releases
:class:`Resources` must not reference the loader, or the loader could never
be garbage-collected (see the shutdown note in :mod:`loader.pool`).
"""

from __future__ import annotations

from typing import Any, Callable

from cachestore import Store

from .messages import WorkerConfig
from .pool import WorkerPool
from .shm import SlotPool


class ConfigFactory:
    """Builds each worker incarnation's config (a fresh shard id every time)."""

    def __init__(self, dataset_class: type, params: dict, collate_fn: Callable | None,
                 gpu_indices: list[int] | None, allow_pickle: bool) -> None:
        self.args = (dataset_class, params, collate_fn, gpu_indices, allow_pickle)
        self.incarnations = 0

    def __call__(self, wid: int) -> WorkerConfig:
        dataset_class, params, collate_fn, gpu_indices, allow_pickle = self.args
        self.incarnations += 1
        return WorkerConfig(worker_id=wid, shard_id=f"w{wid}-i{self.incarnations}", dataset_class=dataset_class,
                            dataset_params=params, collate_fn=collate_fn,
                            gpu_index=gpu_indices[wid] if gpu_indices else None, allow_pickle=allow_pickle)


class Resources:
    """Everything that must be released: the shutdown path shared by close(), GC and exit."""

    def __init__(self) -> None:
        self.pool: WorkerPool | None = None
        self.slots: SlotPool | None = None
        self.writer: Any = None  # the generation written by the current epoch
        self.background: Any = None  # the generation a background refresh writes
        self.store: Store | None = None
        self.window: Any = None

    def discard_dead_shard(self, dead: Any) -> None:
        """A worker died: forget what it wrote for batches that were never delivered."""
        writer = self.writer or self.background
        if writer is not None and writer.state == "open":
            writer.discard_shard_tail(dead.shard_id, dead.written)

    def release(self) -> None:
        """Release everything (see the shutdown note in :mod:`loader.pool`)."""
        # Order: stop the writers (workers) before removing what they write into.
        pool, self.pool = self.pool, None
        if pool is not None:
            pool.shutdown()
        for name in ("writer", "background"):
            writer = getattr(self, name)
            setattr(self, name, None)
            if writer is not None:
                writer.abort()
        slots, self.slots = self.slots, None
        if slots is not None:
            slots.close()
        window, self.window = self.window, None
        if window is not None:
            window.close()
        store, self.store = self.store, None
        if store is not None:
            store.close()
