"""Read epochs of a generation larger than memory: explicit, large, parallel reads ahead of the loop.

A generation that does not fit the memory room is not read through its
mapping (a page fault per 4 KiB, and little read-ahead) but with ``pread``
(:meth:`cachestore.Reader.read_range`, :meth:`~cachestore.Reader.read_rows`,
which release the GIL and verify every record), by a few I/O threads of the
training process, ahead of the loop: the epoch's order is known, so the reads
of the batches to come are issued while the loop works on this one.

* In **block order** (:func:`loader.epochs.order.block_order`) the unit of
  reading is a block of consecutive records (at least a MiB): each block is
  read once, whole, as soon as it is among the next ones the batches need,
  and dropped after the last batch that uses it. At most ``RESIDENT_WINDOWS``
  windows of blocks are held at once.
* In **random order** the rows of each batch are read with ``preadv`` s of
  runs of consecutive rows, a batch split between the I/O threads, the next
  ``PREFETCH_BATCHES`` batches in flight.

A corrupt record makes its batch a miss, computed from the dataset, as in
every other read path.
"""

from __future__ import annotations

import concurrent.futures
from collections import deque
from typing import Any, Callable, Iterator, Sequence

import numpy as np

from cachestore import CorruptSampleError, Reader
from cachestore.format import codec
from cachestore.format.codec import Leaf, LeafSpec

from ...dataset import Batch
from ...errors import SampleError
from ...executors import messages as m
from ...executors.producer import BatchProducer
from ..inline import dataset_error
from ..order import WINDOW_BLOCKS
from ..plan import EpochStats, ReadPlan
from .base import LocalReads


#: I/O threads of a streamed epoch: enough requests in flight for a disk's queue.
IO_THREADS = 8
#: Windows of blocks held (read, or being read) at once in block order.
RESIDENT_WINDOWS = 3
#: Batches read ahead in random order.
PREFETCH_BATCHES = 4
#: Thread names start with this.
THREAD_PREFIX = "cachestore-io"


class StreamedReads(LocalReads):
    """Batches of a read epoch read with the training process's reader, with explicit I/O ahead of the
    loop (see the module docstring)."""

    name = "stream"
    io_threads = IO_THREADS

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        reader, producer = self.reader, self.producer
        layout = reader.batch_layout()
        if layout is None:
            raise ValueError("streamed reads need a fixed-layout generation")
        treedef, specs = layout
        batches = [np.asarray(b, dtype=np.int64) for b in plan.batches]
        with concurrent.futures.ThreadPoolExecutor(self.io_threads, thread_name_prefix=THREAD_PREFIX) as pool:
            if plan.blocks is not None:
                leaves = _by_blocks(batches, plan.blocks.block, specs, reader, pool)
            else:
                leaves = _by_rows(batches, specs, reader, pool, self.io_threads)
            for positions, got in zip(batches, leaves):
                if isinstance(got, CorruptSampleError):
                    batch = self.recompute(plan, positions, got)
                else:
                    try:
                        batch = _batch(self.task(plan, positions), got, treedef, producer)
                    except SampleError as exc:  # read_transform's own exception
                        raise dataset_error(exc, plan.epoch) from None
                stats.read += len(positions)
                stats.batches += 1
                stats.samples += len(positions)
                yield batch


def _batch(task: m.Task, leaves: list[Leaf], treedef: codec.TreeDef, producer: BatchProducer) -> Batch:
    """The batch the default collate makes of `leaves` (stacked rows), or through the user's functions."""
    if producer.gathers_whole(task):
        return codec.unflatten_batch(treedef, leaves)
    samples = [codec.unflatten(treedef, [leaf[i] for leaf in leaves]) for i in range(len(task.indices))]
    samples = producer.transformed(task, samples)
    return producer.collate(samples)


def _empty(specs: list[LeafSpec], n: int) -> list[Leaf]:
    return [np.empty((n, *shape), dtype=dtype) for dtype, shape in specs]


def _by_rows(batches: list[np.ndarray], specs: list[LeafSpec], reader: Reader,
             pool: concurrent.futures.ThreadPoolExecutor, threads: int) -> Iterator[list[Leaf] | CorruptSampleError]:
    """Each batch's rows, read by the I/O threads in parts, `PREFETCH_BATCHES` batches ahead."""

    def read(positions: np.ndarray, out: list[Leaf], lo: int, hi: int) -> None:
        reader.read_rows(positions[lo:hi], [leaf[lo:hi] for leaf in out])

    def submit(positions: np.ndarray) -> tuple[list[Leaf], list[concurrent.futures.Future[None]]]:
        out = _empty(specs, len(positions))
        step = max(1, -(-len(positions) // threads))
        return out, [pool.submit(read, positions, out, lo, min(lo + step, len(positions)))
                     for lo in range(0, len(positions), step)]

    ahead: deque[tuple[list[Leaf], list[concurrent.futures.Future[None]]]] = deque()
    upcoming = iter(batches)
    for _ in range(PREFETCH_BATCHES):
        nxt = next(upcoming, None)
        if nxt is not None:
            ahead.append(submit(nxt))
    while ahead:
        out, parts = ahead.popleft()
        nxt = next(upcoming, None)
        if nxt is not None:
            ahead.append(submit(nxt))
        yield _result(parts, lambda: out)


def _result(parts: Sequence[concurrent.futures.Future[Any]],
            value: Callable[[], list[Leaf]]) -> list[Leaf] | CorruptSampleError:
    """`value()` once `parts` are done; the first corrupt record instead, when a part met one."""
    for part in parts:
        exc = part.exception()
        if isinstance(exc, CorruptSampleError):
            return exc
        if exc is not None:
            raise exc
    return value()


def _by_blocks(batches: list[np.ndarray], block: int, specs: list[LeafSpec], reader: Reader,
               pool: concurrent.futures.ThreadPoolExecutor) -> Iterator[list[Leaf] | CorruptSampleError]:
    """Each batch gathered from whole blocks, read once each, in the order the batches first need them."""
    n = reader.data.num_samples
    needs = [np.unique(b // block) for b in batches]
    last_use: dict[int, int] = {}
    first_needed: list[int] = []
    for j, ids in enumerate(needs):
        for b in ids.tolist():
            if b not in last_use:
                first_needed.append(b)
            last_use[b] = j
    held: dict[int, concurrent.futures.Future[list[Leaf]]] = {}
    to_read = iter(first_needed)
    limit = RESIDENT_WINDOWS * WINDOW_BLOCKS

    def read(b: int) -> list[Leaf]:
        start, stop = b * block, min((b + 1) * block, n)
        out = _empty(specs, stop - start)
        reader.read_range(start, stop, out)
        return out

    for j, positions in enumerate(batches):
        for b in needs[j].tolist():  # never wait on a block nobody asked for yet
            if b not in held:
                held[b] = pool.submit(read, b)
        while len(held) < limit:
            b = next(to_read, None)
            if b is None:
                break
            if b not in held and last_use[b] >= j:
                held[b] = pool.submit(read, b)
        yield _result(list(held[b] for b in needs[j].tolist()),
                      lambda: _gather(positions, block, {b: held[b].result() for b in needs[j].tolist()}, specs))
        for b in needs[j].tolist():
            if last_use[b] == j:
                del held[b]


def _gather(positions: np.ndarray, block: int, blocks: dict[int, list[Leaf]], specs: list[LeafSpec]) -> list[Leaf]:
    """The rows `positions` copied out of the blocks that hold them."""
    out = _empty(specs, len(positions))
    owner = positions // block
    # Grouped by block in one sort: only the blocks this batch draws from (up to a window's), not every
    # resident one, and slices instead of a scan of the batch per block.
    by_block = np.argsort(owner, kind="stable")
    present, starts = np.unique(owner[by_block], return_index=True)
    bounds = [*starts.tolist(), len(positions)]
    for k, b in enumerate(present.tolist()):
        rows = by_block[bounds[k]:bounds[k + 1]]
        within = positions[rows] - b * block
        for dest, src in zip(out, blocks[b]):
            dest[rows] = src[within]
    return out
