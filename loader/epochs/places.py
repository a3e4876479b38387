"""Where samples are computed: in the training process (``nb_worker=0``) or by the executor's workers.

Chosen once per loader (:func:`compute_place`), as torch picks its
single-process or multiprocess iterator once: the epoch kinds
(:mod:`loader.epochs.kinds`) ask the place for their batches, for a rotation
epoch's fresh samples, for the executor a generation is written by and for
the workers' read path, and never test ``nb_worker`` themselves.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
from typing import Iterator

import numpy as np

from cachestore import Store
from cachestore.format.collate import stack_samples

from ..cache.build import GenerationBuild
from ..cache.pending import keep_or_commit
from ..cache.refresh import BackgroundRefresh
from ..dataset import Batch, Sample
from ..executors import messages as m
from ..executors.base import Executor
from ..errors import FailedBatch
from .context import EpochContext
from .inline import run_inline
from .plan import EpochPlan, EpochStats, ReadPlan, RotatePlan
from .reads.workers import WorkerReads
from .rotation import FreshSamples
from .scheduler import PoolRun, run_pool
from .work import ComputeWork, ReadWork

log = logging.getLogger(__name__)

#: Batches read ahead per worker in cached epochs (like torch's prefetch_factor=2).
READ_AHEAD_PER_WORKER = 2


class ComputePlace(ABC):
    """Where the samples of every epoch are computed (see the module docstring)."""

    def __init__(self, ctx: EpochContext) -> None:
        self.ctx = ctx

    @abstractmethod
    def start(self) -> None:
        """At the loader's start (workers start now, while the user sets up the model)."""

    @abstractmethod
    def batches(self, plan: EpochPlan, stats: EpochStats, work: ComputeWork,
                background: BackgroundRefresh | None = None) -> Iterator[Batch]:
        """The batches of compute or generate epoch `plan`, computed as `work` says, in order;
        `background` gets the workers' spare time."""

    @abstractmethod
    def fresh(self, plan: RotatePlan, stats: EpochStats) -> FreshSamples:
        """How rotation epoch `plan` computes its fresh samples."""

    @abstractmethod
    def writer(self) -> Executor | None:
        """The executor whose workers write the generation an epoch opens (``None``: this process)."""

    @abstractmethod
    def closer(self) -> Executor | None:
        """The executor whose workers close their shards when a generation is finished (``None``: none)."""

    @abstractmethod
    def break_off(self, build: GenerationBuild) -> None:
        """A broken-off or failed generate epoch keeps what it wrote (``docs/ARCHITECTURE.md``, "Resuming")."""

    def can_read(self, store: Store) -> bool:
        """Whether workers can read `store` (``False``: there are none)."""
        return False

    def read_workers(self, plan: ReadPlan, store: Store,
                     background: BackgroundRefresh | None = None) -> WorkerReads | None:
        """The workers' read path for read epoch `plan`, ``None`` where no worker can read `store`."""
        return None


class InProcess(ComputePlace):
    """``nb_worker=0``: the dataset runs in the training process, which writes the generation itself."""

    def start(self) -> None:
        timeout = self.ctx.settings.timeout
        if timeout is not None:
            log.info("timeout=%g has no effect with nb_worker=0: the dataset runs in the training process, "
                     "which cannot interrupt it", timeout)

    def batches(self, plan: EpochPlan, stats: EpochStats, work: ComputeWork,
                background: BackgroundRefresh | None = None) -> Iterator[Batch]:
        return run_inline(plan, self.ctx.producer, work, stats)

    def fresh(self, plan: RotatePlan, stats: EpochStats) -> FreshSamples:
        producer = self.ctx.producer

        def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
            for indices in arrays:
                yield producer.samples(indices, plan.epoch)
        return fresh

    def writer(self) -> Executor | None:
        return None

    def closer(self) -> Executor | None:
        return None

    def break_off(self, build: GenerationBuild) -> None:
        self.ctx.res.open_work.drop(build)
        self.ctx.producer.close_shard()
        keep_or_commit(build, self.ctx.cache)


class OnWorkers(ComputePlace):
    """The executor's workers compute (and write) the samples; batches come back through shared memory."""

    def start(self) -> None:
        self.ctx.host.ensure()

    def _run(self, plan: EpochPlan, split_ends: bool, background: BackgroundRefresh | None) -> PoolRun:
        """How the executor runs an epoch (its first epoch lets the queue fill for ``prefetch_time``)."""
        s, host = self.ctx.settings, self.ctx.host
        return PoolRun(host.ensure(), host.slot_pool(), s.max_queue_size, self.ctx.kill_executor,
                       s.max_minibatch_length, s.prefetch_time if plan.epoch == 0 else None, timeout=s.timeout,
                       split_ends=split_ends, background=background, collate_fn=s.collate_fn or stack_samples,
                       in_order=s.in_order)

    def batches(self, plan: EpochPlan, stats: EpochStats, work: ComputeWork,
                background: BackgroundRefresh | None = None) -> Iterator[Batch]:
        # Split ends only where batches go to the least loaded worker: one dealt in turn is a worker's whole.
        run = self._run(plan, not self.ctx.settings.deals_in_turn, background)
        if work.build is not None:
            work.build.attach(run.executor)
        return run_pool(plan, run, stats, work)

    def fresh(self, plan: RotatePlan, stats: EpochStats) -> FreshSamples:
        ctx = self.ctx

        def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
            s, host = ctx.settings, ctx.host
            compute = EpochPlan(plan.epoch, arrays, np.arange(ctx.layout.num_samples))
            run = PoolRun(host.ensure(), host.slot_pool(), s.max_queue_size, ctx.kill_executor,
                          s.max_minibatch_length, collate=False, timeout=s.timeout)
            pool = run_pool(compute, run, stats, ComputeWork())
            try:
                for samples in pool:
                    if isinstance(samples, FailedBatch):
                        # A rotation epoch cannot serve past fresh samples it lacks (their slots stay
                        # empty): the dataset's error ends it, as it does without workers.
                        raise samples.error
                    yield samples
            finally:
                close = getattr(pool, "close", None)
                if close is not None:
                    close()  # its slots given back now, not when it is collected
        return fresh

    def writer(self) -> Executor | None:
        return self.ctx.host.ensure()

    def closer(self) -> Executor | None:
        return self.ctx.res.executor

    def break_off(self, build: GenerationBuild) -> None:
        ctx = self.ctx
        if ctx.res.executor is None:  # killed: its workers are gone, what they wrote is whole on disk
            ctx.res.open_work.drop(build)
            ctx.producer.close_shard()
            keep_or_commit(build, ctx.cache)
            return
        # Workers may still be running the epoch's tasks: kept (or committed) once they are done, still
        # held for the finalizer meanwhile.
        build.detach()
        ctx.pending.append(build)

    def can_read(self, store: Store) -> bool:
        return store.backend.persistent  # an in-RAM store lives in the training process

    def read_workers(self, plan: ReadPlan, store: Store,
                     background: BackgroundRefresh | None = None) -> WorkerReads | None:
        if not self.can_read(store):
            return None
        s = self.ctx.settings
        # Reading a batch takes milliseconds: a deep queue would only hold memory.
        depth = min(s.max_queue_size, READ_AHEAD_PER_WORKER * s.nb_worker + 2)
        source: m.ReadSource = (store.spec, plan.generation or 0, plan.committed_at)
        return WorkerReads(lambda: self._run(plan, False, background), depth, ReadWork(source))


def compute_place(ctx: EpochContext) -> ComputePlace:
    """Where this loader computes samples: chosen once, from ``nb_worker``."""
    return OnWorkers(ctx) if ctx.settings.nb_worker > 0 else InProcess(ctx)
