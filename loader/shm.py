"""Shared-memory slots that carry batches from workers to the training process.

Lifetime: no segment may outlive the processes that use it
------------------------------------------------------------
A slot is a ``memfd`` (an anonymous tmpfs file) created by the training
process, which keeps its descriptor open for the slot's lifetime. A worker
opens the same file through ``/proc/<training pid>/fd/<fd>`` and keeps its own
descriptor. Nothing has a name in ``/dev/shm``, so the kernel frees a slot
when the last process holding it (descriptor or mapping) is gone - whatever
ended them: close, an exception, SIGTERM, SIGKILL of the training process
(its workers then die too: see the parent-death signal in
:mod:`loader.worker`). Every alternative leaves a window: a named file is
unlinked by a cleanup that SIGKILL skips; a sweep of dead pids' files at the
next start only runs if there is a next start; a resource-tracker process
dies with a SIGKILLed process group.

Where ``memfd`` or ``/proc/<pid>/fd`` is not available (not Linux, or a
non-dumpable training process that workers may not open), slots fall back to
files under ``/dev/shm`` named ``cachestore-<pid>-<hex>-<slot>``: removed on
close, and by :func:`sweep_dead_segments` at the next start after a crash.

A task names its slot by a string (:attr:`Task.slot_name`): the ``/proc``
path followed by ``#`` and a unique label, or the file name. Slots are
reused: a freshly mapped page costs micro-seconds to fault in, a new buffer
per batch would cost more than the copy. The training process hands a batch
out as numpy views of the slot; the slot returns to the free list when the
last view dies (a ``weakref.finalize`` on a per-batch ctypes exporter, the
one object every view keeps alive). A batch larger than its slot is written
by the worker after growing the slot's file in place (``ftruncate``); the
training process maps the larger size when the result says so. A slot's
pages are allocated when it is created or grown (``posix_fallocate``), so a
full ``/dev/shm`` or memory limit is an ``OSError`` there, never a SIGBUS
when a page is first touched.

Shrinking: slots are sized by the last epoch, not the loader's lifetime
--------------------------------------------------------------------------
An epoch may need many slots (the in-flight depth grew, or the loop held on to
its batches) or a large one (one huge batch); later epochs may not. At the
end of each completed epoch (at the start of the next after one broken off)
:meth:`SlotPool.shrink` retires *free* slots by this rule, measured over that
epoch (since the last call):

* a slot larger than ``max(MIN_SLOT, 2 x the largest batch carried)`` retires
  (one grown for a batch the epoch no longer has); new slots are created at
  the size the largest batch needs. An epoch that carried no batch in a slot
  (gathered in the training process; Ray) says nothing about sizes: none retires;
* then, least recently used first, slots beyond ``max(initial slots, the most
  slots lent at once)`` retire. A steady workload keeps its slots (no
  allocation per batch, nor per epoch); the extra slots of one deep epoch
  live until an epoch that did not need them has ended.

A slot lent out - to a task in flight, an orphaned task of an abandoned epoch,
or a batch the loop still holds - never retires: its mapping stays valid under
the user's arrays. Retiring closes the training process's descriptor and
mapping; the pages are freed once every worker dropped its own, so the
executor sends the retired names to every worker
(:class:`~loader.messages.RetireSlots`), which closes them before its next
task (:meth:`WorkerSegments.forget`). Slot ids and labels are never reused, so
a name identifies one slot for the loader's lifetime. Slots lent to tasks of
an executor that was killed are retired at the next epoch
(:meth:`SlotPool.drop_orphans`): their results will never come.
"""

from __future__ import annotations

import collections
import ctypes
import errno
import glob
import logging
import math
import mmap
import os
import secrets
import sys
import tempfile
import threading
import weakref
from typing import Any, Iterable, Sequence

import numpy as np

from cachestore import codec
from cachestore.scratch import pid_alive

log = logging.getLogger(__name__)

ALIGN = 64
MIN_SLOT = 1 << 20
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
#: Start of the ``/proc/<pid>/maps`` path of a memfd slot (``/memfd:<label> (deleted)``).
MEMFD_PREFIX = "/memfd:cachestore-"
_PROC_FD = "/proc/"
_PR_GET_DUMPABLE = 3


def shm_dir() -> str:
    return _SHM_DIR


def _round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def slot_size_for(needed: int) -> int:
    """The size a slot gets for a batch of `needed` bytes: a quarter spare, whole MiB, at least ``MIN_SLOT``."""
    return max(MIN_SLOT, _round_up(int(needed * 1.25), 1 << 20))


def _memfd_usable() -> bool:
    """Whether slots can be memfds that workers open through ``/proc/<pid>/fd``."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # Another process may open our /proc/<pid>/fd entries only while we are dumpable.
        return libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1
    except (OSError, AttributeError):
        return False


#: Slots are memfds (see the module docstring); read once, set to False to force files.
USE_MEMFD = _memfd_usable()


def is_segment_path(path: str) -> bool:
    """Whether `path` (from ``/proc/<pid>/maps`` or ``/proc/<pid>/fd``) is a slot of this package."""
    return path.startswith(MEMFD_PREFIX) or path.startswith(os.path.join(_SHM_DIR, "cachestore-"))


def _path_of(name: str) -> str:
    if name.startswith(_PROC_FD):
        return name.split("#", 1)[0]
    return os.path.join(_SHM_DIR, name)


def _allocate(fd: int, size: int) -> None:
    """Make the file of `fd` `size` bytes long, with its pages allocated now (see the module docstring)."""
    try:
        os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # no fallocate here: pages come on first touch, as with any mapping
        raise OSError(exc.errno, f"cannot allocate {size} bytes of shared memory for loader batches "
                                 f"({exc.strerror}); free memory (or space in {_SHM_DIR}), or use smaller "
                                 "batches") from exc


def unlink_segment(name: str) -> None:
    """Remove a file segment's name (nothing to do for a memfd slot: it has none)."""
    if name.startswith(_PROC_FD):
        return
    try:
        os.unlink(os.path.join(_SHM_DIR, name))
    except FileNotFoundError:
        pass


def sweep_dead_segments() -> list[str]:
    """Remove file segments of training processes that no longer exist (memfd slots need no sweep)."""
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
        end = _round_up(end + dtype.itemsize * math.prod(shape), ALIGN)
    return offsets, end


def leaf_views(buf: Any, specs: Sequence[tuple[np.dtype, tuple[int, ...]]], offsets: Sequence[int]) -> list[np.ndarray]:
    """Writable arrays over `buf`, one per leaf."""
    out = []
    for (dtype, shape), off in zip(specs, offsets):
        count = math.prod(shape)
        out.append(np.frombuffer(buf, dtype=dtype, count=count, offset=off).reshape(shape))
    return out


class WorkerSegments:
    """A worker's view of the slots: opens each once, grows them in place on demand."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[str, int, mmap.mmap]] = {}  # slot -> (name, fd, mapping)

    def get(self, slot: int, name: str, size: int = 0) -> mmap.mmap:
        """A mapping of slot `name`, at least `size` bytes long (the file may have grown)."""
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == name and len(cached[2]) >= size:
            return cached[2]
        if cached is not None and cached[0] == name:
            fd = cached[1]
            _close_quietly(cached[2])
        else:
            if cached is not None:
                self._drop(slot)
            # Kept open: a memfd slot can only be reached through the owner's /proc entry, and
            # growing the slot needs a descriptor anyway.
            fd = os.open(_path_of(name), os.O_RDWR | os.O_CLOEXEC)
        try:
            m = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            self._maps.pop(slot, None)
            raise
        self._maps[slot] = (name, fd, m)
        return m

    def buffer_for(self, slot: int, name: str, size: int, needed: int) -> tuple[mmap.mmap, str, int]:
        """A mapping of at least `needed` bytes for `slot`, growing the slot when it is smaller."""
        if needed <= size:
            return self.get(slot, name, size), name, size
        new_size = slot_size_for(needed)
        old = self.get(slot, name, size)
        _, fd, _ = self._maps[slot]
        _close_quietly(old)
        # In place: the slot keeps its name, and the training process maps the new size when the
        # result tells it. The slot is lent to this task alone, so nobody reads it meanwhile.
        _allocate(fd, new_size)
        m = mmap.mmap(fd, new_size)
        self._maps[slot] = (name, fd, m)
        return m, name, new_size

    def forget(self, names: Iterable[str]) -> int:
        """Close the mappings and descriptors of slots `names` (the owner retired them); return how many.

        Names this worker never mapped are ignored: every worker is told of every retired slot.
        """
        retired = set(names)
        slots = [slot for slot, (name, _, _) in self._maps.items() if name in retired]
        for slot in slots:
            self._drop(slot)
        return len(slots)

    def __len__(self) -> int:
        """Slots this worker holds open."""
        return len(self._maps)

    def _drop(self, slot: int) -> None:
        _, fd, m = self._maps.pop(slot)
        _close_quietly(m)
        os.close(fd)

    def close(self) -> None:
        for slot in list(self._maps):
            self._drop(slot)


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
    """The training process's slots: creation, lending to tasks, zero-copy views, shrinking, cleanup.

    Slots are memfds (or, without them, files): see the module docstring.

    Parameters
    ----------
    initial_slots
        Slots created now; :meth:`shrink` never goes below this many.
    memfd
        Whether slots are memfds (default: :data:`USE_MEMFD`).
    """

    def __init__(self, initial_slots: int, memfd: bool | None = None) -> None:
        self.memfd = USE_MEMFD if memfd is None else memfd
        self.prefix = f"cachestore-{os.getpid()}-{secrets.token_hex(4)}"
        # Keyed by slot id; ids (and so labels) are never reused, so a retired slot's name
        # can never come back as another slot's (see the module docstring).
        self._names: dict[int, str] = {}
        self._fds: dict[int, int] = {}
        self._maps: dict[int, mmap.mmap] = {}
        self._sizes: dict[int, int] = {}
        self._next_id = 0
        self._free: collections.deque[int] = collections.deque()
        # Reentrant: the finalizer that calls release() may run from a garbage collection that an
        # allocation made while this thread holds the lock (in acquire or shrink).
        self._lock = threading.RLock()
        self.size_hint = MIN_SLOT
        self.closed = False
        self._orphans: dict[tuple[int, int, int], int] = {}
        self.floor = initial_slots
        self._peak = 0  # most slots lent at once since the last shrink()
        self._largest = 0  # largest batch (bytes) carried since the last shrink()
        for _ in range(initial_slots):
            self._new_slot()

    def __len__(self) -> int:
        """Slots alive (free or lent)."""
        return len(self._names)

    def _new_slot(self) -> int:
        slot, self._next_id = self._next_id, self._next_id + 1
        label = f"{self.prefix}-{slot}"
        size = self.size_hint
        if self.memfd:
            fd = os.memfd_create(label, os.MFD_CLOEXEC)
            name = f"/proc/{os.getpid()}/fd/{fd}#{label}"  # the label makes a reused fd number a new name
        else:
            fd = os.open(os.path.join(_SHM_DIR, label), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            name = label
        try:
            _allocate(fd, size)
            m = mmap.mmap(fd, size)
        except BaseException:
            os.close(fd)
            unlink_segment(name)
            raise
        self._names[slot] = name
        self._fds[slot] = fd
        self._maps[slot] = m
        self._sizes[slot] = size
        self._free.append(slot)
        return slot

    def acquire(self) -> tuple[int, str, int]:
        """A free slot ``(slot, name, size)``; a new one when all are lent out."""
        with self._lock:
            if not self._free:
                self._new_slot()
            slot = self._free.pop()  # the slot released last: its pages are the likeliest in cache
            self._peak = max(self._peak, len(self._names) - len(self._free))
            return slot, self._names[slot], self._sizes[slot]

    def release(self, slot: int) -> None:
        with self._lock:
            if not self.closed and slot in self._names:
                self._free.append(slot)

    def orphan(self, tasks: Any) -> None:
        """Remember slots lent to tasks whose results will arrive after their epoch ended."""
        for task in tasks:
            self._orphans[(task.epoch, task.seq, task.part)] = task.slot

    def orphaned(self) -> int:
        """Slots still lent to tasks of ended epochs."""
        return len(self._orphans)

    def release_task(self, msg: Any) -> None:
        """A late result of an orphaned task arrived: its slot is free again."""
        slot = self._orphans.pop((msg.epoch, msg.seq, msg.part), None)
        if slot is not None:
            if msg.meta is not None:
                self.adopt(slot, msg.meta["name"], msg.meta["size"])
                self._largest = max(self._largest, msg.meta["total"])
            self.release(slot)

    def drop_orphans(self) -> list[str]:
        """Retire the slots lent to orphaned tasks of an executor that was killed; return their names.

        Their results will never arrive, so the slots would stay lent forever. Retired rather than
        freed: a thread worker that outlived the kill may still write into its own mapping.
        """
        with self._lock:
            slots, self._orphans = list(self._orphans.values()), {}
            return [self._retire(slot) for slot in slots]

    def adopt(self, slot: int, name: str, size: int) -> None:
        """A worker grew `slot` in place to `size` bytes: map it at that size."""
        if self.closed:
            return
        if name != self._names.get(slot):
            raise ValueError(f"slot {slot} is {self._names.get(slot)!r}, a worker reported {name!r}")
        if size <= self._sizes[slot]:
            return
        old = self._maps[slot]
        self._maps[slot] = mmap.mmap(self._fds[slot], size)
        self._sizes[slot] = size
        self.size_hint = max(self.size_hint, size)
        _close_quietly(old)

    def view(self, slot: int, meta: dict) -> Any:
        """The batch in `slot` as arrays over shared memory; the slot is lent until they die."""
        self.adopt(slot, meta["name"], meta["size"])
        self._largest = max(self._largest, meta["total"])
        owner = (ctypes.c_char * max(meta["total"], 1)).from_buffer(self._maps[slot])
        weakref.finalize(owner, self.release, slot)
        leaves = leaf_views(owner, meta["specs"], meta["offsets"])
        return codec.unflatten(meta["treedef"], leaves)

    def shrink(self) -> list[str]:
        """Retire the free slots the period since the last call did not need; return their names.

        Called between epochs; the rule is in the module docstring. The caller
        must tell the workers (:meth:`WorkerSegments.forget`), whose mappings keep the pages.
        """
        with self._lock:
            if self.closed:
                return []
            keep = max(self.floor, self._peak)
            largest, self._largest = self._largest, 0
            self._peak = len(self._names) - len(self._free)  # still lent: they count in the next period
            free = list(self._free)  # least recently used first
            # Without a batch carried (an epoch gathered in this process, Ray) sizes say nothing.
            limit = max(MIN_SLOT, 2 * largest) if largest else None
            retire = [slot for slot in free if limit is not None and self._sizes[slot] > limit]
            spare = len(self._names) - len(retire) - keep
            for slot in free:
                if spare <= 0:
                    break
                if slot not in retire:
                    retire.append(slot)
                    spare -= 1
            for slot in retire:
                self._free.remove(slot)
            if largest:
                self.size_hint = slot_size_for(largest)
            return [self._retire(slot) for slot in retire]

    def _retire(self, slot: int) -> str:
        """Close this process's hold on `slot` (neither free nor lent any more); its name."""
        name = self._names.pop(slot)
        self._sizes.pop(slot, None)
        m = self._maps.pop(slot, None)
        if m is not None:
            _close_quietly(m)
        fd = self._fds.pop(slot, None)
        if fd is not None:
            os.close(fd)
        unlink_segment(name)
        return name

    def close(self) -> None:
        """Release every slot (mappings still viewed by live batches stay valid until they die)."""
        with self._lock:
            self.closed = True
            self._free.clear()
            self._orphans.clear()
            for slot in list(self._names):
                self._retire(slot)
        if not self.memfd:
            for path in glob.glob(os.path.join(_SHM_DIR, self.prefix + "-*")):
                try:
                    os.unlink(path)
                except OSError:
                    pass
