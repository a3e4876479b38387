"""Cached-epoch batches gathered by threads of the training process, ahead of the loop.

Why threads: a fixed-layout gather from a memmap store is one call into the
compiled gather (``cachestore/format/_gather.c``), which releases the GIL for the whole
batch (without it, numpy copies and xxh3 hashes, which release it call by call),
so two threads gather side by side. Against the workers, a batch then costs no
hand-off (no task message, no process woken, no slot mapped as arrays, no
reorder). Where this is cheaper for the loop is measured, like the other places
(:mod:`loader.epochs.reads.placement`): on 2 cores, 48 KiB samples of a memmap store usually come
faster this way than from 2 workers (those of an in-RAM store faster than from
one thread), 16-float samples come fastest from the training process's own
gather.

Only readers that say their batch reads may run in parallel
(:meth:`cachestore.Reader.parallel_batches`: memmap and in-RAM stores, fixed
layout) are read this way, and only with the default collate: the threads run no
user code. A corrupt record is handled by the training process, as in its own
gather: the batch is recomputed from the dataset there.

Buffers: a batch is handed out as arrays over one buffer, reused once every
array of that batch has died (a ``weakref.finalize`` on a per-batch ctypes
exporter, the one object every view keeps alive, as for slots in
:mod:`loader.executors.process.slots`); a new buffer per batch costs a page
fault per page, a large share of the gather's time. At most ``keep`` free buffers are kept, and none once an
epoch gathered elsewhere has ended (as slots go when not needed). The buffers
are shared anonymous mappings, not private memory: a process forked from the
training process (a torch ``DataLoader``'s workers, a validation loader's) made
every private buffer copy-on-write, and the next epoch's first writes copied
them page by page. Shared pages are not copied on a fork, and a threads epoch
runs about as fast with them as with private ones (``benchmarks/measurements.md``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import ctypes
import mmap
import os
import threading
import weakref
from typing import Any, Iterator

import numpy as np

from cachestore import CorruptSampleError, Reader

from ...executors import messages as m
from ...executors.producer import BatchProducer
from ...leaves import leaf_views, plan_layout
from ..plan import EpochStats, ReadPlan
from .base import LocalReads

#: Thread names start with this (see GatherThreads.shutdown).
THREAD_PREFIX = "cachestore-gather"


class BatchBuffers:
    """Buffers for gathered batches, each lent to one batch until its arrays are all gone.

    A buffer comes back through a ``weakref.finalize``, which may run in any
    thread, from a garbage collection that an allocation triggered, even while
    :meth:`arrays` holds the lock in that thread: so it only appends to a deque
    (atomic), which :meth:`arrays` drains under the lock.
    """

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._free: collections.deque[tuple[int, mmap.mmap]] = collections.deque()
        self._returned: collections.deque[tuple[int, mmap.mmap]] = collections.deque()
        self._lock = threading.Lock()
        self.closed = False
        self.allocated = 0  # buffers created so far

    def _drain(self) -> None:
        """Take the returned buffers in, keeping at most `keep` (the caller holds the lock)."""
        while self._returned:
            self._free.append(self._returned.popleft())
        while len(self._free) > self.keep:
            self._free.popleft()  # the oldest: a size the epochs no longer ask for goes first

    def arrays(self, specs: list[tuple[np.dtype, tuple[int, ...]]]) -> list[np.ndarray]:
        """Writable arrays, one per leaf spec ``(dtype, shape)``, over one buffer lent until they die."""
        offsets, total = plan_layout(specs)
        total = max(total, 1)
        buf = None
        with self._lock:
            self._drain()
            for k, (size, free) in enumerate(self._free):
                if size == total:
                    buf = free
                    del self._free[k]
                    break
            if buf is None:
                self.allocated += 1
        if buf is None:
            buf = mmap.mmap(-1, total)  # shared and anonymous: see the module docstring
        owner = (ctypes.c_char * total).from_buffer(buf)
        weakref.finalize(owner, self._give_back, total, buf)
        return leaf_views(owner, specs, offsets)

    def _give_back(self, total: int, buf: mmap.mmap) -> None:
        if not self.closed:
            self._returned.append((total, buf))

    def drop_free(self) -> None:
        """Let the free buffers go (an epoch that did not need them ended)."""
        with self._lock:
            self._drain()
            self._free.clear()

    def free_buffers(self) -> int:
        with self._lock:
            self._drain()
            return len(self._free)

    def close(self) -> None:
        with self._lock:
            self.closed = True
            self._free.clear()
            self._returned.clear()


class GatherThreads:
    """The training process's gather threads and their buffers (created when first used)."""

    def __init__(self, threads: int) -> None:
        self.threads = max(1, threads)
        #: Batches gathered ahead of the loop: one per thread, and two more so no thread waits
        #: for the loop to take a batch.
        self.ahead = self.threads + 2
        # Free buffers kept: all an epoch has in use at once (those ahead, the batch the loop
        # holds, the one before it, not yet collected, and one in between), so a steady epoch
        # allocates none.
        self.buffers = BatchBuffers(keep=self.ahead + 3)
        self._pool: concurrent.futures.ThreadPoolExecutor | None = None

    @property
    def pool(self) -> concurrent.futures.ThreadPoolExecutor:
        if self.buffers.closed:
            raise RuntimeError("this loader is closed")
        if self._pool is None:
            self._pool = concurrent.futures.ThreadPoolExecutor(self.threads, thread_name_prefix=THREAD_PREFIX)
        return self._pool

    def gather(self, reader: Reader, positions: np.ndarray) -> Any:
        """One batch of `reader` into a lent buffer (runs in a gather thread)."""
        layout = reader.batch_layout()
        assert layout is not None  # usable() let only fixed-layout readers here
        _, specs = layout
        n = len(positions)
        return reader.get_batch(positions, out=self.buffers.arrays([(dt, (n, *shape)) for dt, shape in specs]))

    def shutdown(self) -> None:
        """Stop the threads (after the gathers they run; not waited for from one of them)."""
        pool, self._pool = self._pool, None
        if pool is not None:
            inside = threading.current_thread().name.startswith(THREAD_PREFIX)
            pool.shutdown(wait=not inside, cancel_futures=True)
        self.buffers.close()


class ThreadReads(LocalReads):
    """Batches of a read epoch gathered by `threads` with the training process's reader, at most
    ``threads.ahead`` ahead."""

    name = "threads"

    def __init__(self, producer: BatchProducer, reader: Reader, source: m.ReadSource,
                 threads: GatherThreads) -> None:
        super().__init__(producer, reader, source)
        self.threads = threads
        self.warmup = threads.buffers.keep  # the first buffers allocated, their pages faulted in

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Any]:
        threads, reader = self.threads, self.reader
        batches = list(plan.batches)
        pending: collections.deque[concurrent.futures.Future] = collections.deque()
        submitted = 0
        try:
            for positions in batches:
                while submitted < len(batches) and len(pending) < threads.ahead:
                    pending.append(threads.pool.submit(threads.gather, reader, batches[submitted]))
                    submitted += 1
                try:
                    batch = pending.popleft().result()
                except CorruptSampleError as exc:
                    batch = self.recompute(plan, positions, exc)
                stats.read += len(positions)
                stats.batches += 1
                stats.samples += len(positions)
                yield batch
        finally:
            # A broken-off epoch: no gather may still read the store once the loader closes its reader.
            for future in pending:
                future.cancel()
            concurrent.futures.wait(pending)


def usable_cpus() -> int:
    """CPUs this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def usable(reader: Reader, producer: BatchProducer) -> bool:
    """Whether `reader`'s batches can be gathered by threads (see the module docstring)."""
    return not producer.custom_collate and producer.read_transform is None and reader.parallel_batches()

