"""Background refresh: the next generation is computed while the current one is read.

While the epochs of generation ``g`` are served from the store, the workers
are mostly idle. With ``cache_setting["background_refresh"]`` ``"auto"`` (the
default, on where it can work) or ``True``, the loader opens generation ``g + 1`` at the first read epoch of ``g`` and hands
its samples to the workers in small chunks, a few per worker queued ahead so
the workers stay busy while the training loop runs; a worker always takes a
batch task before a queued chunk, so a batch waits at most for the chunk being
computed. The last epoch of ``g`` commits it as it ends where every chunk is
handed out (:meth:`loader.epochs.runner.EpochRunner._commit_refresh`); otherwise, at the
first epoch of ``g + 1``, the rest is finished, the generation committed,
and the epoch reads it like any other: the refresh epoch costs what a cached
epoch costs. A refresh that completes before that asks the workers to close
(and sync) their shards at once, in their idle time: done at the start of
the refresh epoch, that wait was most of its first batch's time.

It needs room for two generations; without it (or when the budget runs out
meanwhile) the loader logs why and falls back to writing the next generation
during its own epoch (write-through).

Whether a background refresh can run at all is decided once, at construction,
by :func:`decide_refresh`: ``True`` that cannot is refused, ``"auto"`` that
cannot becomes ``False`` with one log line; what runs later asks only the setting.
"""

from __future__ import annotations

import collections
import dataclasses
import logging

import numpy as np

from cachestore.backends import get_backend
from cachestore.errors import BudgetExceededError, CacheStoreError, GenerationCommitted

from ..executors import messages as m
from ..executors.base import Executor, worker_timeout
from ..executors.host import ExecutorHost, HostResources
from ..settings import CacheSettings
from .build import GenerationBuild
from .controller import CacheController

log = logging.getLogger(__name__)

BACKGROUND_EPOCH = m.BACKGROUND_EPOCH
#: Chunks queued per worker: enough to cover a training step without the loop pumping.
CHUNKS_PER_WORKER = 4
#: Samples per chunk, as a fraction of a batch: small, so a batch waits little behind one.
CHUNK_DIVISOR = 8


def decide_refresh(cache: CacheSettings, nb_worker: int, stream: bool = False) -> CacheSettings:
    """`cache` with ``background_refresh`` decided for the loader's life (see the module docstring):
    ``"auto"`` stays on where a refresh can run and turns ``False`` (said in one log line) where it
    never can; ``True`` insists, and still raises later when the budget has no room for it.

    Raises
    ------
    ValueError
        ``background_refresh=True`` where a refresh can never run (it says why).
    """
    if cache.background_refresh is False:
        return cache
    why = _refresh_impossible(cache, nb_worker, stream)
    if why is None:
        return cache
    if cache.background_refresh is True:
        raise ValueError(f"cache_setting['background_refresh']=True cannot work here: {why}; "
                         "use 'auto' (on when it can be) or False")
    log.info("background refresh is off: %s; each generation is written during its own epoch", why)
    return dataclasses.replace(cache, background_refresh=False)


def _refresh_impossible(cache: CacheSettings, nb_worker: int, stream: bool) -> str | None:
    """Why a background refresh can never run with these settings (``None`` when it can); `stream`: the
    dataset is an iterable one."""
    if not cache.rewrites:
        return "update_frequency is math.inf, so no generation is ever refreshed"
    if not get_backend(cache.backend).persistent:
        return f"the {cache.backend!r} backend lives in this process, where no idle worker can write it"
    if nb_worker == 0:
        # A stream's refresh is iterated by its own workers, which read epochs leave idle.
        return "nb_worker=0 leaves no worker to " + ("iterate the stream" if stream else "compute it")
    return None


class BackgroundRefresh:
    """Generation ``build.generation``, computed a chunk at a time by otherwise idle workers.

    The refresh only schedules; the :class:`~loader.cache.build.GenerationBuild`
    it composes owns the writing. Its policy is ``"stream"``: a budget overrun
    stops the refresh and never raises; the generation is then written during
    its own epoch.
    """

    def __init__(self, build: GenerationBuild, indices: np.ndarray, chunk: int, nb_worker: int,
                 positions: np.ndarray | None = None, flush_when_done: bool = True) -> None:
        self.build = build
        self.generation = build.generation
        self.indices = indices
        # Every position the generation lacks (an adopted refresh goes on), or those given: what a
        # sampler's generate epoch never draws, computed beside its batches into the same build.
        positions = build.missing(np.arange(len(indices), dtype=np.int64) if positions is None else positions)
        self.todo = collections.deque(positions[i:i + chunk] for i in range(0, len(positions), chunk))
        self.inflight: dict[int, m.Task] = {}
        self.max_inflight = CHUNKS_PER_WORKER * max(1, nb_worker)
        self.computed = 0
        self._seq = 0
        self.failed: str | None = None  # why a chunk could not be written (the refresh then stops)
        # Its chunks all in, the workers close their shards at once (not when they fill in beside an
        # epoch's own batches, which still write into the same shards).
        self.flush_when_done = flush_when_done
        self.flushing = False  # the workers were asked to close their shards (all chunks done)
        self.flush_errors: list[str] = []

    @property
    def done(self) -> bool:
        return not self.todo and not self.inflight

    def pump(self, executor: Executor) -> None:
        """Hand out chunks while fewer than ``max_inflight`` are queued."""
        while self.todo and len(self.inflight) < self.max_inflight and self.build.active and self.failed is None:
            positions = self.todo.popleft()
            task = m.Task(seq=self._seq, part=0, epoch=BACKGROUND_EPOCH, indices=self.indices[positions],
                          positions=positions, collate=False, write=self.build.write_part())
            self.inflight[self._seq] = task
            self._seq += 1
            executor.submit(task)
        if not self.build.active:
            self.todo.clear()
        elif (self.done and self.flush_when_done and not self.flushing and self.build.in_workers
              and self.failed is None):
            self.flushing = True
            executor.start_flush()

    def handle(self, msg: m.Message) -> bool:
        """Take `msg` if it belongs to the refresh; raise a dataset error it reports."""
        if isinstance(msg, m.ShardFlushed) and self.flushing:
            if msg.error:
                self.flush_errors.append(msg.error)
            return True
        if not isinstance(msg, (m.BatchDone, m.TaskFailed)) or msg.epoch != BACKGROUND_EPOCH:
            return False
        task = self.inflight.pop(msg.seq, None)
        if isinstance(msg, m.TaskFailed):
            if msg.kind not in ("store", "budget"):
                raise msg.exception()  # the dataset's error: the next epoch would meet it too
            # The store could not take the chunk (its files removed, a full disk): the refresh gives
            # up, the epochs it serves go on, and the generation is written during its own epoch.
            if self.failed is None:
                log.warning("background refresh of generation %d stops: %s", self.generation, msg.message)
                self.failed = msg.message
            self.todo.clear()
            return True
        if task is not None:
            self.computed += len(task.indices)
            self.build.accept(msg)
        return True

    def drain(self, executor: Executor, timeout: float | None = None) -> None:
        """Hand out no more chunks; wait for those in flight (their samples then are in the build).

        Raises
        ------
        WorkerTimeoutError
            No chunk finished within `timeout` seconds.
        """
        self.todo.clear()
        while self.inflight:
            msg = executor.next_message(timeout=timeout)
            if msg is None:
                late = {(BACKGROUND_EPOCH, seq, 0) for seq in self.inflight}
                waited = timeout or 0.0
                raise worker_timeout(executor, late, f"the last chunks of generation {self.generation}", waited,
                                     waited)
            if not self.handle(msg) and isinstance(msg, m.TaskFailed) and msg.kind == "init":
                raise msg.exception()

    def finish(self, executor: Executor, timeout: float | None = None) -> None:
        """Compute what is left with every worker (the epoch that needs it waits for it).

        Raises
        ------
        WorkerTimeoutError
            No chunk finished within `timeout` seconds.
        """
        if self.todo or self.inflight:
            log.info("background refresh of generation %d: %d chunks left, finishing them now",
                     self.generation, len(self.todo) + len(self.inflight))
        while not self.done:
            self.max_inflight = 2 * executor.nb_worker
            self.pump(executor)
            if self.inflight:
                msg = executor.next_message(timeout=timeout)
                if msg is None:
                    late = {(BACKGROUND_EPOCH, seq, 0) for seq in self.inflight}
                    waited = timeout or 0.0  # next_message gives up only with a timeout
                    raise worker_timeout(executor, late, f"background refresh of generation {self.generation}",
                                         waited, waited)
                if not self.handle(msg) and isinstance(msg, m.TaskFailed) and msg.kind == "init":
                    raise msg.exception()


def _discard(build: GenerationBuild) -> None:
    """Drop a refresh that gave up; its staging area may be gone already (the prefix removed)."""
    try:
        build.abort()
    except (CacheStoreError, OSError) as exc:
        log.debug("discarding the refresh of generation %d: %s", build.generation, exc)


def start_refresh(cache: CacheController, host: ExecutorHost, res: HostResources, indices: np.ndarray,
                  read_generation: int, batch_size: int) -> BackgroundRefresh | None:
    """At a read epoch of `read_generation`, start computing the next one in the background, if it is due."""
    target = cache.refresh_target(read_generation)
    if target is None:
        return None
    executor = host.ensure()
    try:
        build = cache.open_build(target, host.settings.use_threading, background=True, executor=executor)
    except GenerationCommitted:
        return None  # other processes wrote it meanwhile: its epoch reads it

    res.open_work.hold(build)  # kept, with what it computed, if the workers or the loader go first
    build.attach(executor)
    return BackgroundRefresh(build, indices, max(1, batch_size // CHUNK_DIVISOR), executor.nb_worker)


def complete_refresh(refresh: BackgroundRefresh, cache: CacheController, host: ExecutorHost, res: HostResources,
                     epoch: int, timeout: float | None, prune: bool = True) -> bool:
    """The first epoch of the refreshed generation: finish and commit it; ``False`` to write it the usual way.
    `prune`: older generations go with the commit (``False``: committed as the epoch before ends, which
    the caller prunes at the new generation's first epoch).

    A refresh that cannot complete (a worker's shard failed to close, the
    commit does not fit) gives up for the rest of the run, with a log line.
    """
    build = refresh.build
    res.open_work.drop(build)
    executor = host.ensure()
    try:
        refresh.finish(executor, timeout)
        problem = refresh.failed or build.finish(executor) or "; ".join(refresh.flush_errors) or None
        if problem is None:
            try:
                if cache.commit(build, epoch, background=True, prune=prune) is not None:
                    return True
                if len(build.writer.present()) == len(build.have):
                    # Written together with other processes, one of which commits it: the epoch reads it.
                    return False
                problem = "its samples went away (was the cache directory removed?)"
            except BudgetExceededError as exc:  # every sample fit, the index or manifest did not
                problem = f"it could not commit: {exc}"
            except (CacheStoreError, OSError) as exc:  # its staging area went away (the prefix removed)
                problem = f"it could not commit: {exc}"
        _discard(build)
        cache.stop_refresh()
        log.warning("background refresh of generation %d gave up (%s); writing it during epoch %d instead",
                    refresh.generation, problem, epoch)
        return False
    except BaseException:
        if build.open:
            res.open_work.hold(build)  # kept, with what it computed, once the workers are stopped
        host.kill()
        raise
