"""The epoch runner: runs each epoch of a started loader, from its plan to its last batch.

One :class:`EpochRunner` per started loader. For each epoch it settles what a
broken-off epoch left (:mod:`loader.cache.pending`), plans the epoch
(:mod:`loader.epochs.planner`), opens the generation a generate epoch writes,
runs the batches - inline (:mod:`loader.epochs.inline`), on the executor
(:mod:`loader.epochs.scheduler`), by the read path chosen for a read epoch
(:mod:`loader.epochs.reads`), or through a rotation window
(:mod:`loader.epochs.rotation`) - and commits at the end, or applies the
budget policy (:mod:`loader.cache.policy`). A background refresh
(:mod:`loader.cache.refresh`) uses the workers' idle time during read epochs.
The path of a batch is described in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import time
from dataclasses import asdict, dataclass
from typing import Iterator

import numpy as np

from cachestore import codec
from cachestore.collate import stack_samples
from cachestore.errors import BudgetExceededError, GenerationCommitted, GenerationNotFoundError

from ..cache.build import GenerationBuild
from ..cache.controller import CacheController
from ..cache.pending import keep_or_commit, settle
from ..cache.policy import close_generation, give_up_caching
from ..cache.refresh import BackgroundRefresh, complete_refresh, start_refresh
from ..dataset import Batch, BatchFn, Sample
from ..executors.host import ExecutorHost
from ..errors import add_note
from ..executors.producer import BatchProducer
from ..progress import Progress
from ..resources import Resources
from ..settings import BudgetPolicy, EpochMode, LoaderSettings, RotationSettings
from .inline import run_inline
from ..distributed import ConsumerLayout

from .planner import plan_epoch
from .plan import EpochPlan, EpochStats
from .reads.paths import ReadPaths
from .reads.workers import WorkerReads
from .rotation import batch_sizes, rotation_epoch
from .scheduler import PoolRun, run_pool
from .windows import DiskWindow, MemoryWindow

log = logging.getLogger(__name__)

#: Batches read ahead per worker in cached epochs (like torch's prefetch_factor=2).
READ_AHEAD_PER_WORKER = 2
#: Epochs that show progress (see the ``progress`` argument), once they take this many seconds.
PROGRESS_MODES = (EpochMode.GENERATE, EpochMode.ROTATE)
PROGRESS_DELAY = 3.0


@dataclass
class RunState:
    """What changes while a loader runs (its settings never do)."""

    seed: int  # the settings', or a loaded state's
    rotation: RotationSettings | None  # the window epochs rotate through: the settings', or `fallback`
    fallback: RotationSettings | None = None  # the window on_budget_exceeded="rotate" switched to


class EpochRunner:
    """Runs the epochs of one started loader (see the module docstring)."""

    def __init__(self, settings: LoaderSettings, layout: ConsumerLayout, producer: BatchProducer,
                 res: Resources, mover: BatchFn | None, stats: list[EpochStats]) -> None:
        self.settings = settings
        self.layout = layout
        self.producer = producer
        self.res = res
        self.mover = mover
        self.stats = stats
        self.state = RunState(settings.seed, settings.rotation)
        self.indices = layout.partition(0)
        self.host = ExecutorHost(settings, producer, res)
        self.reads = ReadPaths(producer, res, settings.nb_worker, settings.batch_size)
        self.cache: CacheController | None = None
        self.refresh: BackgroundRefresh | None = None
        self._slots_sized = False  # shrink_slots ran at the end of the last epoch
        self._filling: BackgroundRefresh | None = None  # a sampler's generate epoch: what it never draws
        self._ranks_before: tuple[int, int] | None = None  # (epoch, ranks of the node) a resumed state had
        if settings.cache is not None:
            self.cache = CacheController.open(settings.cache, layout, settings.dataset, settings.batch_size)
            res.store = self.cache.store
            self.cache.decide_refresh(settings.nb_worker)
        if settings.rotation is not None:
            self.open_window()
        if settings.nb_worker > 0:
            self.host.ensure()
        elif settings.timeout is not None:
            log.info("timeout=%g has no effect with nb_worker=0: the dataset runs in the training process, "
                     "which cannot interrupt it", settings.timeout)

    # parts -------------------------------------------------------------------
    def open_window(self) -> None:
        rotation = self.state.rotation
        assert rotation is not None
        slots = rotation.window(len(self.indices), self.settings.batch_size)
        self.res.window = (DiskWindow(rotation.prefix, slots) if rotation.medium == "disk" and rotation.prefix
                           else MemoryWindow(slots))

    def kill_executor(self) -> None:
        """After a worker error: stop the workers now (the next epoch starts new ones), keep open builds."""
        self.host.kill()
        self.refresh = None

    def num_batches(self) -> int:
        """Batches per epoch (rotation serves each sample R times)."""
        s, rotation = self.settings, self.state.rotation
        if rotation is not None:
            return len(batch_sizes(len(self.indices), rotation.rotation, s.batch_size, s.drop_last))
        return self.layout.batches(s.batch_size, s.drop_last)

    def plan(self, epoch: int, skip: int = 0) -> EpochPlan:
        """What epoch `epoch` does; the first `skip` batches were served before a resume."""
        if self.cache is None and self.layout.changes_per_epoch:
            self.indices = self.layout.partition(epoch)
        ranks = None
        if self.layout.node_scope:
            before = self._ranks_before if self._ranks_before is not None and self._ranks_before[0] == epoch else None
            ranks = (self.layout.local_ranks, self.layout.local_rank,
                     before[1] if before is not None else self.layout.local_ranks,
                     self.layout.batches(self.settings.batch_size, self.settings.drop_last))
        plan = plan_epoch(epoch, skip, self.settings, self.indices, self.state.seed,
                          self.state.rotation is not None, self.cache, self._refreshed, ranks)
        if self.settings.read_transform is not None:
            plan.transform_seed = self.state.seed
        return plan

    def _refreshed(self, generation: int, epoch: int) -> bool:
        refresh = self.refresh
        if refresh is None or refresh.generation != generation or self.cache is None:
            return False
        self.refresh = None
        try:
            done = complete_refresh(refresh, self.cache, self.host, epoch, self.settings.timeout)
        except BaseException:
            self.refresh = None  # the workers were killed with it
            raise
        if done:
            self.reads.drop_reader()
        return done

    # running ----------------------------------------------------------------------
    def run(self, epoch: int, skip: int = 0) -> Iterator[Batch]:
        """The batches of `epoch` from batch `skip` on, in order (a generator: see ``docs/ARCHITECTURE.md``)."""
        start = time.perf_counter()
        if not settle(self.host, self.cache, self.refresh, self.settings.timeout, epoch):
            self.refresh = None
        if not self._slots_sized:  # the last epoch was broken off (or this is the first)
            self.host.shrink_slots()
        self._slots_sized = False
        plan = self.plan(epoch, skip)
        if plan.mode == EpochMode.GENERATE:
            assert self.cache is not None and plan.generation is not None
            if self.refresh is not None:
                # set_epoch jumped past the generation the refresh computes: it holds the writer.
                log.info("epoch %d writes generation %d: the background refresh of generation %d stops (what it "
                         "computed is kept)", epoch, plan.generation, self.refresh.generation)
                self.kill_executor()
            try:
                executor = self.host.ensure() if self.settings.nb_worker > 0 else None
                self.res.build = self.cache.open_build(plan.generation, self.settings.use_threading,
                                                       executor=executor)
            except BudgetExceededError as exc:
                self.apply_policy(give_up_caching(self.cache, exc))
                plan = self.plan(epoch, skip)
            except GenerationCommitted:
                plan = self.plan(epoch, skip)  # the other processes writing it committed it: read it
        stats = EpochStats(epoch, plan.mode, plan.generation, extra=dict(plan.notes))
        if plan.read_order is not None:
            stats.extra["read_order"] = plan.read_order
        stats.wait_seconds = time.perf_counter() - start  # finishing a background refresh, if any
        self.stats.append(stats)
        if self.res.executor is not None:
            self.res.executor.begin_epoch()  # max_worker_restarts counts per epoch
        build = self.res.build
        if plan.mode == EpochMode.GENERATE and build is not None and build.adopted:
            # Samples an interrupted attempt wrote: those this epoch does not serve need no work.
            plan.unserved = [b for b in map(build.missing, plan.unserved) if len(b)]
            if plan.fill is not None:
                plan.fill = build.missing(plan.fill)
            stats.extra["adopted"] = build.adopted
        if plan.mode == EpochMode.GENERATE and build is not None and build.made_room:
            stats.extra["made_room"] = ",".join(map(str, build.made_room))
        finished = False
        t0 = start
        total = (len(plan.indices) * self.state.rotation.rotation if self.state.rotation is not None
                 else sum(len(b) for b in plan.batches))
        # Cached epochs are fast: only epochs that compute samples show progress.
        progress = Progress(total, f"epoch {epoch} ({plan.mode})", enabled=self.settings.progress,
                            delay=PROGRESS_DELAY) if plan.mode in PROGRESS_MODES else None
        try:
            for batch in self._batches(plan, stats, build):
                if progress is not None:
                    progress.update(stats.samples - progress.done)
                wait = time.perf_counter()
                yield self.mover(batch) if self.mover is not None else batch
                t0 += time.perf_counter() - wait  # time spent in the training loop is not ours
            if build is not None and self._filling is not None and not self._filling.done:
                # What the sampler did not draw and idle workers have not computed yet: the epochs that
                # follow complete the generation (and commit it); the loop waits only for the chunks in
                # flight (then every sample written is accounted for, and the generation can be kept).
                filling, self._filling = self._filling, None
                stats.extra["fill_left"] = sum(len(chunk) for chunk in filling.todo)  # for the next epochs
                try:
                    filling.drain(self.host.ensure(), self.settings.timeout)
                except BaseException:
                    self.kill_executor()
                    raise
                self._break_off(build, epoch)
            elif build is not None:
                self.finish_generation(plan, build, stats)
            finished = True
            # Now, not at the next epoch's start: the loop may validate or checkpoint in between,
            # and a deep epoch's spare slots would be held meanwhile.
            self.host.shrink_slots()
            self._slots_sized = True
            self.reads.epoch_ended(stats)
        except BudgetExceededError as exc:
            if build is not None:  # a generation that does not fit is not worth keeping
                self.res.build = None
                build.abort()
            raise CacheController.explain(exc)
        except GenerationNotFoundError as exc:
            if plan.mode == EpochMode.READ:
                add_note(exc, f"Generation {plan.generation} was removed while epoch {epoch} read it (by `cachestore "
                             "prune`, or by a run that committed a newer one on the same prefix); the next "
                             "epoch reads a newer generation or writes it again.")
                self.reads.drop_reader()
            raise
        finally:
            if progress is not None:
                progress.close()
            stats.seconds = time.perf_counter() - t0
            if not finished and self.res.build is not None:
                self._break_off(self.res.build, epoch)

    def _break_off(self, build: GenerationBuild, epoch: int) -> None:
        """A broken-off or failed epoch keeps what it wrote. Workers may still be running its tasks:
        the build is kept (or committed, when they complete it) once they are done."""
        self.res.build = None
        build.epoch = epoch
        if self.res.executor is not None and self.settings.nb_worker > 0:
            build.detach()
            self.res.pending.append(build)
        else:
            self.producer.close_shard()
            keep_or_commit(build, self.cache)

    def _batches(self, plan: EpochPlan, stats: EpochStats, build: GenerationBuild | None) -> Iterator[Batch]:
        s, store = self.settings, self.res.store
        if plan.mode == EpochMode.ROTATE:
            return self.rotation_batches(plan, stats)
        if plan.mode == EpochMode.READ:
            assert store is not None and plan.generation is not None
            if plan.stream or s.nb_worker == 0 or not store.backend.persistent:  # no worker reads it
                return self.reads.choose(plan, stats, store, None).batches(plan, stats)
        elif s.nb_worker == 0:
            return run_inline(plan, self.producer, build, stats)
        executor = self.host.ensure()
        run = PoolRun(executor, self.host.slot_pool(), s.max_queue_size, self.kill_executor,
                      s.max_minibatch_length, s.prefetch_time if plan.epoch == 0 else None, build=build,
                      timeout=s.timeout, split_ends=plan.mode != EpochMode.READ,
                      collate_fn=s.collate_fn or stack_samples)
        if build is not None:
            build.attach(executor)
        self._filling = None
        if plan.fill is not None and len(plan.fill) and build is not None:
            # Indices the sampler does not draw, computed by workers with nothing else to do.
            self._filling = run.background = BackgroundRefresh(build, plan.indices, max(1, s.batch_size // 8),
                                                               s.nb_worker, positions=plan.fill,
                                                               flush_when_done=False)
        if plan.mode == EpochMode.READ:
            assert store is not None and self.cache is not None and plan.generation is not None
            if self.refresh is None:
                self.refresh = start_refresh(self.cache, self.host, self.indices, plan.generation, s.batch_size)
            run.reader = (store.spec, plan.generation, plan.committed_at)
            run.background = self.refresh
            # Reading a batch takes milliseconds: a deep queue would only hold memory.
            run.max_in_flight = min(s.max_queue_size, READ_AHEAD_PER_WORKER * s.nb_worker + 2)
            if self.refresh is None:  # a refresh needs the workers' idle time: they gather then
                return self.reads.choose(plan, stats, store, WorkerReads(run)).batches(plan, stats)
            stats.extra["gather"] = "workers"
        return run_pool(plan, run, stats)

    def rotation_batches(self, plan: EpochPlan, stats: EpochStats) -> Iterator[Batch]:
        s, rotation, window = self.settings, self.state.rotation, self.res.window
        assert rotation is not None and window is not None
        if s.nb_worker == 0:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
                for indices in arrays:
                    yield self.producer.samples(indices, plan.epoch)
        else:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list[Sample]]:
                compute = EpochPlan(plan.epoch, EpochMode.COMPUTE, None, arrays, np.arange(self.layout.num_samples))
                run = PoolRun(self.host.ensure(), self.host.slot_pool(), s.max_queue_size, self.kill_executor,
                              s.max_minibatch_length, collate=False, timeout=s.timeout)
                return run_pool(compute, run, stats)
        return rotation_epoch(plan, stats, rotation.rotation, window, s.batch_size, s.drop_last, self.state.seed,
                              fresh, s.collate_fn or stack_samples, s.read_transform)

    def finish_generation(self, plan: EpochPlan, build: GenerationBuild, stats: EpochStats) -> None:
        """End of a generate epoch: commit, or give up caching as the budget policy says."""
        assert self.cache is not None
        self.res.build = None
        executor = self.res.executor if self.settings.nb_worker > 0 else None
        policy = close_generation(build, self.cache, executor, plan.epoch)
        if policy is None:
            self.reads.drop_reader()
            # Written together with other processes, one of them commits it (maybe not this one).
            stats.committed = build.writer.state == "committed"
        else:
            self.apply_policy(policy)

    def apply_policy(self, policy: BudgetPolicy) -> None:
        """Caching gave up (:mod:`loader.cache.policy`); ``"rotate"`` switches to a window that fits."""
        if policy is not BudgetPolicy.ROTATE:
            return
        assert self.cache is not None
        self.state.rotation = self.state.fallback = self.cache.rotation_fallback(self.sample_bytes(),
                                                                                 len(self.indices))
        self.open_window()
        rotation, window = self.state.rotation, self.res.window
        assert window is not None
        log.warning("the cache of %d samples does not fit the disk budget of %s: switching to %s rotation "
                    "(rotation=%d, window of %d samples%s); an epoch now serves %d batches",
                    len(self.indices), self.cache.store.path, rotation.medium, rotation.rotation, window.slots,
                    f" under {rotation.prefix}" if rotation.prefix else "", self.num_batches())

    def sample_bytes(self) -> int:
        """Bytes one sample takes as a record (one dataset call in this process)."""
        sample = self.producer.dataset[int(self.indices[0])] if len(self.indices) else None
        return len(codec.encode_record(*codec.flatten(sample, allow_pickle=True)))

    # resuming --------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict[str, object] | None, dict[str, object] | None]:
        """The cache plan and the rotation fallback, as plain values (see :mod:`loader.state`)."""
        cache = self.cache.snapshot() if self.cache is not None else None
        return cache, asdict(self.state.fallback) if self.state.fallback is not None else None

    def window_path(self) -> str | None:
        """Where the disk rotation window lives (a resumed run adopts it), ``None`` for none."""
        window = self.res.window
        return str(window.path) if isinstance(window, DiskWindow) else None

    def restore(self, seed: int, cache: dict[str, object] | None, fallback: dict[str, object] | None,
                window: str | None, epoch: int, applied: int, ranks: int | None = None) -> None:
        """Continue the run a state was taken from: its seed, its cache plan, its rotation window, and
        (a store shared by a node's ranks) how many ranks split the epoch it stopped in."""
        self.state.seed = self.layout.seed = seed
        if ranks is not None:
            self._ranks_before = (epoch, ranks)
        if cache is not None and self.cache is not None:
            self.cache.restore(cache)
        if fallback is not None and self.state.fallback is None and self.cache is not None:
            self.state.rotation = self.state.fallback = RotationSettings(**fallback)  # type: ignore[arg-type]
            self.cache.disable()
            self.open_window()
        current = self.res.window
        # Take over a stopped run's disk window when it stopped exactly after `applied` batches of `epoch`.
        if window is not None and applied > 0 and isinstance(current, DiskWindow):
            current.adopt(window, epoch, applied)
