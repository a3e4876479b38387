"""A stream's read epochs while its next generation is written in the background.

With ``update_frequency=K`` and ``background_refresh`` on, a read epoch of a
stream's generation ``g`` starts :class:`~loader.cache.stream_refresh.StreamRefresh`
(the stream iterated by its otherwise idle workers into ``g + 1``) when
``g + 1`` is due and not committed; the first epoch of ``g + 1`` waits for
it (:func:`settle_stream_refresh`, before it is planned) and reads it, or,
where it failed, iterates the stream itself as a generate epoch
(``docs/ARCHITECTURE.md``, "Streams").
"""

from __future__ import annotations

import logging

from cachestore import GenerationInfo, GenerationWriter
from cachestore.errors import GenerationCommitted, StoreLockedError

from ...cache.stream_refresh import StreamRefresh
from ...executors.stream_turn import StreamTurn
from ..context import EpochContext
from ..plan import EpochStats, ReadPlan
from ..reads.base import ReadPath
from .read import ReadEpoch

log = logging.getLogger(__name__)


class StreamRefreshEpoch(ReadEpoch):
    """A read epoch of a stream's generation that starts writing the next one in the background."""

    @staticmethod
    def applies(ctx: EpochContext, plan: ReadPlan) -> bool:
        """Whether read epoch `plan` of a stream may start a refresh (or one runs): refreshes are on."""
        return (ctx.settings.dataset.stream and ctx.cache is not None and ctx.settings.nb_worker > 0
                and (ctx.stream_refresh is not None or not ctx.cache.refresh_off))

    def path(self, stats: EpochStats) -> ReadPath:
        # The read path first: workers it starts are not forked while the refresh thread holds a lock.
        path = super().path(stats)
        ctx, plan = self.ctx, self.plan
        assert plan.generation is not None
        if ctx.stream_refresh is None:
            ctx.stream_refresh = start_stream_refresh(ctx, plan.generation, plan.epoch)
        if ctx.stream_refresh is not None:
            stats.extra["stream_refresh_of"] = ctx.stream_refresh.generation  # the generation it writes
        return path


def start_stream_refresh(ctx: EpochContext, generation: int, epoch: int) -> StreamRefresh | None:
    """At read epoch `epoch` of `generation`, the stream iterated into the next generation, if it is due."""
    cache = ctx.cache
    assert cache is not None
    target = cache.refresh_target(generation)
    info = cache.committed().get(generation)
    if target is None or info is None:
        return None
    streams = ctx.streams()  # started here, in this thread, before the refresh's thread uses them
    assert isinstance(streams, StreamTurn)  # applies(): nb_worker > 0
    try:
        writer = cache.store.writer(target, None)
    except (StoreLockedError, GenerationCommitted) as exc:
        # Another job writes this store, or committed `target` since committed() was read (a loader
        # open on the same prefix): the epoch of `target` waits for it or reads it, as without a refresh.
        log.info("no background refresh of generation %d: %s", target, exc)
        return None
    log.info("epoch %d reads generation %d while the stream workers write generation %d in the background",
             epoch, generation, target)
    def commit(done: GenerationWriter) -> GenerationInfo | None:
        return cache.commit(done, epoch, background=True, prune=False, stream=True)

    refresh = StreamRefresh(target, writer, streams, cache.settings.stream_samples, info.num_samples, commit,
                            ctx.state.seed)
    ctx.res.open_work.run(refresh)  # stopped before the stream workers close, if the loader goes first
    return refresh


def settle_stream_refresh(ctx: EpochContext, epoch: int) -> dict[str, object]:
    """Before `epoch` is planned: where it is the first epoch of the generation a stream's refresh writes,
    wait for the refresh; its generation is then committed (older ones pruned) and read, or the epoch
    iterates the stream itself. Notes for the epoch's stats."""
    refresh, cache = ctx.stream_refresh, ctx.cache
    if refresh is None or cache is None or cache.generation_for(epoch) < refresh.generation:
        return {}
    ctx.stream_refresh = None
    ctx.res.open_work.drop(refresh)
    waited = refresh.wait()
    if refresh.info is None:
        log.warning("background refresh of generation %d of the stream failed (%s): epoch %d iterates the "
                    "stream instead", refresh.generation, refresh.failed, epoch)
        return {"stream_refresh": "failed"}
    # Now, not at the commit: the epochs before this one still read the older generation.
    removed = cache.store.prune(keep=1)
    ctx.reads.drop_reader()
    log.info("epoch %d reads generation %d of the stream, written in the background (%d samples, %d bytes%s); "
             "pruned %d old item(s)", epoch, refresh.info.id, refresh.info.num_samples, refresh.info.nbytes,
             f", epoch {epoch} waited {waited:.2f} s for it" if waited > 0.01 else "", len(removed))
    return {"stream_refresh": "waited" if waited > 0.01 else "ready", "stream_refresh_wait": round(waited, 3),
            "stream_refresh_cpu": round(refresh.cpu_seconds, 3)}
