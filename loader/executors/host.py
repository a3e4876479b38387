"""The executor's life in a loader: started when an epoch needs workers, killed after an
error, its shared-memory slots shrunk between epochs.

The executor and the slots are kept in the loader's :class:`~loader.resources.Resources`,
so that the loader's finalizer releases them without referencing the loader
(``docs/ARCHITECTURE.md``, "Shutdown rules"); this room names the part of it that it uses
(:class:`HostResources`), as the rooms above name theirs, and never imports it.
"""

from __future__ import annotations

from typing import Protocol

from ..settings import LoaderSettings
from .base import Executor, WorkerConfigFactory
from .process.pool import WorkerPool, forks_afresh
from .process.start import method_for
from .process.slots import SlotPool
from .producer import BatchProducer

#: Start methods whose children get their arguments by pickle (``fork`` copies the parent instead;
#: ``"auto"`` forks only a pool's first workers, and only where it is safe: the others are spawned).
PICKLING_START_METHODS = ("auto", "spawn", "forkserver")
#: Shared-memory slots created with the executor (more come when the in-flight depth grows).
INITIAL_SLOTS = 4


def executor_class(name: str) -> type[Executor]:
    """The executor class of ``executor=name`` (``"process"`` or ``"ray"``), to ask its capabilities."""
    if name == "ray":
        # The module imports ray only when an executor is built: `import loader` never imports it.
        from .ray import RayExecutor

        return RayExecutor
    return WorkerPool


class Keepable(Protocol):
    """A generation being written, which can be left as a partial one."""

    def keep(self) -> None:
        """Leave what was written for the next writer of the generation (idempotent)."""


class Stoppable(Protocol):
    """Work running in the background."""

    def stop(self) -> None:
        """End it now."""


class HeldWork(Protocol):
    """The work the epochs hold open, registered for the loader's finalizer
    (:class:`~loader.resources.OpenWork`): its owners keep it as their own and drop it here when they
    finish it themselves."""

    def hold(self, work: Keepable, by_workers: bool = True) -> None:
        """Hold `work`, a generation being written (`by_workers`: killing the workers keeps it too)."""

    def run(self, work: Stoppable) -> None:
        """Hold `work`, running in the background over a stream's workers."""

    def drop(self, work: object) -> None:
        """Its owner finished `work` itself."""

    def holds(self, work: object) -> bool:
        """Whether `work` is held: neither dropped by its owner nor kept after a kill."""

    def keep_builds(self) -> None:
        """Keep the generations the workers write into as partial ones (they are stopped)."""


class HostResources(Protocol):
    """What the host keeps in the loader's resources: the executor and its slots; and, after a kill,
    keeping the generations the stopped workers wrote into (held in `open_work`)."""

    executor: Executor | None
    slots: SlotPool | None

    @property
    def open_work(self) -> HeldWork:
        """The work the epochs hold open (kept, the builds, when the workers are killed)."""


class ExecutorHost:
    """Starts, kills and tidies the loader's executor (see the module docstring).

    Parameters
    ----------
    settings
        The loader's settings (which executor, how many workers, ...).
    producer
        The training process's own producer: the Ray executor runs read tasks with it.
    res
        Where the executor and its slots are kept.
    """

    def __init__(self, settings: LoaderSettings, producer: BatchProducer, res: HostResources) -> None:
        self.settings = settings
        self.producer = producer
        self.res = res
        # What workers receive was checked to be sendable: workers started again after a retire
        # skip it (pickling a dataset of a million objects takes seconds and its bytes).
        self._checked = False

    @property
    def executor(self) -> Executor | None:
        """The running executor, ``None`` before the first start or after a kill."""
        return self.res.executor

    @property
    def slots(self) -> SlotPool | None:
        return self.res.slots

    def ensure(self, check: bool = True) -> Executor:
        """The executor, started now when there is none (a first epoch, after a kill or a :meth:`retire`);
        `check`: whether what workers receive is checked to be sendable first (once per loader)."""
        s, res = self.settings, self.res
        if res.executor is None:
            res.executor = self.make_executor(check and not self._checked)
            self._checked = True
        if res.slots is None:
            res.slots = SlotPool(min(s.max_queue_size, INITIAL_SLOTS))
        return res.executor

    def make_executor(self, check: bool = True, copies: bool = False) -> Executor:
        """A new executor of the loader's kind (processes, threads or Ray actors), not kept here: the
        loader's own (:meth:`ensure`), or one whose workers hold a stream's copies (`copies`: a worker
        that dies cannot be replaced; :mod:`loader.executors.stream_turn`)."""
        s = self.settings
        # The executor must not reference the loader: the finalizer that releases it
        # would then keep the loader alive forever.
        make_config = WorkerConfigFactory(s.dataset, s.collate_fn, s.gpu_indices, s.allow_pickle,
                                          s.worker_init_fn, s.read_transform, s.seed,
                                          s.ray_options.num_workers if s.ray_options is not None else s.nb_worker)
        method = method_for(s.start_method, s.dataset.instance)
        if check and (s.executor == "ray" or (not s.use_threading and s.start_method in PICKLING_START_METHODS)):
            make_config.check_sendable()  # before any worker starts: a clear error, not a dead worker
            if s.executor != "ray" and forks_afresh(s.use_threading, method):
                # Checked; forked workers inherit the objects themselves, and would inherit the
                # bytes too (tens of MiB for a dataset indexed by a million Python objects).
                make_config.forget_payloads()
        if s.executor == "ray":
            # Imported here only: `import loader` never imports ray (an optional extra).
            from .ray import RayExecutor

            assert s.ray_options is not None  # parse_executor fills them in for executor="ray"
            return RayExecutor(make_config, s.ray_options, 0 if copies else s.max_worker_restarts, self.producer,
                               copies=copies)
        return WorkerPool(make_config, s.nb_worker, s.use_threading, method, s.max_worker_restarts,
                          s.dataset.dataset_class.__module__, in_turn=s.deals_in_turn, copies=copies)

    def start_ready(self) -> None:
        """Start the workers now and wait for each to run ``worker_init_fn``: its error is raised here, at
        the loader's first ``iter()``, as torch's stateful loader raises it (not at the first batch)."""
        executor = self.ensure()
        if isinstance(executor, WorkerPool):
            try:
                executor.wait_ready(self.settings.timeout)
            except BaseException:
                self.kill()
                raise

    def slot_pool(self) -> SlotPool:
        """The slots (with the executor started, as tasks need both)."""
        self.ensure()
        assert self.res.slots is not None
        return self.res.slots

    def retire(self) -> bool:
        """Stop the workers and drop their slots, where a new pool forks (``forks_afresh``): workers
        that computed a generation hold their own copies of the pages of the dataset's objects they
        read (reading an object writes its reference count), which readers of the committed
        generation never need (``docs/ARCHITECTURE.md``, "Memory with many workers"). The next epoch
        that needs workers starts fresh forks (:meth:`ensure`); one that gathers in this process
        starts none. Returns whether it did; called between epochs, when no task is in flight."""
        executor = self.res.executor
        if not isinstance(executor, WorkerPool) or not forks_afresh(executor.use_threading, executor.start_method):
            return False
        self.res.executor = None
        executor.shutdown()
        # The slots go with the workers (a batch the loop holds keeps its mapping until it dies): a
        # read epoch gathered here needs none, and one read by workers makes its own.
        slots, self.res.slots = self.res.slots, None
        if slots is not None:
            slots.close()
        return True

    def kill(self) -> None:
        """After a worker error: stop the workers now (the next epoch starts new ones), keep open builds."""
        executor, self.res.executor = self.res.executor, None
        if executor is not None:
            executor.kill()
        self.res.open_work.keep_builds()  # the workers are gone: what they wrote is whole on disk

    def shrink_slots(self) -> None:
        """Between epochs: retire the shared-memory slots the last epoch did not need, here and in
        every worker (the rule: "Shrinking" in :mod:`loader.executors.process.slots`)."""
        slots, executor = self.res.slots, self.res.executor
        if slots is None:
            return
        # Without an executor the one that held the orphaned tasks was killed: they never answer.
        retired = slots.drop_orphans() if executor is None else []
        retired += slots.shrink()
        if retired and executor is not None:
            executor.retire_slots(retired)
