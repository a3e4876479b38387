"""The worker side of the shared-memory slots: map each once, grow in place, write batches.

The rules (lifetime, growing, retiring) are in :mod:`loader.executors.process.shm`
and :mod:`loader.executors.process.slots`.
"""

from __future__ import annotations

import errno
import mmap
import os
from typing import Iterable

import numpy as np

from cachestore import Reader
from cachestore.format import codec

from ...dataset import Batch
from ...errors import too_many_open_files
from ...leaves import leaf_views, plan_layout
from ..messages import SlotBatch
from .shm import allocate, close_quietly, path_of, slot_size_for


class WorkerSegments:
    """A worker's view of the slots: opens each once, grows them in place on demand."""

    def __init__(self) -> None:
        self._maps: dict[int, tuple[str, int, mmap.mmap]] = {}  # slot -> (name, fd, mapping)
        self._allocated: dict[int, int] = {}  # slot -> bytes this worker made sure are allocated

    def get(self, slot: int, name: str, size: int = 0) -> mmap.mmap:
        """A mapping of slot `name`, at least `size` bytes long (the file may have grown)."""
        cached = self._maps.get(slot)
        if cached is not None and cached[0] == name and len(cached[2]) >= size:
            return cached[2]
        if cached is not None and cached[0] == name:
            fd = cached[1]
            close_quietly(cached[2])
        else:
            if cached is not None:
                self._drop(slot)
            # Kept open: a memfd slot can only be reached through the owner's /proc entry, and
            # growing the slot needs a descriptor anyway.
            try:
                fd = os.open(path_of(name), os.O_RDWR | os.O_CLOEXEC)
            except OSError as exc:
                if exc.errno == errno.EMFILE:
                    raise too_many_open_files(len(self._maps)) from exc
                raise
        try:
            m = mmap.mmap(fd, os.fstat(fd).st_size)
        except BaseException:
            os.close(fd)
            self._maps.pop(slot, None)
            raise
        self._maps[slot] = (name, fd, m)
        return m

    def buffer_for(self, slot: int, name: str, size: int, needed: int) -> tuple[mmap.mmap, str, int]:
        """A mapping of at least `needed` bytes for `slot`, growing the slot when it is smaller; their pages
        allocated (:mod:`loader.executors.process.shm`)."""
        if needed <= size:
            m = self.get(slot, name, size)
            if self._allocated.get(slot, 0) < needed:
                allocate(self._maps[slot][1], size, needed)
                self._allocated[slot] = needed
            return m, name, size
        new_size = slot_size_for(needed)
        old = self.get(slot, name, size)
        _, fd, _ = self._maps[slot]
        close_quietly(old)
        # In place: the slot keeps its name, and the training process maps the new size when the
        # result tells it. The slot is lent to this task alone, so nobody reads it meanwhile.
        try:
            allocate(fd, new_size, needed)
            m = mmap.mmap(fd, new_size)
            self._allocated[slot] = needed
        except BaseException:
            self._drop(slot)  # its closed mapping must not be served to the next task (it maps the slot anew)
            raise
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
        self._allocated.pop(slot, None)
        _, fd, m = self._maps.pop(slot)
        close_quietly(m)
        os.close(fd)

    def close(self) -> None:
        for slot in list(self._maps):
            self._drop(slot)


def write_batch(segments: WorkerSegments, slot: int, name: str, size: int, batch: Batch) -> SlotBatch:
    """Copy a (collated) batch into a slot; return what the training process needs to view it."""
    treedef, leaves = codec.flatten(batch, allow_pickle=True)
    specs = [(leaf.dtype, leaf.shape) for leaf in leaves]
    offsets, total = plan_layout(specs)
    m, name, size = segments.buffer_for(slot, name, size, total)
    for view, leaf in zip(leaf_views(m, specs, offsets), leaves):
        np.copyto(view, leaf, casting="no")
    return SlotBatch(treedef, specs, offsets, total, name, size)


def gather_batch(segments: WorkerSegments, slot: int, name: str, size: int, reader: Reader,
                 indices: np.ndarray) -> SlotBatch | None:
    """Gather a fixed-layout batch from a store straight into a slot (no intermediate copy).

    The slot holds each leaf stacked along a first axis; the training process
    rebuilds the batch from the *sample's* treedef (``stacked``), as the reader
    itself would (:func:`cachestore.format.codec.unflatten_batch`).
    """
    layout = reader.batch_layout()
    if layout is None:
        return None
    treedef, sample_specs = layout
    n = len(indices)
    specs = [(dtype, (n, *shape)) for dtype, shape in sample_specs]
    offsets, total = plan_layout(specs)
    m, name, size = segments.buffer_for(slot, name, size, total)
    reader.get_batch(indices, out=leaf_views(m, specs, offsets))
    return SlotBatch(treedef, specs, offsets, total, name, size, stacked=True)


