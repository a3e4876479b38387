"""The epoch runner: plans each epoch and runs it inline, on the executor, or through a rotation window.

One :class:`EpochRunner` per started loader. It asks the
:class:`~loader.cache.CacheController` which generation an epoch uses, opens a
:class:`~loader.generation.GenerationBuild` for a generate epoch, runs the
batches (:mod:`loader.epoch`, :mod:`loader.rotation`), composes a
:class:`~loader.refresh.BackgroundRefresh` during cached epochs, and commits or
keeps (a partial generation) at the end. The path of a batch is described in ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any, Callable, Iterator

import numpy as np

from cachestore import codec
from cachestore.collate import stack_samples
from cachestore.errors import BudgetExceededError

from ..cache.build import GenerationBuild
from ..cache.controller import CacheController
from ..cache.refresh import BackgroundRefresh
from ..executors import messages as m
from ..executors.base import Executor, WorkerConfigFactory
from ..executors.process.pool import WorkerPool
from ..executors.process.slots import SlotPool
from ..executors.producer import BatchProducer
from ..progress import Progress
from ..resources import Resources
from ..settings import BudgetPolicy, EpochMode, LoaderSettings, RotationSettings
from ..state import rotation_as_dict
from . import order as sampler
from . import threads as gather_threads
from .inline import run_inline
from .layout import ConsumerLayout
from .placement import GatherPlacement
from .plan import EpochPlan, EpochStats
from .rotation import batch_sizes, rotation_schedule, run_rotation
from .windows import DiskWindow, MemoryWindow
from .scheduler import PoolRun, run_pool
from .threads import GatherThreads, usable_cpus

log = logging.getLogger(__name__)

#: Batches read ahead per worker in cached epochs (like torch's prefetch_factor=2).
READ_AHEAD_PER_WORKER = 2
#: Samples per background-refresh chunk, as a fraction of a batch: small, so a batch waits little.
REFRESH_CHUNK_DIVISOR = 8
#: Epochs that show progress (see the ``progress`` argument), once they take this many seconds.
PROGRESS_MODES = (EpochMode.GENERATE, EpochMode.ROTATE)
PROGRESS_DELAY = 3.0
#: Seconds the workers get to finish the tasks of a broken-off epoch (without ``timeout``).
SETTLE_TIMEOUT = 120.0


def stats_total(plan: EpochPlan, settings: LoaderSettings) -> int:
    """Samples the epoch of `plan` serves (rotation serves each R times)."""
    if plan.mode == EpochMode.ROTATE:
        return len(plan.indices) * settings.rotation.rotation
    return sum(len(b) for b in plan.batches)


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
        self.fallback: RotationSettings | None = None  # the window on_budget_exceeded="rotate" switched to
        self.placement = GatherPlacement()
        self._reader: Any = None  # see inline_reader
        self._slots_sized = False  # shrink_slots ran at the end of the last epoch
        if settings.cache is not None:
            self.cache = CacheController.open(settings.cache, layout, settings.dataset_class,
                                              settings.dataset_params, settings.batch_size)
            res.store = self.cache.store
            self.cache.decide_refresh(settings.nb_worker)
        if settings.rotation is not None:
            self.open_window()
        if settings.nb_worker > 0:
            self.ensure_executor()
        elif settings.timeout is not None:
            log.info("timeout=%g has no effect with nb_worker=0: the dataset runs in the training process, "
                     "which cannot interrupt it", settings.timeout)

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
                from ..executors.ray import RayExecutor

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
        self.res.keep_builds()  # the workers are gone: what they wrote is whole on disk
        self.refresh = None

    def num_batches(self) -> int:
        s = self.settings
        n = len(self.indices)
        if s.rotation is not None:
            return len(batch_sizes(n, s.rotation.rotation, s.batch_size, s.drop_last))
        return sampler.num_batches(n, s.batch_size, s.drop_last)

    # the plan -------------------------------------------------------------------
    def plan(self, epoch: int, skip: int = 0) -> EpochPlan:
        """What epoch `epoch` does; the first `skip` batches were served before a resume."""
        s = self.settings
        if self.cache is None and self.layout.changes_per_epoch:
            self.indices = self.layout.partition(epoch)
        order = sampler.epoch_order(len(self.indices), epoch, s.seed, s.shuffle, s.nearby_shuffle)
        if s.rotation is not None:
            # Generation order: the i-th generated sample is dataset index indices[order[i]].
            return EpochPlan(epoch, EpochMode.ROTATE, None, [], self.indices[order], skip=skip)
        batches = sampler.split_batches(order, s.batch_size, s.drop_last)
        if self.cache is None or self.cache.off:
            return EpochPlan(epoch, EpochMode.COMPUTE, None, batches[skip:], self.indices)
        generation, mode, notes = self.cache.choose(epoch)
        if mode == EpochMode.GENERATE and self.refresh is not None and self.refresh.generation == generation:
            if self.complete_refresh(epoch):
                mode = EpochMode.READ
        if mode == EpochMode.GENERATE and not notes.get("damaged"):
            locked_by = self.cache.store.lock_holder()
            newest = self.cache.newest_committed()
            if locked_by not in (None, os.getpid()) and newest is not None:
                # Another run writes this prefix: serve what it committed rather than wait or fail.
                log.info("another run (pid %s) is writing %s: epoch %d reads generation %d instead of writing "
                         "generation %d", locked_by, self.cache.store.path, epoch, newest, generation)
                generation, mode, notes = newest, EpochMode.READ, {"moved_to": newest}
        unserved: list[np.ndarray] = []
        if mode == EpochMode.GENERATE:
            dropped = len(order) - sum(len(b) for b in batches)
            unserved = batches[:skip] + ([order[len(order) - dropped:]] if dropped else [])
        return EpochPlan(epoch, mode, generation, batches[skip:], self.indices, unserved, notes=notes)

    # running ----------------------------------------------------------------------
    def run(self, epoch: int, skip: int = 0) -> Iterator[Any]:
        """The batches of `epoch` from batch `skip` on, in order (a generator: see ``docs/ARCHITECTURE.md``)."""
        start = time.perf_counter()
        self.settle()
        if not self._slots_sized:  # the last epoch was broken off (or this is the first)
            self.shrink_slots()
        self._slots_sized = False
        plan = self.plan(epoch, skip)
        if plan.mode == EpochMode.GENERATE:
            try:
                executor = self.ensure_executor() if self.settings.nb_worker > 0 else None
                self.res.build = self.cache.open_build(plan.generation, self.settings.use_threading,
                                                       executor=executor)
            except BudgetExceededError as exc:
                self.give_up_caching(exc)
                plan = self.plan(epoch, skip)
        stats = EpochStats(epoch, plan.mode, plan.generation, extra=dict(plan.notes))
        stats.wait_seconds = time.perf_counter() - start  # finishing a background refresh, if any
        self.stats.append(stats)
        if self.res.executor is not None:
            self.res.executor.begin_epoch()  # max_worker_restarts counts per epoch
        if plan.mode == EpochMode.GENERATE and self.res.build is not None and self.res.build.adopted:
            # Samples an interrupted attempt wrote: those this epoch does not serve need no work.
            plan.unserved = [b for b in map(self.res.build.missing, plan.unserved) if len(b)]
            stats.extra["adopted"] = self.res.build.adopted
        build = self.res.build
        finished = False
        t0 = start
        # Cached epochs are fast: only epochs that compute samples show progress.
        progress = Progress(stats_total(plan, self.settings), f"epoch {epoch} ({plan.mode})",
                            enabled=self.settings.progress, delay=PROGRESS_DELAY) if plan.mode in PROGRESS_MODES else None
        try:
            for batch in self._batches(plan, stats, build):
                if progress is not None:
                    progress.update(stats.samples - progress.done)
                wait = time.perf_counter()
                yield self.mover(batch) if self.mover is not None else batch
                t0 += time.perf_counter() - wait  # time spent in the training loop is not ours
            if build is not None:
                self.finish_generation(plan, build, stats)
            finished = True
            # Now, not at the next epoch's start: the loop may validate or checkpoint in between,
            # and a deep epoch's spare slots would be held meanwhile.
            self.shrink_slots()
            self._slots_sized = True
            places = stats.extra.get("gather_split") or [stats.extra.get("gather")]
            if self.res.threads is not None and "threads" not in places:
                self.res.threads.buffers.drop_free()  # as slots go when not needed
        except BudgetExceededError as exc:
            if build is not None:  # a generation that does not fit is not worth keeping
                self.res.build = None
                build.abort()
            raise CacheController.explain(exc)
        finally:
            if progress is not None:
                progress.close()
            stats.seconds = time.perf_counter() - t0
            if not finished and self.res.build is not None:
                build, self.res.build = self.res.build, None
                build.epoch = epoch
                # A broken-off or failed epoch keeps what it wrote. Workers may still be running its
                # tasks: the build is kept (or committed, when they complete it) once they are done.
                if self.res.executor is not None and self.settings.nb_worker > 0:
                    build.detach()
                    self.res.pending.append(build)
                else:
                    self.producer.close_shard()
                    self.keep_or_commit(build)

    def settle(self) -> None:
        """Keep the builds of broken-off epochs, once the workers finished the tasks that write into them.

        Workers run the tasks they were sent in order, so the abandoned
        epoch's results arrive first (their slots are freed as they come);
        then every worker closes its shard. A worker that takes too long is
        killed: what it wrote is whole on disk either way.
        """
        if not self.res.pending:
            return
        executor, slots = self.res.executor, self.res.slots
        if executor is None or not any(b.in_workers for b in self.res.pending):
            self.res.keep_pending()
            return
        deadline = time.monotonic() + (self.settings.timeout or SETTLE_TIMEOUT)
        try:
            while slots is not None and slots.orphaned():
                msg = executor.next_message(timeout=max(0.0, deadline - time.monotonic()))
                if msg is None:
                    raise TimeoutError("the tasks of a broken-off epoch did not finish")
                if self.refresh is not None and self.refresh.handle(msg):
                    continue
                if isinstance(msg, (m.BatchDone, m.TaskFailed)):
                    slots.release_task(msg)
            executor.flush_shards()
        except Exception as exc:
            log.info("stopping the workers to keep generation(s) %s: %s",
                     [b.generation for b in self.res.pending], exc)
            self.kill_executor()  # keeps every build
            return
        pending, self.res.pending = self.res.pending, []
        for build in pending:
            self.keep_or_commit(build)

    def shrink_slots(self) -> None:
        """Between epochs (at the end of a completed one, else at the start of the next): retire
        the shared-memory slots the last epoch did not need, here and in every worker (the rule:
        "Shrinking" in :mod:`loader.shm`)."""
        slots, executor = self.res.slots, self.res.executor
        if slots is None:
            return
        # Without an executor the one that held the orphaned tasks was killed: they never answer.
        retired = slots.drop_orphans() if executor is None else []
        retired += slots.shrink()
        if retired and executor is not None:
            executor.retire_slots(retired)

    def keep_or_commit(self, build: GenerationBuild) -> None:
        """A broken-off epoch's build, its writers stopped: commit it when complete, else keep it.

        Complete happens when the interrupted epoch was the one that wrote the
        last missing samples (a loop that always breaks early still gets its
        cache); the tasks still running at the break count too.
        """
        epoch = build.epoch
        try:
            if build.finish(None) is None and build.complete():  # finish: records sent to this process are in
                self.cache.commit(build, epoch)
                log.info("epoch %d was broken off, but generation %d is complete: committed", epoch,
                         build.generation)
                return
        except Exception as exc:  # the commit refused it (and discarded it): the next epoch writes it again
            log.warning("generation %d could not be committed after epoch %d was broken off: %s",
                        build.generation, epoch, exc)
            return
        log.info("epoch %d ended with generation %d incomplete (%d of %d samples in): kept, the next epoch "
                 "or run of this generation completes it", epoch, build.generation,
                 len(build.writer.present()) if build.open else 0, len(build.have))
        build.keep()

    def _batches(self, plan: EpochPlan, stats: EpochStats, build: GenerationBuild | None) -> Iterator[Any]:
        s, store = self.settings, self.res.store
        if plan.mode == EpochMode.ROTATE:
            return self.rotation_batches(plan, stats)
        if s.nb_worker == 0 or (plan.mode == EpochMode.READ and not store.backend.persistent):
            if plan.mode != EpochMode.READ:
                return run_inline(plan, self.producer, None, build, stats)
            reader = self.inline_reader(plan.generation)
            if s.nb_worker > 0 and gather_threads.usable(reader, self.producer):
                return self.placed(plan, stats, None, 0)  # an in-RAM store: inline or by threads
            stats.extra["gather"] = "main"
            return run_inline(plan, self.producer, reader, None, stats)
        executor = self.ensure_executor()
        run = PoolRun(executor, self.res.slots, s.max_queue_size, self.kill_executor, s.max_minibatch_length,
                      s.prefetch_time if plan.epoch == 0 else None, build=build, timeout=s.timeout,
                      # Parts of a batch are joined by concat_batches: only for the default collate.
                      split_ends=plan.mode != EpochMode.READ and s.collate_fn is None)
        if build is not None:
            build.attach(executor)
        if plan.mode == EpochMode.READ:
            self.maybe_start_refresh(plan)
            run.reader = (store.spec, plan.generation)
            run.background = self.refresh
            # Reading a batch takes milliseconds: a deep queue would only hold memory.
            run.max_in_flight = min(s.max_queue_size, READ_AHEAD_PER_WORKER * s.nb_worker + 2)
            if self.refresh is None:  # a refresh needs the workers' idle time: they gather then
                return self.placed(plan, stats, lambda p: run_pool(p, run, stats), run.max_in_flight)
            stats.extra["gather"] = "workers"
        return run_pool(plan, run, stats)

    def placed(self, plan: EpochPlan, stats: EpochStats, pool: Callable[[EpochPlan], Iterator[Any]] | None,
               warmup: int) -> Iterator[Any]:
        """Read epoch `plan` where it costs the loop least (loader/gather.py): in this process,
        inline or by its threads where the reader allows, or by `pool` (``None``: no workers)."""
        reader = self.inline_reader(plan.generation)
        threads = None
        if gather_threads.usable(reader, self.producer):
            def threads(p: EpochPlan, counts: EpochStats) -> Iterator[Any]:
                return gather_threads.thread_batches(p, counts, reader, self.producer, self.gather_threads())
        return self.placement.batches(
            (self.res.store.path, plan.generation, self.settings.batch_size), plan, stats,
            lambda p, counts: run_inline(p, self.producer, reader, None, counts), pool, warmup=warmup,
            threads=threads, threads_warmup=self.gather_threads().buffers.keep if threads is not None else 0)

    def gather_threads(self) -> GatherThreads:
        """The training process's gather threads, as many as workers (the CPUs the user gave to
        loading), at most one per CPU this process may run on."""
        if self.res.threads is None:
            self.res.threads = GatherThreads(min(self.settings.nb_worker, usable_cpus()))
        return self.res.threads

    def inline_reader(self, generation: int) -> Any:
        """A reader of `generation` in this process, kept from epoch to epoch (as workers keep theirs).

        A reader opened per epoch maps the store afresh: every page an epoch touches faulted in
        again, which cost a cached epoch of 48 KiB samples a third of its time.
        """
        if self._reader is None or self._reader.generation != generation:
            if self._reader is not None:
                self._reader.close()
            self._reader = self.res.store.reader(generation)
        return self._reader

    def drop_reader(self) -> None:
        """After a commit: a generation written again under the same id (it was damaged) must not
        be served from the old files the kept reader still maps."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def rotation_batches(self, plan: EpochPlan, stats: EpochStats) -> Iterator[Any]:
        s, window = self.settings, self.res.window
        rng = np.random.default_rng([s.seed, plan.epoch, 2])
        schedule = rotation_schedule(len(plan.indices), s.rotation.rotation, window.slots, s.batch_size,
                                     s.drop_last, rng)
        adopted = plan.skip > 0 and isinstance(window, DiskWindow) and window.resumes(plan.epoch, plan.skip)
        if not adopted:
            window.reset()
        if s.nb_worker == 0:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                for indices in arrays:
                    yield self.producer.samples(indices, plan.epoch)
        else:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                compute = EpochPlan(plan.epoch, EpochMode.COMPUTE, None, arrays, np.arange(self.layout.num_samples))
                run = PoolRun(self.ensure_executor(), self.res.slots, s.max_queue_size, self.kill_executor,
                              s.max_minibatch_length, collate=False, timeout=s.timeout)
                return run_pool(compute, run, stats)
        # Its own generator for the order within each batch: the schedule is drawn as far ahead as the
        # workers compute, which varies, so a shared one would make the batches depend on timing.
        shuffle = np.random.default_rng([s.seed, plan.epoch, 3])
        return run_rotation(schedule, plan.indices, window, fresh, s.collate_fn or stack_samples, stats, shuffle,
                            skip=plan.skip, epoch=plan.epoch, adopted=adopted)

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
                self.switch_to_rotation()
            return
        try:
            self.cache.commit(build, plan.epoch)
        except BudgetExceededError as exc:
            # Every sample fit, the index or manifest did not: the same promise as for the samples.
            build.abort()
            self.give_up_caching(exc)
            return
        self.drop_reader()
        stats.committed = True

    def switch_to_rotation(self) -> None:
        """``on_budget_exceeded="rotate"``: the cache does not fit; rotate through a window that does."""
        s = self.settings
        s.rotation = self.fallback = self.cache.rotation_fallback(self.sample_bytes(), len(self.indices))
        self.open_window()
        log.warning("the cache of %d samples does not fit the disk budget of %s: switching to %s rotation "
                    "(rotation=%d, window of %d samples%s); an epoch now serves %d batches",
                    len(self.indices), self.cache.store.path, s.rotation.medium, s.rotation.rotation,
                    self.res.window.slots, f" under {s.rotation.prefix}" if s.rotation.prefix else "",
                    self.num_batches())

    def sample_bytes(self) -> int:
        """Bytes one sample takes as a record (one dataset call in this process)."""
        sample = self.producer.dataset[int(self.indices[0])] if len(self.indices) else None
        return len(codec.encode_record(*codec.flatten(sample, allow_pickle=True)))

    def give_up_caching(self, exc: BudgetExceededError) -> None:
        """The generation cannot even be opened (a full disk): apply ``on_budget_exceeded``."""
        policy = self.cache.settings.on_budget_exceeded
        if policy is BudgetPolicy.ERROR:
            raise CacheController.explain(exc)
        self.cache.off = True
        # Logged as text: a log record holding the exception would keep its frames, and with them
        # this epoch's batches (and their shared-memory slots), alive as long as the record.
        if policy is BudgetPolicy.ROTATE:
            log.warning("%s", str(exc))
            self.switch_to_rotation()
        else:
            log.warning("cache disabled, serving uncached samples from now on: %s", str(exc))

    # resuming --------------------------------------------------------------------------
    def snapshot(self) -> tuple[dict | None, dict | None]:
        """The cache plan and the rotation fallback, as plain values (see :mod:`loader.state`)."""
        cache = self.cache.snapshot() if self.cache is not None else None
        return cache, rotation_as_dict(self.fallback) if self.fallback is not None else None

    def window_path(self) -> str | None:
        """Where the disk rotation window lives (a resumed run adopts it), ``None`` for none."""
        window = self.res.window
        return str(window.path) if isinstance(window, DiskWindow) else None

    def adopt_window(self, path: str | None, epoch: int, applied: int) -> None:
        """Take over a stopped run's disk window when it stopped exactly after `applied` batches of `epoch`."""
        window = self.res.window
        if path is not None and applied > 0 and isinstance(window, DiskWindow):
            window.adopt(path, epoch, applied)

    def restore(self, cache: dict | None, fallback: dict | None) -> None:
        """Continue the plan of the run a state was taken from."""
        if cache is not None and self.cache is not None:
            self.cache.restore(cache)
        if fallback is not None and self.fallback is None:
            self.settings.rotation = self.fallback = RotationSettings(**fallback)
            self.cache.off = True
            self.open_window()

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
            refresh.finish(executor, self.settings.timeout)
            problem = build.finish(executor) or "; ".join(refresh.flush_errors) or None
            if problem is not None:
                build.abort()
                self.cache.refresh_off = True
                log.warning("background refresh of generation %d gave up (%s); writing it during epoch %d "
                            "instead", refresh.generation, problem, epoch)
                return False
            try:
                self.cache.commit(build, epoch, background=True)
            except BudgetExceededError as exc:  # every sample fit, the index or manifest did not
                build.abort()
                self.cache.refresh_off = True
                log.warning("background refresh of generation %d could not commit (%s); writing it during "
                            "epoch %d instead", refresh.generation, str(exc), epoch)
                return False
            self.drop_reader()
        except BaseException:
            if build.open:
                self.res.background = build  # kept, with what it computed, once the workers are stopped
            self.kill_executor()
            raise
        return True
