"""The epoch runner: runs each epoch of a started loader, from its plan to its last batch.

One :class:`EpochRunner` per started loader. For each epoch it settles what a
broken-off epoch left (:mod:`loader.cache.pending`), plans the epoch
(:mod:`loader.epochs.planner`), picks its kind once
(:func:`loader.epochs.kinds.kind_of`: compute, generate, read, refresh or
rotate) and serves the batches the kind yields, timed, with a progress bar
where the kind computes samples, moved to the device. Where samples are
computed (this process or the workers, :mod:`loader.epochs.places`) is
chosen once, when the loader starts. The path of a batch is described in
``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict
from typing import Iterator

from cachestore.errors import BudgetExceededError

from ..cache.controller import CacheController
from ..cache.pending import settle
from ..cache.policy import explain
from ..dataset import Batch, BatchFn
from ..distributed import ConsumerLayout
from ..errors import FailedBatch, WorkerError
from ..executors.positions import StreamAt
from ..executors.stream_turn import InlineStream
from ..executors.producer import BatchProducer
from ..heap import trim_heap
from ..progress import Progress
from ..settings import EpochMode, LoaderSettings, RotationSettings
from .context import EpochContext, EpochResources, RunState
from .kinds import EpochKind, kind_of
from .kinds.refresh import refreshed
from .kinds.stream import generated_again
from .kinds.stream_refresh import settle_stream_refresh
from .places import compute_place
from .plan import EpochPlan, EpochStats, ReadPlan
from .planner import plan_cluster_epoch, plan_epoch, stream_plan
from .prepare import prepare
from .windows import DiskWindow

log = logging.getLogger(__name__)

#: Epochs that show progress (see the ``progress`` argument) do once they take this many seconds.
PROGRESS_DELAY = 3.0


class EpochRunner:
    """Runs the epochs of one started loader (see the module docstring)."""

    def __init__(self, settings: LoaderSettings, layout: ConsumerLayout, producer: BatchProducer,
                 res: EpochResources, mover: BatchFn | None, stats: list[EpochStats]) -> None:
        cache = None
        if settings.cache is not None:
            cache = CacheController.open(settings.cache, layout, settings.dataset, settings.batch_size)
            res.store, res.remote = cache.store, cache.remote
            cache.decide_refresh(stream_ranks=settings.dataset.stream and layout.local_ranks > 1)
        self.ctx = EpochContext(settings, layout, producer, res, cache)
        self.place = compute_place(self.ctx)
        self.mover = mover
        self.stats = stats
        self._slots_sized = False  # shrink_slots ran at the end of the last epoch
        # (epoch, its legs (ranks, batches served when they stopped)) of a resumed state on a node's ranks
        self._ranks_before: tuple[int, tuple[tuple[int, int], ...]] | None = None
        self._stream_resume: tuple[int, int, StreamAt] | None = None  # (epoch, batches served, where) loaded
        self._generated: tuple[int, int] | None = None  # (epoch, batches served) of a stream's generate epoch loaded
        # (epoch, batches served, batches past them served out of order) of the epoch being planned
        self._ahead: tuple[int, int, frozenset[int]] | None = None
        self._blocks_before: tuple[int, bool] | None = None  # (epoch, served in block order) of a loaded state
        self._unpruned: int | None = None  # a generation committed early; older ones go at its first epoch
        if settings.rotation is not None:
            self.ctx.open_window()
        if not settings.dataset.stream:  # a stream's workers start at its first epoch that iterates it
            self.place.start()

    @property
    def layout(self) -> ConsumerLayout:
        return self.ctx.layout

    @property
    def state(self) -> RunState:
        return self.ctx.state

    def num_batches(self) -> int:
        """Batches per epoch (rotation serves each sample R times)."""
        return self.ctx.num_batches()

    # planning -------------------------------------------------------------------
    def plan(self, epoch: int, skip: int = 0) -> EpochPlan:
        """What epoch `epoch` does; the first `skip` batches were served before a resume."""
        ctx, layout, s = self.ctx, self.ctx.layout, self.ctx.settings
        if ctx.cache is None and layout.changes_per_epoch:
            ctx.indices = layout.partition(epoch)
        ranks = None
        if layout.node_scope:
            before = self._ranks_before if self._ranks_before is not None and self._ranks_before[0] == epoch else None
            ranks = (layout.local_ranks, layout.local_rank, before[1] if before is not None else
                     ((layout.local_ranks, skip),), layout.batches(s.batch_size, s.drop_last))
        unknown = s.dataset.stream and not layout.num_samples  # a stream not written yet: it skips by itself
        rotates = ctx.state.rotation is not None
        # Every read of the store the plan needs, before it: planning itself does no I/O.
        ready = prepare(ctx.cache, epoch, lambda generation: refreshed(ctx, generation, epoch)) \
            if ctx.cache is not None and not ctx.cache.off and not rotates else None
        if ready is not None and layout.whole and layout.nodes > 1 and s.sampling is None:
            # Several nodes whose stores each hold the whole dataset (a cache with a remote).
            assert ctx.cache is not None
            plan = plan_cluster_epoch(epoch, skip, s, ctx.indices, ctx.state.seed, ctx.cache, layout, ready,
                                      ranks[2] if ranks is not None else ())
        else:
            plan = plan_epoch(epoch, 0 if unknown else skip, s, ctx.indices, ctx.state.seed, rotates, ctx.cache,
                              ready, ranks, shuffled_part=ctx.cache is None and layout.changes_per_epoch,
                              blocks_before=self._blocks_before[1] if self._blocks_before is not None
                              and self._blocks_before[0] == epoch else True)
        if s.read_transform is not None:
            plan.transform_seed = ctx.state.seed
        if s.seeds_draws:
            plan.draws_seed = ctx.state.seed
        if not s.dataset.stream:
            return plan
        resume = self._stream_resume
        at = resume[2] if resume is not None and resume[:2] == (epoch, skip) else None
        if isinstance(plan, ReadPlan) and self._generated == (epoch, skip):
            return generated_again(plan, skip, s, ctx.state.seed, at)
        return stream_plan(plan, skip, s, ctx.state.seed, at)

    def choose(self, epoch: int, skip: int = 0) -> EpochKind:
        """Epoch `epoch`, planned, as an object of its kind (chosen here, once)."""
        return kind_of(self.ctx, self.place, self._passed(self.plan(epoch, skip)))

    def _passed(self, plan: EpochPlan) -> EpochPlan:
        """`plan` without the batches a resumed epoch served out of order before its stop (``in_order=False``):
        a read leaves them out; an epoch that computes keeps them where they are (a generate epoch writes
        them, and a sampler's redraws count batches by their place) and does not serve them."""
        ahead = self._ahead
        if ahead is None or ahead[0] != plan.epoch or not ahead[2]:
            return plan
        skip, numbers = ahead[1], ahead[2]
        if isinstance(plan, ReadPlan):
            plan.batches = [b for k, b in enumerate(plan.batches) if skip + k not in numbers]
        else:  # checked when the state was loaded: no stream, no rotation
            plan.ahead = frozenset(n - skip for n in numbers)
        return plan

    def in_blocks(self, epoch: int) -> bool:
        """Whether `epoch` serves its batches in block order (a state says so: resumed by an epoch that
        reads, its rest comes in the order it began in)."""
        last = self.stats[-1] if self.stats else None
        if last is not None and last.epoch == epoch:
            return last.extra.get("read_order") == "block"
        before = self._blocks_before
        return before[1] if before is not None and before[0] == epoch else False

    def ranks_history(self, epoch: int) -> tuple[tuple[int, int], ...]:
        """The legs of `epoch` on other numbers of ranks than this node's, for its state (see ``make_state``)."""
        before = self._ranks_before
        if before is None or before[0] != epoch:
            return ()
        legs = before[1]
        return legs[:-1] if legs[-1][0] == self.ctx.layout.local_ranks else legs

    def out_of_order(self, epoch: int) -> list[int]:
        """The batches of `epoch` served out of order so far (``in_order=False``), by their place after the
        batches a resume skipped, in the order served; empty where it serves in order."""
        last = self.stats[-1] if self.stats else None
        return last.positions if last is not None and last.epoch == epoch else []

    # running ----------------------------------------------------------------------
    def run(self, epoch: int, skip: int = 0, ahead: frozenset[int] = frozenset()) -> Iterator[Batch]:
        """The batches of `epoch` from batch `skip` on but those in `ahead`, in order (out of order with
        ``in_order=False``; a generator: see ``docs/ARCHITECTURE.md``)."""
        start = time.perf_counter()
        self._ahead = (epoch, skip, ahead)
        ctx = self.ctx
        if not settle(ctx.host, ctx.res, ctx.cache, ctx.refresh, ctx.pending, ctx.settings.timeout, epoch):
            ctx.refresh = None
        if not self._slots_sized:  # the last epoch was broken off (or this is the first)
            ctx.host.shrink_slots()
        self._slots_sized = False
        waited = settle_stream_refresh(ctx, epoch)  # a stream's next generation, written in the background
        self._prune_before(epoch)
        kind = self.choose(epoch, skip)
        plan = kind.plan
        stats = EpochStats(epoch, plan.mode, plan.generation, extra={**plan.notes, **waited})
        stats.wait_seconds = time.perf_counter() - start  # finishing a background refresh, if any
        self.stats.append(stats)
        if ctx.res.executor is not None:
            ctx.res.executor.begin_epoch()  # max_worker_restarts counts per epoch
        kind.begin(stats)
        yield from self._serve(kind, stats, start)
        self._commit_refresh(epoch, stats)
        if ctx.retire_workers:
            # As the epoch ends (the loop may validate before the next one), once what it held here
            # (its plan, its build) is freed: fresh forks would share those pages, and keep them alive
            # after this process freed them (docs/ARCHITECTURE.md, "Memory with many workers").
            del kind, plan
            ctx.retire_workers = False
            ctx.host.retire()
            trim_heap()  # what the epoch's batches freed, kept by the allocator (loader/heap.py)

    def _commit_refresh(self, epoch: int, stats: EpochStats) -> None:
        """As the last epoch of a generation ends: commit the next one now where a background refresh handed out
        all of it (waiting for its last chunks), so that the next epoch's first batch waits only for its own
        reads (docs/epochs.md, "Epoch plan"). Its time counts as this epoch's wait. The older generations stay
        until the new one's first epoch (:meth:`_prune_before`): the loop may go back to an epoch of theirs
        (``set_epoch``) first."""
        ctx, refresh = self.ctx, self.ctx.refresh
        if (refresh is None or refresh.todo or refresh.failed is not None or ctx.cache is None
                or ctx.cache.generation_for(epoch + 1) != refresh.generation):
            return
        t0 = time.perf_counter()
        if refreshed(ctx, refresh.generation, epoch + 1, prune=False):
            self._unpruned = refresh.generation
        stats.wait_seconds += time.perf_counter() - t0

    def _prune_before(self, epoch: int) -> None:
        """At the first epoch of a generation committed early (:meth:`_commit_refresh`): prune the older ones."""
        cache, generation = self.ctx.cache, self._unpruned
        if cache is None or generation is None or cache.generation_for(epoch) < generation:
            return
        self._unpruned = None
        removed = cache.store.prune(keep=1)
        log.info("epoch %d reads generation %d, committed as the epoch before it ended; pruned %d old item(s)",
                 epoch, generation, len(removed))

    def _serve(self, kind: EpochKind, stats: EpochStats, start: float) -> Iterator[Batch]:
        """The batches `kind` yields, timed (the training loop's time is not the epoch's), moved."""
        ctx, t0 = self.ctx, start
        # Cached epochs are fast: only epochs that compute samples show progress.
        progress = Progress(kind.total(), f"epoch {stats.epoch} ({stats.mode})", enabled=ctx.settings.progress,
                            delay=PROGRESS_DELAY) if kind.shows_progress else None
        batches = kind.batches(stats)
        try:
            for batch in batches:
                if progress is not None:
                    progress.update(stats.samples - progress.done)
                wait = time.perf_counter()
                yield self.mover(batch) if self.mover is not None and not isinstance(batch, FailedBatch) else batch
                t0 += time.perf_counter() - wait  # time spent in the training loop is not ours
            # Now, not at the next epoch's start: the loop may validate or checkpoint in between,
            # and a deep epoch's spare slots would be held meanwhile.
            ctx.host.shrink_slots()
            self._slots_sized = True
            ctx.reads.epoch_ended(stats)
        except BudgetExceededError as exc:
            raise explain(exc)
        except WorkerError:
            ctx.drop_workers()
            raise
        finally:
            if progress is not None:
                progress.close()
            stats.seconds = time.perf_counter() - t0
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # a broken-off epoch: its kind keeps what it wrote, now (its `finally`)

    # resuming --------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, object] | None, dict[str, object] | None]:
        """The cache plan and the rotation fallback, as plain values (see :mod:`loader.state`)."""
        ctx = self.ctx
        cache = ctx.cache.snapshot() if ctx.cache is not None else None
        return cache, asdict(ctx.state.fallback) if ctx.state.fallback is not None else None

    def generating(self, epoch: int) -> bool:
        """Whether `epoch` is a stream's generate epoch (or one resumed after its generation was committed):
        its batches are those the stream made (see :func:`loader.epochs.kinds.stream.generated_again`)."""
        last = self.stats[-1] if self.stats else None
        return self.ctx.settings.dataset.stream and last is not None and last.epoch == epoch and (
            last.mode is EpochMode.GENERATE or (self._generated is not None and self._generated[0] == epoch))

    def window_path(self) -> str | None:
        """Where the disk rotation window lives (a resumed run adopts it), ``None`` for none."""
        window = self.ctx.res.window
        return str(window.path) if isinstance(window, DiskWindow) else None

    def prime(self, epoch: int, skip: int) -> None:
        """At ``iter()``: a stream this process iterates in this epoch (every epoch without a cache; with
        one, while nothing is committed) opens the epoch's iterator now, as torch's single-process
        iterator does, so that a state taken before the first batch holds the iterator's own state
        (torchdata's; :meth:`InlineStream.prime`)."""
        ctx, s = self.ctx, self.ctx.settings
        iterates = s.cache is None or (ctx.cache is not None and not ctx.cache.off and not ctx.layout.num_samples)
        if (skip == 0 and s.nb_worker == 0 and s.dataset.stream and iterates and s.rotation is None
                and (self._stream_resume is None or self._stream_resume[0] != epoch)):
            streams = ctx.streams()
            assert isinstance(streams, InlineStream)
            at = streams.prime(epoch)
            ctx.stream_at = (epoch, 0, at) if at is not None else None

    def restore(self, seed: int, cache: dict[str, object] | None, fallback: dict[str, object] | None,
                window: str | None, epoch: int, applied: int, ranks: int | None = None,
                stream: StreamAt | None = None, generating: bool = False,
                history: tuple[tuple[int, int], ...] = (), blocks: bool = True) -> None:
        """Continue the run a state was taken from: its seed, its cache plan, its rotation window,
        (a store shared by a node's ranks) how many ranks split the epoch it stopped in, and where a
        stateful stream's copies were."""
        ctx = self.ctx
        self._stream_resume = (epoch, applied, stream) if stream is not None else None
        self._generated = (epoch, applied) if generating else None
        ctx.state.seed = ctx.layout.seed = seed
        self._blocks_before = (epoch, blocks)
        if ranks is not None:
            self._ranks_before = (epoch, history + ((ranks, applied),))
        if cache is not None and ctx.cache is not None:
            ctx.cache.restore(cache)
        if fallback is not None and ctx.state.fallback is None and ctx.cache is not None:
            ctx.state.rotation = ctx.state.fallback = RotationSettings(**fallback)  # type: ignore[arg-type]
            ctx.cache.disable()
            ctx.open_window()
        current = ctx.res.window
        # Take over a stopped run's disk window when it stopped exactly after `applied` batches of `epoch`.
        if window is not None and applied > 0 and isinstance(current, DiskWindow):
            current.adopt(window, epoch, applied)
