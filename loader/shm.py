"""Shared-memory slots that carry batches from workers to the training process.

A slot is a file under ``/dev/shm`` named ``cachestore-<pid>-<hex>-<slot>-<k>``
(``pid``: the training process, ``k``: how many times the slot grew). Files
rather than ``multiprocessing.shared_memory`` so that the training process
alone owns their lifetime (no resource tracker, no double unlink), and so that
a sweep by name removes everything a crashed run left.

Slots are reused: a freshly mapped page costs micro-seconds to fault in, a new
buffer per batch would cost more than the copy. The training process hands a
batch out as numpy views of the slot; the slot returns to the free list when
the last view dies (a ``weakref.finalize`` on a per-batch ctypes exporter, the
one object every view keeps alive). A batch larger than its slot is written by
the worker into a new, larger segment, which then replaces the slot.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import logging
import mmap
import os
import secrets
import tempfile
import threading
import weakref
from typing import Any, Sequence

import numpy as np

from cachestore import codec
from cachestore.scratch import pid_alive

log = logging.getLogger(__name__)

ALIGN = 64
MIN_SLOT = 1 << 20
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()


def shm_dir() -> str:
    return _SHM_DIR


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def create_segment(name: str, size: int) -> tuple[mmap.mmap, int]:
    """Create and map a segment of `size` bytes (tmpfs pages are allocated on first touch)."""
    path = os.path.join(_SHM_DIR, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, size)
        return mmap.mmap(fd, size), size
    except BaseException:
        os.unlink(path)
        raise
    finally:
        os.close(fd)


def open_segment(name: str) -> mmap.mmap:
    path = os.path.join(_SHM_DIR, name)
    fd = os.open(path, os.O_RDWR)
    try:
        return mmap.mmap(fd, os.fstat(fd).st_size)
    finally:
        os.close(fd)


def unlink_segment(name: str) -> None:
    try:
        os.unlink(os.path.join(_SHM_DIR, name))
    except FileNotFoundError:
        pass


def sweep_dead_segments() -> list[str]:
    """Remove segments of training processes that no longer exist."""
    removed = []
    for path in glob.glob(os.path.join(_SHM_DIR, "cachestore-*")):
        parts = os.path.basename(path).split("-")
        if len(parts) > 2 and parts[1].isdigit() and not pid_alive(int(parts[1])):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


# ----------------------------------------------------------------------- layout

def plan_layout(leaf_specs: Sequence[tuple[np.dtype, tuple[int, ...]]]) -> tuple[list[int], int]:
    """Offsets of each leaf in a slot, and the total size."""
    offsets, end = [], 0
    for dtype, shape in leaf_specs:
        offsets.append(end)
        end = _round_up(end + dtype.itemsize * int(np.prod(shape, dtype=np.int64)), ALIGN)
    return offsets, end


def leaf_views(buf: Any, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], offsets: Sequence[int]) -> list[np.ndarray]:
    """Writable arrays over `buf`, one per leaf."""
    out = []
    for (dtype, shape), off in zip(specs, offsets):
        count = int(np.prod(shape, dtype=np.int64))
        out.append(np.frombuffer(buf, dtype=dtype, count=count, offset=off).reshape(shape))
    return out


class WorkerSegments:
    """A worker's view of the slots: maps segments by name, grows them on demand."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[str, mmap.mmap]] = {}

    def get(self, slot: int, name: str) -> mmap.mmap:
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == name:
            return cached[1]
        if cached is not None:
            _close_quietly(cached[1])
        m = open_segment(name)
        self._maps[slot] = (name, m)
        return m

    def buffer_for(self, slot: int, name: str, size: int, needed: int) -> tuple[mmap.mmap, str, int]:
        """A mapping of at least `needed` bytes for `slot`: the slot itself, or a new larger segment."""
        if needed <= size:
            return self.get(slot, name), name, size
        new_size = max(MIN_SLOT, _round_up(int(needed * 1.25), 1 << 20))
        stem, _, k = name.rpartition("-")
        new_name = f"{stem}-{int(k) + 1}"
        unlink_segment(new_name)  # a worker that died mid-growth may have left it
        m, _ = create_segment(new_name, new_size)
        cached = self._maps.get(slot)
        if cached is not None:
            _close_quietly(cached[1])
        self._maps[slot] = (new_name, m)
        return m, new_name, new_size

    def close(self) -> None:
        for _, m in self._maps.values():
            _close_quietly(m)
        self._maps.clear()


def _close_quietly(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # views still exported; the mapping goes with them


def write_batch(segments: WorkerSegments, slot: int, name: str, size: int, batch: Any) -> dict:
    """Copy a (collated) batch into a slot; return what the training process needs to view it."""
    treedef, leaves = codec.flatten(batch, allow_pickle=True)
    specs = [(leaf.dtype, leaf.shape) for leaf in leaves]
    offsets, total = plan_layout(specs)
    m, name, size = segments.buffer_for(slot, name, size, total)
    for view, leaf in zip(leaf_views(m, specs, offsets), leaves):
        np.copyto(view, leaf, casting="no")
    return {"treedef": treedef, "specs": specs, "offsets": offsets, "total": total, "name": name, "size": size}


def batch_treedef(treedef: tuple, n: int) -> tuple:
    """The treedef of `n` stacked samples of `treedef` (as the default collate builds them)."""
    tag = treedef[0]
    if tag == "d":
        return ("d", treedef[1], tuple(batch_treedef(c, n) for c in treedef[2]))
    if tag in ("l", "u"):
        return (tag, tuple(batch_treedef(c, n) for c in treedef[1]))
    if tag in ("a", "t"):
        return (tag, treedef[1], (n, *treedef[2]))
    dtype = {"i": "<i8", "f": "<f8", "b": "|b1"}.get(tag) or treedef[1]
    return ("a", np.dtype(dtype).str, (n,))


def gather_batch(segments: WorkerSegments, slot: int, name: str, size: int, reader: Any,
                 indices: np.ndarray) -> dict | None:
    """Gather a fixed-layout batch from a store straight into a slot (no intermediate copy)."""
    layout = reader.batch_layout()
    if layout is None:
        return None
    treedef, sample_specs = layout
    n = len(indices)
    specs = [(dtype, (n, *shape)) for dtype, shape in sample_specs]
    offsets, total = plan_layout(specs)
    m, name, size = segments.buffer_for(slot, name, size, total)
    reader.get_batch(indices, out=leaf_views(m, specs, offsets))
    return {"treedef": batch_treedef(treedef, n), "specs": specs, "offsets": offsets, "total": total,
            "name": name, "size": size}


# ----------------------------------------------------------------------- owner side

class SlotPool:
    """The training process's slots: creation, lending to tasks, zero-copy views, cleanup."""

    def __init__(self, initial_slots: int) -> None:
        self.prefix = f"cachestore-{os.getpid()}-{secrets.token_hex(4)}"
        self._names: list[str] = []
        self._maps: list[mmap.mmap | None] = []
        self._sizes: list[int] = []
        self._free: collections.deque[int] = collections.deque()
        self._lock = threading.Lock()
        self.size_hint = MIN_SLOT
        self.closed = False
        self._orphans: dict[tuple[int, int, int], int] = {}
        for _ in range(initial_slots):
            self._new_slot()

    def _new_slot(self) -> int:
        slot = len(self._names)
        name = f"{self.prefix}-{slot}-0"
        m, size = create_segment(name, self.size_hint)
        self._names.append(name)
        self._maps.append(m)
        self._sizes.append(size)
        self._free.append(slot)
        return slot

    def acquire(self) -> tuple[int, str, int]:
        """A free slot ``(slot, name, size)``; a new one when all are lent out."""
        with self._lock:
            if not self._free:
                self._new_slot()
            slot = self._free.popleft()
            return slot, self._names[slot], self._sizes[slot]

    def release(self, slot: int) -> None:
        with self._lock:
            if not self.closed:
                self._free.append(slot)

    def orphan(self, tasks: Any) -> None:
        """Remember slots lent to tasks whose results will arrive after their epoch ended."""
        for task in tasks:
            self._orphans[(task.epoch, task.seq, task.part)] = task.slot

    def release_task(self, msg: Any) -> None:
        """A late result of an orphaned task arrived: its slot is free again."""
        slot = self._orphans.pop((msg.epoch, msg.seq, msg.part), None)
        if slot is not None:
            if msg.meta is not None:
                self.adopt(slot, msg.meta["name"], msg.meta["size"])
            self.release(slot)

    def adopt(self, slot: int, name: str, size: int) -> None:
        """A worker grew `slot` into segment `name`: map it, drop the old one."""
        if name == self._names[slot]:
            return
        old_name, old_map = self._names[slot], self._maps[slot]
        self._maps[slot] = open_segment(name)
        self._names[slot] = name
        self._sizes[slot] = size
        self.size_hint = max(self.size_hint, size)
        unlink_segment(old_name)
        if old_map is not None:
            _close_quietly(old_map)

    def view(self, slot: int, meta: dict) -> Any:
        """The batch in `slot` as arrays over shared memory; the slot is lent until they die."""
        self.adopt(slot, meta["name"], meta["size"])
        owner = (ctypes.c_char * max(meta["total"], 1)).from_buffer(self._maps[slot])
        weakref.finalize(owner, self.release, slot)
        leaves = leaf_views(owner, meta["specs"], meta["offsets"])
        return codec.unflatten(meta["treedef"], leaves)

    def close(self) -> None:
        """Unlink every segment (mappings still viewed by live batches stay valid)."""
        with self._lock:
            self.closed = True
            self._free.clear()
        for m in self._maps:
            if m is not None:
                _close_quietly(m)
        self._maps = [None] * len(self._maps)
        for path in glob.glob(os.path.join(_SHM_DIR, self.prefix + "-*")):
            try:
                os.unlink(path)
            except OSError:
                pass
