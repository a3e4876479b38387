"""The epoch runner: plans each epoch and runs it inline, on the executor, or through a rotation window.

One :class:`EpochRunner` per started loader. It asks the
:class:`~loader.cache.CacheController` which generation an epoch uses, opens a
:class:`~loader.generation.GenerationBuild` for a generate epoch, runs the
batches (:mod:`loader.epoch`, :mod:`loader.rotation`), composes a
:class:`~loader.refresh.BackgroundRefresh` during cached epochs, and commits or
aborts at the end. The path of a batch is described in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Callable, Iterator

import numpy as np

from cachestore.collate import stack_samples
from cachestore.errors import BudgetExceededError

from . import sampler
from .cache import CacheController
from .epoch import EpochPlan, EpochStats, PoolRun, run_inline, run_pool
from .executor import Executor, WorkerConfigFactory
from .generation import GenerationBuild
from .layout import ConsumerLayout
from .pool import WorkerPool
from .refresh import BackgroundRefresh
from .resources import Resources
from .rotation import DiskWindow, MemoryWindow, batch_sizes, rotation_schedule, run_rotation
from .settings import BudgetPolicy, EpochMode, LoaderSettings
from .shm import SlotPool
from .worker import BatchProducer

log = logging.getLogger(__name__)

#: Batches read ahead per worker in cached epochs (like torch's prefetch_factor=2).
READ_AHEAD_PER_WORKER = 2
#: Samples per background-refresh chunk, as a fraction of a batch: small, so a batch waits little.
REFRESH_CHUNK_DIVISOR = 8


class EpochRunner:
    """Runs the epochs of one started loader (see the module docstring)."""

    def __init__(self, settings: LoaderSettings, layout: ConsumerLayout, producer: BatchProducer,
                 res: Resources, mover: Callable | None, stats: list[EpochStats]) -> None:
        self.settings = settings
        self.layout = layout
        self.producer = producer
        self.res = res
        self.mover = mover
        self.stats = stats
        self.indices = layout.partition(0)
        self.cache: CacheController | None = None
        self.refresh: BackgroundRefresh | None = None
        if settings.cache is not None:
            self.cache = CacheController.open(settings.cache, layout, settings.dataset_class,
                                              settings.dataset_params, settings.batch_size)
            res.store = self.cache.store
        if settings.rotation is not None:
            self.open_window()
        if settings.nb_worker > 0:
            self.ensure_executor()

    # parts -------------------------------------------------------------------
    def open_window(self) -> None:
        rotation = self.settings.rotation
        slots = rotation.window(len(self.indices), self.settings.batch_size)
        self.res.window = DiskWindow(rotation.prefix, slots) if rotation.medium == "disk" else MemoryWindow(slots)

    def ensure_executor(self) -> Executor:
        s, res = self.settings, self.res
        if res.executor is None:
            # The executor must not reference the loader: the finalizer that releases it
            # would then keep the loader alive forever.
            make_config = WorkerConfigFactory(s.dataset_class, s.dataset_params, s.collate_fn, s.gpu_indices,
                                              s.allow_pickle)
            if s.executor == "ray":
                # Imported here only: `import loader` never imports ray (an optional extra).
                from .ray_executor import RayExecutor

                res.executor = RayExecutor(make_config, s.executor_options, s.max_worker_restarts, self.producer)
            else:
                res.executor = WorkerPool(make_config, s.nb_worker, s.use_threading, s.start_method,
                                          s.max_worker_restarts)
        if res.slots is None:
            res.slots = SlotPool(min(s.max_queue_size, 4))
        return res.executor

    def kill_executor(self) -> None:
        """After a worker error: stop the workers now (the next epoch starts new ones), drop open builds."""
        executor, self.res.executor = self.res.executor, None
        if executor is not None:
            executor.kill()
        self.res.abort_builds()
        self.refresh = None

    def num_batches(self) -> int:
        s = self.settings
        n = len(self.indices)
        if s.rotation is not None:
            return len(batch_sizes(n, s.rotation.rotation, s.batch_size, s.drop_last))
        return sampler.num_batches(n, s.batch_size, s.drop_last)

    # the plan -------------------------------------------------------------------
    def plan(self, epoch: int) -> EpochPlan:
        s = self.settings
        if self.cache is None and self.layout.changes_per_epoch:
            self.indices = self.layout.partition(epoch)
        order = sampler.epoch_order(len(self.indices), epoch, s.seed, s.shuffle, s.nearby_shuffle)
        if s.rotation is not None:
            # Generation order: the i-th generated sample is dataset index indices[order[i]].
            return EpochPlan(epoch, EpochMode.ROTATE, None, [], self.indices[order])
        batches = sampler.split_batches(order, s.batch_size, s.drop_last)
        if self.cache is None or self.cache.off:
            return EpochPlan(epoch, EpochMode.COMPUTE, None, batches, self.indices)
        generation = self.cache.generation_for(epoch)
        mode = self.cache.mode_for(generation)
        if mode == EpochMode.GENERATE and self.refresh is not None and self.refresh.generation == generation:
            if self.complete_refresh(epoch):
                mode = EpochMode.READ
        return EpochPlan(epoch, mode, generation, batches, self.indices)

    # running ----------------------------------------------------------------------
    def run(self, epoch: int) -> Iterator[Any]:
        """The batches of `epoch`, delivered in order (a generator: see ``docs/ARCHITECTURE.md``)."""
        start = time.perf_counter()
        plan = self.plan(epoch)
        stats = EpochStats(epoch, plan.mode, plan.generation)
        stats.wait_seconds = time.perf_counter() - start  # finishing a background refresh, if any
        self.stats.append(stats)
        if self.res.executor is not None:
            self.res.executor.begin_epoch()  # max_worker_restarts counts per epoch
        if plan.mode == EpochMode.GENERATE:
            executor = self.ensure_executor() if self.settings.nb_worker > 0 else None
            self.res.build = self.cache.open_build(plan.generation, self.settings.use_threading, executor=executor)
        build = self.res.build
        finished = False
        t0 = start
        try:
            for batch in self._batches(plan, stats, build):
                wait = time.perf_counter()
                yield self.mover(batch) if self.mover is not None else batch
                t0 += time.perf_counter() - wait  # time spent in the training loop is not ours
            if build is not None:
                self.finish_generation(plan, build, stats)
            finished = True
        except BudgetExceededError as exc:
            raise CacheController.explain(exc)
        finally:
            stats.seconds = time.perf_counter() - t0
            if not finished and self.res.build is not None:
                build, self.res.build = self.res.build, None
                build.abort()  # a broken-off or failed epoch commits nothing

    def _batches(self, plan: EpochPlan, stats: EpochStats, build: GenerationBuild | None) -> Iterator[Any]:
        s, store = self.settings, self.res.store
        if plan.mode == EpochMode.ROTATE:
            return self.rotation_batches(plan, stats)
        if s.nb_worker == 0 or (plan.mode == EpochMode.READ and not store.backend.persistent):
            reader = store.reader(plan.generation) if plan.mode == EpochMode.READ else None
            return run_inline(plan, self.producer, reader, build, stats)
        executor = self.ensure_executor()
        run = PoolRun(executor, self.res.slots, s.max_queue_size, self.kill_executor, s.max_minibatch_length,
                      s.prefetch_time if plan.epoch == 0 else None, build=build)
        if build is not None:
            build.attach(executor)
        if plan.mode == EpochMode.READ:
            self.maybe_start_refresh(plan)
            run.reader = (store.spec, plan.generation)
            run.background = self.refresh
            # Reading a batch takes milliseconds: a deep queue would only hold memory.
            run.max_in_flight = min(s.max_queue_size, READ_AHEAD_PER_WORKER * s.nb_worker + 2)
        return run_pool(plan, run, stats)

    def rotation_batches(self, plan: EpochPlan, stats: EpochStats) -> Iterator[Any]:
        s, window = self.settings, self.res.window
        rng = np.random.default_rng([s.seed, plan.epoch, 2])
        schedule = rotation_schedule(len(plan.indices), s.rotation.rotation, window.slots, s.batch_size,
                                     s.drop_last, rng)
        window.reset()
        if s.nb_worker == 0:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                for indices in arrays:
                    yield [self.producer.dataset[int(i)] for i in indices]
        else:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                compute = EpochPlan(plan.epoch, EpochMode.COMPUTE, None, arrays, np.arange(self.layout.num_samples))
                run = PoolRun(self.ensure_executor(), self.res.slots, s.max_queue_size, self.kill_executor,
                              s.max_minibatch_length, collate=False)
                return run_pool(compute, run, stats)
        return run_rotation(schedule, plan.indices, window, fresh, s.collate_fn or stack_samples, stats, rng)

    def finish_generation(self, plan: EpochPlan, build: GenerationBuild, stats: EpochStats) -> None:
        """End of a generate epoch: commit, or give up caching as the budget policy says."""
        self.res.build = None
        executor = self.res.executor if self.settings.nb_worker > 0 else None
        problem = build.finish(executor)
        if problem is not None:
            build.abort()
            if build.failed is None:
                raise RuntimeError(f"workers could not finish generation {plan.generation}: {problem}")
            self.cache.off = True
            if build.policy is BudgetPolicy.ROTATE:
                self.switch_to_rotation(build.fits)
            return
        self.cache.commit(build, plan.epoch)
        stats.committed = True

    def switch_to_rotation(self, fits: int | None) -> None:
        """``on_budget_exceeded="rotate"``: the cache does not fit; rotate through a disk window that does."""
        s = self.settings
        s.rotation = self.cache.rotation_fallback(fits, len(self.indices), s.batch_size)
        self.open_window()
        log.warning("the cache of %d samples does not fit the disk budget of %s: switching to disk rotation "
                    "(rotation=%d, size=%d samples, window under %s); an epoch now serves %d batches",
                    len(self.indices), self.cache.store.path, s.rotation.rotation, s.rotation.size,
                    self.cache.store.path, self.num_batches())

    # background refresh ---------------------------------------------------------------
    def maybe_start_refresh(self, plan: EpochPlan) -> None:
        """At a read epoch of generation g, start computing g + 1 in the background (opt-in)."""
        if self.refresh is not None:
            return
        target = self.cache.refresh_target(plan.generation)
        if target is None:
            return
        executor = self.ensure_executor()
        build = self.cache.open_build(target, self.settings.use_threading, background=True, executor=executor)
        self.res.background = build
        build.attach(executor)
        chunk = max(1, self.settings.batch_size // REFRESH_CHUNK_DIVISOR)
        self.refresh = BackgroundRefresh(build, self.indices, chunk, self.settings.nb_worker)

    def complete_refresh(self, epoch: int) -> bool:
        """The first epoch of the refreshed generation: finish, commit; ``False`` to write it the usual way."""
        refresh, self.refresh = self.refresh, None
        build, self.res.background = refresh.build, None
        executor = self.ensure_executor()
        try:
            refresh.finish(executor)
            problem = build.finish(executor)
            if problem is not None:
                build.abort()
                self.cache.refresh_off = True
                log.warning("background refresh of generation %d gave up (%s); writing it during epoch %d "
                            "instead", refresh.generation, problem, epoch)
                return False
            self.cache.commit(build, epoch, background=True)
        except BaseException:
            build.abort()
            self.kill_executor()
            raise
        return True
