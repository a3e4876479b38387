"""A stream's epochs that iterate it: served as it comes, and (with a cache) written in arrival order.

A stream (an iterable dataset) has no indices: its workers iterate their own
copies and the batches come in torch's turn
(:mod:`loader.executors.process.streams`). Without a cache every epoch is a
:class:`StreamEpoch`. With one, an epoch whose generation is not committed is a
:class:`StreamGenerateEpoch`: the samples are written as they arrive (index =
arrival position, the workers' batches in torch's turn), and the generation
is committed at the end of the stream; the epochs that read it are the
ordinary read epochs, a global permutation each (``docs/ARCHITECTURE.md``,
"Streams"). With ``shuffle=True`` a generate epoch serves through a shuffle
buffer (``cache_setting["stream_buffer"]`` samples): the best a stream allows
before it is random-access.
"""

from __future__ import annotations

import itertools
import logging
import warnings
from typing import Any, Iterator

import numpy as np

from cachestore.errors import BudgetExceededError, GenerationCommitted, StoreLockedError

from ...cache.stream_ranks import Abandoned, NodeStream, NodeStreamWriter
from ...cache.streams import wait_for_writer
from ...dataset import Batch, Sample
from ...executors.producer import transform
from ..context import EpochContext
from ..places import ComputePlace
from ..plan import EpochStats, RotatePlan, StreamGeneratePlan, StreamPlan
from ..rotation import FreshSamples
from .base import EpochKind

log = logging.getLogger(__name__)


class ShuffleBuffer:
    """A shuffle buffer of `size` samples: each new sample swaps with a random one once it is full."""

    def __init__(self, size: int, rng: np.random.Generator) -> None:
        self.size, self.rng = size, rng
        self.held: list[tuple[int, Sample]] = []

    def push(self, item: tuple[int, Sample]) -> tuple[int, Sample] | None:
        """Add `item`; a random held one comes out once the buffer is full."""
        if len(self.held) < self.size:
            self.held.append(item)
            return None
        k = int(self.rng.integers(self.size))
        out, self.held[k] = self.held[k], item
        return out

    def drain(self) -> list[tuple[int, Sample]]:
        """What is left, in random order."""
        left, self.held = self.held, []
        return [left[i] for i in self.rng.permutation(len(left))]


class StreamEpoch(EpochKind[StreamPlan]):
    """An epoch that iterates the stream and serves its batches as they come (see the module docstring)."""

    shows_progress = True

    def total(self) -> int:
        return 0  # unknown

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        plan, served, arrived = self.plan, 0, 0
        # read_transform needs the samples (seeded by their arrival position): collated here, then
        transforms = self.ctx.settings.read_transform is not None and plan.transform_seed is not None
        for _worker, count, batch in self.ctx.streams().items(plan.epoch, collate=not transforms):
            stats.computed += count
            served += 1
            arrived += count
            if served <= plan.skip:
                continue  # served before the resume: the stream is iterated again up to here
            self._check_length(served)
            if transforms:
                yield self._serve(list(enumerate(batch, arrived - count)), stats)
                continue
            stats.batches += 1
            stats.samples += count
            yield batch

    def _serve(self, batch: list[tuple[int, Sample]], stats: EpochStats) -> Batch:
        """One batch of ``(index, sample)``: through ``read_transform``, collated."""
        s, plan = self.ctx.settings, self.plan
        samples: list[Any] = [sample for _i, sample in batch]
        if s.read_transform is not None and plan.transform_seed is not None:
            samples = [transform(s.read_transform, sample, plan.transform_seed, plan.epoch, i)
                       for (i, _), sample in zip(batch, samples)]
        stats.batches += 1
        stats.samples += len(samples)
        return self.ctx.producer.collate(samples)

    def _check_length(self, served: int) -> None:
        """torch's warning when more batches come than the ``len(loader)`` the loop was told."""
        told = self.ctx.stream_len_called
        if told is None or served <= told:
            return
        message = (f"Length of IterableDataset {self.ctx.producer.dataset} was reported to be {told} (when "
                   f"accessing len(dataloader)), but {served} samples have been fetched. ")
        if self.ctx.settings.nb_worker > 0:
            message += ("For multiprocessing data-loading, this could be caused by not properly configuring the "
                        "IterableDataset replica at each worker. Please see "
                        "https://pytorch.org/docs/stable/data.html#torch.utils.data.IterableDataset for examples.")
        warnings.warn(message, stacklevel=2)


class StreamGenerateEpoch(StreamEpoch):
    """A stream iterated once into generation ``plan.generation`` (see the module docstring); with
    several ranks on the node, this rank's stream into the generation they write together
    (:mod:`loader.cache.stream_ranks`)."""

    plan: StreamGeneratePlan
    #: This rank's part of the generation the node's ranks write together (``None``: one writer, this one).
    node: NodeStreamWriter | None = None

    @classmethod
    def open(cls, ctx: EpochContext, place: ComputePlace, plan: StreamGeneratePlan) -> StreamGenerateEpoch:
        """The epoch, its generation opened for writing (the store's writer lock: one writer at a time)."""
        assert ctx.cache is not None and plan.generation is not None
        if ctx.layout.local_ranks > 1:
            return cls._open_with_ranks(ctx, place, plan)
        try:
            ctx.res.stream_writer = ctx.cache.store.writer(plan.generation, None)
        except StoreLockedError:
            # Another job iterates the same stream into this store: wait for it, then read what it committed.
            wait_for_writer(ctx.cache.settings, ctx.layout, ctx.settings.timeout)
            if plan.generation in ctx.cache.committed():
                raise GenerationCommitted(f"generation {plan.generation} was committed by another job") from None
            ctx.res.stream_writer = ctx.cache.store.writer(plan.generation, None)
        return cls(ctx, place, plan)

    @classmethod
    def _open_with_ranks(cls, ctx: EpochContext, place: ComputePlace,
                         plan: StreamGeneratePlan) -> StreamGenerateEpoch:
        """The epoch of one of the node's ranks: local rank 0 opens the generation (and holds the writer
        lock), every rank writes a shard of it."""
        assert ctx.cache is not None and plan.generation is not None
        store, layout = ctx.cache.store, ctx.layout
        node = NodeStream(store.path, plan.generation, plan.epoch, layout.local_ranks, layout.local_rank)
        try:
            if node.rank == 0:
                ctx.res.stream_writer = writer = store.writer(plan.generation, None)
                node.publish_ticket(writer.token)
                spec = writer.shard_spec()
            else:
                spec = node.ticket(store)
            epoch = cls(ctx, place, plan)
            epoch.node = NodeStreamWriter(node, spec, store)
        except BaseException as exc:
            node.fail(exc)
            node.close()
            raise
        return epoch

    def _put(self, k: int, sample: Sample) -> int:
        """Write the `k`-th sample to arrive (the one writer's: its index is `k`)."""
        writer = self.ctx.res.stream_writer
        assert writer is not None
        writer.put(k, sample)
        return k

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        ctx, plan, node = self.ctx, self.plan, self.node
        s = ctx.settings
        put = node.put if node is not None else self._put
        buffer = ShuffleBuffer(plan.buffer, np.random.default_rng([plan.seed, plan.epoch])) if plan.buffer else None
        pending: list[tuple[int, Sample]] = []
        written, served, finished = 0, 0, False
        try:
            for _worker, _count, samples in ctx.streams().items(plan.epoch, collate=False):
                arrived = []
                for sample in samples:
                    if plan.limit is not None and written >= plan.limit:
                        break
                    arrived.append((put(written, sample), sample))
                    written += 1
                if node is not None:
                    node.check()  # another rank failed: stop now, not at the end of this rank's stream
                stats.computed += len(arrived)
                stats.written += len(arrived)
                if buffer is None:
                    pending = arrived  # torch's batches, as the workers made them
                else:
                    pending.extend(out for out in map(buffer.push, arrived) if out is not None)
                while pending and (buffer is None or len(pending) >= s.batch_size):
                    batch, pending = pending[:s.batch_size], pending[s.batch_size:]
                    served += 1
                    if served > plan.skip:
                        yield self._serve(batch, stats)
                if plan.limit is not None and written >= plan.limit:
                    break
            if buffer is not None:
                pending.extend(buffer.drain())
            while pending and not (s.drop_last and len(pending) < s.batch_size):
                batch, pending = pending[:s.batch_size], pending[s.batch_size:]
                served += 1
                if served > plan.skip:
                    yield self._serve(batch, stats)
            finished = self._end(written, stats)
        except BaseException as exc:
            if node is not None:
                node.fail(exc)  # first: the other ranks stop at their next look
            if isinstance(exc, BudgetExceededError) and ctx.res.stream_writer is not None:
                writer, ctx.res.stream_writer = ctx.res.stream_writer, None
                writer.abort()
            raise
        finally:
            if node is not None:
                node.close()
            if not finished and ctx.res.stream_writer is not None:
                writer, ctx.res.stream_writer = ctx.res.stream_writer, None
                writer.keep()

    def _end(self, count: int, stats: EpochStats) -> bool:
        """The end of this rank's stream, after `count` samples: the generation committed (by local rank 0
        where the node's ranks write it together, the others waiting for it); ``False`` when another rank
        broke off its epoch (what was written is kept, as a broken-off epoch keeps it)."""
        node, ctx = self.node, self.ctx
        if node is None:
            self._commit(count, stats)
            return True
        try:
            total = node.end(count)
        except Abandoned as exc:
            log.info("%s; the next epoch writes it again", exc)
            return False
        if node.node.rank == 0:
            self._commit(total, stats)
            node.committed(self.plan.generation)
            return True
        if not total:
            raise ValueError("the streams of the node's ranks yielded no sample: there is nothing to cache")
        node.await_commit()
        assert ctx.cache is not None and self.plan.generation is not None
        ctx.cache.mine.add(self.plan.generation)
        ctx.reads.drop_reader()
        return True

    def _commit(self, count: int, stats: EpochStats) -> None:
        """The end of the stream: the generation holds `count` samples."""
        ctx = self.ctx
        writer, ctx.res.stream_writer = ctx.res.stream_writer, None
        assert ctx.cache is not None and writer is not None
        if count == 0:
            writer.abort()
            raise ValueError("the stream yielded no sample: there is nothing to cache")
        info = writer.commit({"epochs": [self.plan.epoch], "update_frequency": ctx.cache.settings.k_or_none,
                              "stream": True})
        ctx.cache.mine.add(info.id)
        removed = ctx.cache.store.prune(keep=1)
        ctx.reads.drop_reader()
        stats.committed = True
        log.info("committed generation %d of a stream (%d samples, %d bytes); pruned %d old item(s)", info.id,
                 info.num_samples, info.nbytes, len(removed))


def stream_fresh(ctx: EpochContext, plan: RotatePlan) -> FreshSamples:
    """The fresh samples of a rotation epoch over a stream: its next samples, as many as each array of
    positions asks for (the stream is iterated once per epoch, by its workers, in torch's turn)."""

    def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
        items = ctx.streams().items(plan.epoch, collate=False)
        samples = (sample for _worker, _count, batch in items for sample in batch)
        taken = 0  # (the rotation counts them into the stats)
        try:
            for positions in arrays:
                got = list(itertools.islice(samples, len(positions)))
                taken += len(got)
                if len(got) < len(positions):
                    raise ValueError(f"the stream ended after {taken} samples in epoch {plan.epoch}: "
                                     f"rotation serves {len(plan.indices)} of its samples each epoch (its len(), "
                                     "or rotation_setting['stream_samples'])")
                yield got
        finally:
            items.close()
    return fresh
