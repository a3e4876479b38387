"""A stream's epochs that iterate it: served as it comes, and (with a cache) written in arrival order.

A stream (an iterable dataset) has no indices: its workers iterate their own
copies and the batches come in torch's turn
(:mod:`loader.executors.stream_turn`). Without a cache every epoch is a
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

import dataclasses
import itertools
import logging
import warnings
from typing import Any, Iterator

import numpy as np

from cachestore import GenerationWriter
from cachestore.errors import BudgetExceededError, GenerationCommitted, StoreLockedError

from ...cache.stream_ranks import Abandoned, NodeStream, NodeStreamWriter
from ...cache.streams import wait_for_writer
from ...dataset import Batch, Sample
from ...executors.positions import StreamAt, stateful
from ...executors.producer import transform
from ...executors.seeds import epoch_reseed
from ...settings import LoaderSettings
from ..context import EpochContext
from ..places import ComputePlace
from ..plan import EpochStats, ReadPlan, RotatePlan, StreamGeneratePlan, StreamPlan
from ..rotation import FreshSamples
from ..stream_feed import ROTATION_BASE, StreamFeed
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


def generated_again(plan: ReadPlan, skip: int, settings: LoaderSettings, seed: int,
                    resume: StreamAt | None) -> ReadPlan | StreamPlan:
    """The rest of a stream's generate epoch resumed after batch `skip`, its generation committed since
    (by the run that was stopped, which went on to the end, or another job): served as the generate
    epoch served it. Its batches were those the stream made: the stream is iterated again (from
    `resume`, a stateful stream's position), writing nothing; through a shuffle buffer, whose draws
    depend on the count of samples only, they are the generation's samples in the buffer's order."""
    cache = settings.cache
    assert cache is not None and settings.batch_size is not None
    if not (settings.shuffle and cache.stream_buffer):
        return StreamPlan(epoch=plan.epoch, batches=[], indices=np.zeros(0, dtype=np.int64), notes=plan.notes,
                          transform_seed=plan.transform_seed, skip=skip, seed=seed, limit=cache.stream_samples,
                          resume=resume)
    n, size = len(plan.indices), settings.batch_size
    buffer = ShuffleBuffer(cache.stream_buffer, np.random.default_rng([seed, plan.epoch]))
    served = [out[0] for out in (buffer.push((k, None)) for k in range(n)) if out is not None]
    served += [k for k, _ in buffer.drain()]
    batches = [np.asarray(served[i:i + size], dtype=np.int64) for i in range(0, n, size)]
    if settings.drop_last and batches and len(batches[-1]) < size:
        batches.pop()
    return dataclasses.replace(plan, batches=batches[skip:], order="as its generate epoch served it")


class StreamEpoch(EpochKind[StreamPlan]):
    """An epoch that iterates the stream and serves its batches as they come (see the module docstring)."""

    shows_progress = True

    def total(self) -> int:
        return 0  # unknown

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        plan, streams = self.plan, self.ctx.streams()
        # A stateful stream goes on from where it was; another is iterated again up to the resume point.
        served, arrived = (plan.skip, plan.resume.arrived) if plan.resume is not None else (0, 0)
        # read_transform needs the samples (seeded by their arrival position): collated here, then
        transforms = self.ctx.settings.read_transform is not None and plan.transform_seed is not None
        for _worker, count, batch in streams.items(plan.epoch, collate=not transforms, resume=plan.resume,
                                                   reseed=epoch_reseed(plan.seed, plan.epoch),
                                                   in_order=self.ctx.settings.in_order):
            stats.computed += count
            served += 1
            arrived += count
            if served <= plan.skip:
                continue  # served before the resume: the stream is iterated again up to here
            self._check_length(served)
            self._mark(streams.at, served)
            if transforms:
                yield self._serve(list(enumerate(batch, arrived - count)), stats)
                continue
            stats.batches += 1
            stats.samples += count
            yield batch
        self._mark_end(streams.end_at)

    def _mark_end(self, at: StreamAt | None) -> None:
        """The stream ran to its end: a state taken now resumes the next epoch with its copies as they are
        (a stream that counts its epochs, a dataset that is its own iterator: torchdata keeps them so)."""
        self.ctx.stream_at = (self.plan.epoch + 1, 0, at) if at is not None else None

    def _mark(self, at: StreamAt | None, served: int) -> None:
        """Where a state taken after batch `served` resumes a stateful stream (``None``: by iterating again)."""
        self.ctx.stream_at = (self.plan.epoch, served, at) if at is not None else None

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
    #: Indices an adopted partial generation holds (a stateful stream's resumed epoch).
    kept: frozenset[int] = frozenset()
    #: The generation this process writes (``None``: a node's rank other than 0, or finished): the epoch's
    #: own, held in the loader's ``Resources.open_work`` so that a loader gone mid-epoch keeps it.
    writer: GenerationWriter | None = None

    @classmethod
    def open(cls, ctx: EpochContext, place: ComputePlace, plan: StreamGeneratePlan) -> StreamGenerateEpoch:
        """The epoch, its generation opened for writing (the store's writer lock: one writer at a time); a
        stateful stream resumed adopts the partial generation the stopped run kept."""
        assert ctx.cache is not None and plan.generation is not None
        if ctx.layout.local_ranks > 1:
            # The node's ranks write the generation again from the start of their streams (a stateful
            # stream's own position is not taken up there: what rank 0 kept is not adopted by ranks).
            return cls._open_with_ranks(ctx, place, dataclasses.replace(plan, resume=None))
        # A stateful stream's writer records its producer, so that a stopped run's partial generation is kept
        # for the run that resumes it (and adopted by that one).
        resume = stateful(ctx.producer.dataset)
        try:
            writer = ctx.cache.store.writer(plan.generation, None, resume=resume)
        except StoreLockedError:
            # Another job iterates the same stream into this store: wait for it, then read what it committed.
            wait_for_writer(ctx.cache.settings, ctx.layout, ctx.settings.timeout)
            if plan.generation in ctx.cache.committed():
                raise GenerationCommitted(f"generation {plan.generation} was committed by another job") from None
            writer = ctx.cache.store.writer(plan.generation, None, resume=resume)
        ctx.res.open_work.hold(writer, by_workers=False)
        if plan.resume is not None and len(writer.present()) < plan.resume.arrived:
            # The samples the stream yielded before the stop are not all kept (the partial generation was
            # pruned): iterated again from the start instead, as a stream without a state of its own is.
            log.info("the partial generation of epoch %d lacks the samples before the resume point: the stream "
                     "is iterated again from its start", plan.epoch)
            plan = dataclasses.replace(plan, resume=None, replay=plan.resume.taken)
        epoch = cls(ctx, place, plan)
        epoch.writer = writer
        # The samples written after the state was taken (a run that went on, then stopped) stay as they are.
        epoch.kept = frozenset(writer.present().tolist()) if writer.adopted else frozenset()
        return epoch

    @classmethod
    def _open_with_ranks(cls, ctx: EpochContext, place: ComputePlace,
                         plan: StreamGeneratePlan) -> StreamGenerateEpoch:
        """The epoch of one of the node's ranks: local rank 0 opens the generation (and holds the writer
        lock), every rank writes a shard of it."""
        assert ctx.cache is not None and plan.generation is not None
        store, layout = ctx.cache.store, ctx.layout
        node = NodeStream(store.path, plan.generation, plan.epoch, layout.local_ranks, layout.local_rank)
        writer: GenerationWriter | None = None
        try:
            if node.rank == 0:
                writer = store.writer(plan.generation, None)
                ctx.res.open_work.hold(writer, by_workers=False)
                node.publish_ticket(writer.token)
                spec = writer.shard_spec()
            else:
                spec = node.ticket(store)
            epoch = cls(ctx, place, plan)
            epoch.writer = writer
            epoch.node = NodeStreamWriter(node, spec, store)
        except BaseException as exc:
            node.fail(exc)
            node.close()
            raise
        return epoch

    def _put(self, k: int, sample: Sample) -> int:
        """Write the `k`-th sample to arrive (the one writer's: its index is `k`), unless an adopted partial
        generation holds it."""
        writer = self.writer
        assert writer is not None
        if k not in self.kept:
            writer.put(k, sample)
        return k

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        ctx, plan, node = self.ctx, self.plan, self.node
        s = ctx.settings
        put = node.put if node is not None else self._put
        buffer = ShuffleBuffer(plan.buffer, np.random.default_rng([plan.seed, plan.epoch])) if plan.buffer else None
        pending: list[tuple[int, Sample]] = []
        streams, finished = ctx.streams(), False
        # A stateful stream resumed goes on after the samples the adopted partial generation holds.
        written, served = (plan.resume.arrived, plan.skip) if plan.resume is not None else (0, 0)
        # Iterated again from the start, out of turn: each copy's batches served before are its first ones.
        replay = list(plan.replay) if plan.replay is not None and buffer is None else None
        try:
            for worker, _count, samples in streams.items(plan.epoch, collate=False, resume=plan.resume,
                                                         reseed=epoch_reseed(plan.seed, plan.epoch),
                                                         in_order=s.in_order):
                again = False  # a batch this copy gave before the resume
                if replay is not None and replay[worker] > 0:
                    replay[worker] -= 1
                    again = True
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
                    before = again if replay is not None else served <= plan.skip  # served before the resume
                    if not before:
                        # Through a shuffle buffer, what was taken from the stream is more than was served.
                        self._mark(streams.at if buffer is None else None, served)
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
            self._mark_end(streams.end_at)
        except BaseException as exc:
            if node is not None:
                node.fail(exc)  # first: the other ranks stop at their next look
            if isinstance(exc, BudgetExceededError) and (writer := self._let_go()) is not None:
                writer.abort()
            raise
        finally:
            if node is not None:
                node.close()
            if not finished and (writer := self._let_go()) is not None:
                writer.keep()

    def _let_go(self) -> GenerationWriter | None:
        """The epoch's writer, which it commits, aborts or keeps itself now (no longer held for the
        finalizer); ``None`` when it has none (left)."""
        writer, self.writer = self.writer, None
        if writer is not None:
            self.ctx.res.open_work.drop(writer)
        return writer

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
        ctx, writer = self.ctx, self._let_go()
        assert ctx.cache is not None and writer is not None
        if count == 0:
            writer.abort()
            raise ValueError("the stream yielded no sample: there is nothing to cache")
        ctx.cache.commit(writer, self.plan.epoch, stream=True)
        ctx.reads.drop_reader()
        stats.committed = True


def stream_fresh(ctx: EpochContext, plan: RotatePlan) -> FreshSamples:
    """The fresh samples of a rotation epoch over a stream: its next samples, as many as each array of
    positions asks for, where the last epoch left the stream (:class:`StreamFeed`)."""
    streams = ctx.streams()
    if ctx.stream_feed is None or ctx.stream_feed.streams is not streams:
        ctx.stream_feed = StreamFeed(streams, ROTATION_BASE)
    feed = ctx.stream_feed

    def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
        taken = 0  # (the rotation counts them into the stats)
        for positions in arrays:
            try:
                got = feed.take(len(positions))
            except ValueError as exc:
                raise ValueError(f"epoch {plan.epoch}, after {taken} fresh samples: {exc}") from None
            taken += len(got)
            yield got
    return fresh
