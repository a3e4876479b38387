"""The generate epoch: every sample of generation ``g`` computed, written, served; ``g`` committed at the end.

Its build (:class:`loader.cache.build.GenerationBuild`) is opened when the
epoch is chosen (:meth:`GenerateEpoch.open`): a budget with no room applies
its policy (the epoch computes or rotates instead), and ``g`` committed
meanwhile by the other processes writing it is read instead
(:func:`loader.epochs.kinds.kind_of`). A build that adopted a partial
generation serves what it holds and computes the rest. At the end the generation is committed, or the budget
policy applies (:mod:`loader.cache.policy`); an epoch broken off, or failed,
keeps what it wrote (``docs/ARCHITECTURE.md``, "Resuming"). A sampler's epoch
has idle workers compute what it never draws (``GeneratePlan.fill``); what
they have not computed when its batches are served, every worker computes
before the commit, so the epochs that follow read the generation.
"""

from __future__ import annotations

import logging
from typing import Iterator

import numpy as np

from cachestore.errors import BudgetExceededError

from ...cache.build import GenerationBuild
from ...cache.policy import close_generation
from ...cache.refresh import CHUNK_DIVISOR, BackgroundRefresh
from ...dataset import Batch
from ..context import EpochContext
from ..order import split_batches
from ..places import ComputePlace
from ..plan import EpochStats, GeneratePlan
from ..work import ComputeWork
from .base import EpochKind

log = logging.getLogger(__name__)


class GenerateEpoch(EpochKind[GeneratePlan]):
    """An epoch that writes its generation (see the module docstring); `build` is ``None`` only when a
    plan made again still generates (the generation went away under the processes that committed it):
    the epoch then computes, writing nothing."""

    shows_progress = True

    def __init__(self, ctx: EpochContext, place: ComputePlace, plan: GeneratePlan,
                 build: GenerationBuild | None) -> None:
        super().__init__(ctx, place, plan)
        self.build = build

    @classmethod
    def open(cls, ctx: EpochContext, place: ComputePlace, plan: GeneratePlan) -> GenerateEpoch:
        """The epoch, its generation opened for writing.

        Raises
        ------
        BudgetExceededError
            The budget has no room for the generation.
        GenerationCommitted
            The other processes writing it committed it meanwhile: the epoch reads it.
        """
        assert ctx.cache is not None and plan.generation is not None
        if ctx.refresh is not None:
            # set_epoch jumped past the generation the refresh computes: it holds the writer.
            log.info("epoch %d writes generation %d: the background refresh of generation %d stops (what it "
                     "computed is kept)", plan.epoch, plan.generation, ctx.refresh.generation)
            ctx.kill_executor()
        build = ctx.cache.open_build(plan.generation, ctx.settings.use_threading, executor=place.writer())
        ctx.res.open_work.hold(build)  # kept if the loader goes before the epoch finishes it
        remote = ctx.cache.remote
        if remote is not None and remote.parts and build.shared:
            build.from_parts = True  # this node computes its part; the others come from the remote
            remote.claim_own(plan.generation)
        return cls(ctx, place, plan, build)

    def begin(self, stats: EpochStats) -> None:
        build, plan = self.build, self.plan
        if build is not None and build.adopted:
            # Samples an interrupted attempt wrote: those this epoch does not serve need no work.
            plan.unserved = [b for b in map(build.missing, plan.unserved) if len(b)]
            if plan.fill is not None:
                plan.fill = build.missing(plan.fill)
            stats.extra["adopted"] = build.adopted
        if build is not None and build.made_room:
            stats.extra["made_room"] = ",".join(map(str, build.made_room))

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        ctx, plan, build = self.ctx, self.plan, self.build
        work = ctx.res.open_work
        filling = None
        if plan.fill is not None and len(plan.fill) and build is not None:
            # Indices the sampler does not draw, computed by workers with nothing else to do.
            s = ctx.settings
            filling = BackgroundRefresh(build, plan.indices, max(1, s.batch_size // CHUNK_DIVISOR), s.nb_worker,
                                        positions=plan.fill, flush_when_done=False)
        finished = False
        try:
            yield from self.place.batches(plan, stats, ComputeWork(build, plan.unserved, plan.repeats), filling)
            if build is not None and filling is not None and not filling.done:
                self._complete_fill(filling, stats)
            if build is not None and filling is not None and filling.failed is not None:
                self._break_off(build)  # the store refused a chunk: what was written is kept
            elif build is not None and stats.extra.get("failed_batches"):
                self._break_off(build)  # the failed batches' samples are missing: kept, a partial generation
            elif build is not None:
                self._finish(build, stats)
            finished = True
        except BudgetExceededError:
            if build is not None:  # a generation that does not fit is not worth keeping
                work.drop(build)
                build.abort()
            raise
        finally:
            # Not when a kill of the workers kept it already.
            if not finished and build is not None and work.holds(build):
                self._break_off(build)

    def _complete_fill(self, filling: BackgroundRefresh, stats: EpochStats) -> None:
        """What the sampler did not draw and idle workers have not computed yet, every worker computes
        now: a generation holds every index, and one left partial would have each later epoch compute
        what its sampler draws again (a split's sampler never draws the rest)."""
        left = sum(len(chunk) for chunk in filling.todo) + sum(len(t.indices) for t in filling.inflight.values())
        log.info("epoch %d: computing the %d samples its sampler did not draw, to commit generation %d",
                 self.plan.epoch, left, self.plan.generation)
        stats.extra["fill_left"] = left
        try:
            filling.finish(self.ctx.host.ensure(), self.ctx.settings.timeout)
        except BaseException:
            self.ctx.kill_executor()
            raise

    def _finish(self, build: GenerationBuild, stats: EpochStats) -> None:
        """End of the epoch: commit, or give up caching as the budget policy says."""
        ctx = self.ctx
        assert ctx.cache is not None
        if build.from_parts and ctx.cache.remote is not None:
            ctx.cache.remote.exchange(build, lambda positions: self._compute(positions, stats))
        ctx.res.open_work.drop(build)
        policy = close_generation(build, ctx.cache, self.place.closer(), self.plan.epoch)
        if policy is None:
            ctx.reads.drop_reader()
            # Written together with other processes, one of them commits it (maybe not this one).
            stats.committed = build.writer.state == "committed"
            # No later epoch of this run computes: these workers go, with the copies of the dataset's
            # pages they made; an epoch that needs workers again starts fresh forks
            # (docs/ARCHITECTURE.md, "Memory with many workers").
            ctx.retire_workers = not ctx.cache.settings.rewrites
        else:
            ctx.apply_policy(policy)

    def _compute(self, positions: np.ndarray, stats: EpochStats) -> None:
        """Compute and write `positions` of the generation, serving none (a part another node did not
        publish in time: :meth:`loader.cache.remote.RemoteTier.exchange`)."""
        s, plan = self.ctx.settings, self.plan
        extra = GeneratePlan(plan.epoch, [], plan.indices, plan.generation, {},
                             unserved=split_batches(positions, s.batch_size, False))
        for _ in self.place.batches(extra, stats, ComputeWork(self.build, extra.unserved)):
            pass  # nothing is served

    def _break_off(self, build: GenerationBuild) -> None:
        """A broken-off or failed epoch keeps what it wrote. Workers may still be running its tasks:
        the build is kept (or committed, when they complete it) once they are done."""
        build.epoch = self.plan.epoch
        self.place.break_off(build)
