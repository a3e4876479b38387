"""The training process's shared-memory slots: create, lend to tasks, view, shrink, close.

Slots are memfds (or files): see :mod:`loader.executors.process.shm` for their
lifetime. A task names its slot by a string (:attr:`Task.slot_name`).

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
  live until an epoch that did not need them has ended;
* an epoch that lent no slot at all (its batches gathered in the training
  process or its threads, from the store) keeps none: their pages, megabytes
  each, would sit idle beside the gather threads' buffers for as long as the
  cached epochs last. The next epoch that needs slots creates them again.

A slot lent out - to a task in flight, an orphaned task of an abandoned epoch,
or a batch the loop still holds - never retires: its mapping stays valid under
the user's arrays. Retiring closes the training process's descriptor and
mapping; the pages are freed once every worker dropped its own, so the
executor sends the retired names to every worker
(:class:`~loader.executors.messages.RetireSlots`), which closes them before its next
task (:meth:`WorkerSegments.forget`). Slot ids and labels are never reused, so
a name identifies one slot for the loader's lifetime. Slots lent to tasks of
an executor that was killed are retired at the next epoch
(:meth:`SlotPool.drop_orphans`): their results will never come.

Open files: a slot holds descriptors
------------------------------------
Each slot costs two descriptors here (the memfd, and the one its mapping keeps)
and two in every worker that wrote into it. A loop that keeps every batch alive
would lend a new slot per batch until the process's ``ulimit -n`` runs out (torch's
loader dies of it). Past :func:`slot_budget` slots, a batch is copied out of its
slot into private memory and the slot is free again at once: the loop keeps its
batches, at the cost of one copy each. A descriptor refused anyway (other files
the process holds) is :class:`~loader.errors.TooManyOpenFilesError`.
"""

from __future__ import annotations

import collections
import ctypes
import glob
import mmap
import errno
import os
import resource
import secrets
import threading
import weakref
from typing import Iterable

from cachestore.format import codec

from ...dataset import Batch
from ...errors import too_many_open_files
from ...leaves import Buffer, leaf_views
from .. import messages as m
from . import shm
from .shm import MIN_SLOT, allocate, close_quietly, shm_dir, slot_size_for, unlink_segment


def slot_budget() -> int:
    """Slots past which batches are copied out (module docstring, "Open files"): an eighth of the
    descriptors ``ulimit -n`` allows, as each slot takes two here and two in a worker."""
    soft, _hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:
        return 1 << 20
    return max(2, soft // 8)


class SlotPool:
    """The training process's slots: creation, lending to tasks, zero-copy views, shrinking, cleanup.

    Slots are memfds (or, without them, files): see the module docstring.

    Parameters
    ----------
    initial_slots
        Slots created now; :meth:`shrink` never goes below this many after a period that lent slots.
    memfd
        Whether slots are memfds (default: :data:`loader.executors.process.shm.USE_MEMFD`).
    """

    def __init__(self, initial_slots: int, memfd: bool | None = None) -> None:
        self.memfd = shm.USE_MEMFD if memfd is None else memfd
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
        self.used_hint = MIN_SLOT  # bytes of a new slot allocated now: the largest batch of the last epoch
        self.closed = False
        self._orphans: dict[tuple[int, int, int], int] = {}
        self.floor = initial_slots
        self._peak = 0  # most slots lent at once since the last shrink()
        self._largest = 0  # largest batch (bytes) carried since the last shrink()
        self.budget = slot_budget()
        for _ in range(initial_slots):
            self._new_slot()

    def __len__(self) -> int:
        """Slots alive (free or lent)."""
        return len(self._names)

    def _new_slot(self) -> int:
        slot, self._next_id = self._next_id, self._next_id + 1
        label = f"{self.prefix}-{slot}"
        size = self.size_hint
        try:
            if self.memfd:
                fd = os.memfd_create(label, os.MFD_CLOEXEC)
                name = f"/proc/{os.getpid()}/fd/{fd}#{label}"  # the label makes a reused fd number a new name
            else:
                fd = os.open(os.path.join(shm_dir(), label), os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
                name = label
        except OSError as exc:
            if exc.errno == errno.EMFILE:
                raise too_many_open_files(len(self._names)) from exc
            raise
        try:
            allocate(fd, size, self.used_hint)
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

    def orphan(self, tasks: Iterable[m.Task]) -> None:
        """Remember slots lent to tasks whose results will arrive after their epoch ended."""
        for task in tasks:
            self._orphans[(task.epoch, task.seq, task.part)] = task.slot

    def orphaned(self, epoch: int | None = None) -> int:
        """Slots still lent to tasks of ended epochs (of epoch `epoch` only, when given)."""
        return len(self._orphans) if epoch is None else sum(key[0] == epoch for key in self._orphans)

    def release_task(self, msg: m.BatchDone | m.TaskFailed) -> None:
        """A late result of an orphaned task arrived: its slot is free again."""
        slot = self._orphans.pop((msg.epoch, msg.seq, msg.part), None)
        if slot is not None:
            meta = msg.meta if isinstance(msg, m.BatchDone) else None
            if meta is not None:
                self.adopt(slot, meta.name, meta.size)
                self._largest = max(self._largest, meta.total)
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
        close_quietly(old)

    def view(self, slot: int, meta: m.SlotBatch) -> Batch:
        """The batch in `slot` as arrays over shared memory; the slot is lent until they die. Past
        :attr:`budget` slots, a copy, and the slot is free at once (module docstring, "Open files")."""
        self.adopt(slot, meta.name, meta.size)
        self._largest = max(self._largest, meta.total)
        if len(self._names) > self.budget:
            owner: Buffer = bytearray(memoryview(self._maps[slot])[:max(meta.total, 1)])
            self.release(slot)
        else:
            owner = (ctypes.c_char * max(meta.total, 1)).from_buffer(self._maps[slot])
            weakref.finalize(owner, self.release, slot)
        leaves = leaf_views(owner, meta.specs, meta.offsets)
        if meta.stacked:
            return codec.unflatten_batch(meta.treedef, leaves)
        return codec.unflatten(meta.treedef, leaves, allow_pickle=True)  # a batch our own workers made

    def shrink(self) -> list[str]:
        """Retire the free slots the period since the last call did not need; return their names.

        Called between epochs; the rule is in the module docstring. The caller
        must tell the workers (:meth:`WorkerSegments.forget`), whose mappings keep the pages.
        """
        with self._lock:
            if self.closed:
                return []
            keep = max(self.floor, self._peak) if self._peak else 0  # none lent: none kept (docstring)
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
                self.size_hint, self.used_hint = slot_size_for(largest), largest
            return [self._retire(slot) for slot in retire]

    def _retire(self, slot: int) -> str:
        """Close this process's hold on `slot` (neither free nor lent any more); its name."""
        name = self._names.pop(slot)
        self._sizes.pop(slot, None)
        m = self._maps.pop(slot, None)
        if m is not None:
            close_quietly(m)
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
            for path in glob.glob(os.path.join(shm_dir(), self.prefix + "-*")):
                try:
                    os.unlink(path)
                except OSError:
                    pass
