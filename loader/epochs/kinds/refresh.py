"""The refresh epoch: a read epoch of generation ``g`` whose idle workers compute ``g + 1`` meanwhile.

With ``background_refresh`` on and workers that can read the store, a read
epoch starts the refresh of the next generation (or goes on with the one
running) and is read by the workers, whose spare time the refresh takes
(:mod:`loader.cache.refresh` schedules its chunks between the batch tasks).
When no refresh is due (the next generation is committed, or the budget has
no room for it) the epoch reads as any read epoch does. The last epoch of ``g``
commits the refresh as it ends where every chunk is handed out; otherwise the
first epoch of ``g + 1`` finishes the refresh and commits it (:func:`refreshed`,
a step before its plan: :mod:`loader.epochs.prepare`), then reads it.
"""

from __future__ import annotations

from ...cache.refresh import complete_refresh, start_refresh
from ..context import EpochContext
from ..places import ComputePlace
from ..plan import EpochStats, ReadPlan
from ..reads.base import ReadPath
from .read import ReadEpoch


class RefreshEpoch(ReadEpoch):
    """A read epoch that computes the next generation in the background (see the module docstring)."""

    @staticmethod
    def applies(ctx: EpochContext, place: ComputePlace, plan: ReadPlan) -> bool:
        """Whether read epoch `plan` may run a refresh: workers can read the store, and refreshes are on
        (or one is running)."""
        store = ctx.res.store
        assert ctx.cache is not None and store is not None
        return (not plan.stream and place.can_read(store)
                and (ctx.refresh is not None or not ctx.cache.refresh_off))

    def path(self, stats: EpochStats) -> ReadPath:
        ctx, plan = self.ctx, self.plan
        store = ctx.res.store
        assert ctx.cache is not None and store is not None and plan.generation is not None
        if ctx.refresh is None:
            ctx.refresh = start_refresh(ctx.cache, ctx.host, ctx.res, ctx.indices, plan.generation, ctx.settings.batch_size)
        if ctx.refresh is None:
            return super().path(stats)
        workers = self.place.read_workers(plan, store, background=ctx.refresh)
        assert workers is not None  # applies() said they can read this store
        stats.extra["gather"] = workers.name
        return workers


def refreshed(ctx: EpochContext, generation: int, epoch: int, prune: bool = True) -> bool:
    """Whether a background refresh had computed `generation` and committed it now (epoch `epoch`, the
    generation's first, then reads it; `prune`: older generations go with the commit); ``False``: the
    epoch writes it the usual way."""
    refresh = ctx.refresh
    if refresh is None or refresh.generation != generation or ctx.cache is None:
        return False
    ctx.refresh = None
    try:
        done = complete_refresh(refresh, ctx.cache, ctx.host, ctx.res, epoch, ctx.settings.timeout, prune)
    except BaseException:
        ctx.refresh = None  # the workers were killed with it
        raise
    if done:
        ctx.reads.drop_reader()
    return done
