"""The Ray executor: samples computed by Ray actors anywhere in a Ray cluster.

``CachedLoader(..., executor="ray", executor_options={...})`` puts this
:class:`~loader.executors.base.Executor` where the :class:`~loader.executors.process.pool.WorkerPool`
would be. ``ray`` is an optional extra: this module imports it only when an
executor is built, so ``import loader`` never does.

How a batch travels (see also ``docs/ARCHITECTURE.md``, "The path of a batch")
--------------------------------------------------------------------------------
* **Computed** (generate, compute, rotation and background-refresh tasks):
  the task goes to one of ``num_workers`` :class:`RayWorker` actors, which
  built the dataset from its class and keyword arguments. The actor answers
  :class:`~loader.executors.messages.BatchDone` with ``meta=None`` and the batch inline;
  it comes back through Ray's object store (shared memory slots do not cross
  machines). An actor never writes the training node's store (it may run on
  another machine): ``writes_local_store`` is false, so a generation being
  written asks for records (``send_records``), which
  :meth:`~loader.cache.build.GenerationBuild.put_records` writes here.
* **Read** (cached epochs): the store lives on the training node, so read
  tasks never leave it. They are queued here and run in this process, one per
  :meth:`RayExecutor.next_message`, after the results Ray already has; the
  actors meanwhile stay free for a background refresh. A corrupt record turns
  its batch into a compute task for an actor.

Deaths and shutdown (the rules of the shutdown note in :mod:`loader.executors.process.pool`)
---------------------------------------------------------------------------
* Each task is one actor method call; its ``ObjectRef`` is the only thing
  waited on (``ray.wait`` with a timeout, never a bare ``ray.get``). An actor
  that dies - killed, out of memory, its node gone - makes its calls fail
  with ``RayActorError``: the first such failure replaces the actor (a new
  incarnation, a new shard id, death listeners told), every failed call is
  re-run on a live actor, and a call that succeeded before the death is
  delivered as usual, so each task is delivered exactly once. Deaths count
  against ``max_worker_restarts`` per epoch.
* An actor that Ray cannot place (no node has the resources asked for) is
  reported after ``start_timeout`` seconds instead of waiting forever.
* Actors are created with ``max_restarts=0`` (the loader replaces them) and
  are never detached, so they also die with this process (Ray ties an actor
  to its owner). :meth:`RayExecutor.shutdown` kills them; a Ray instance the
  loader started is shut down with the last loader that uses it, a connection
  the loader opened is closed, and a connection or cluster that existed
  before is left as it was.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

import numpy as np
import psutil

from cachestore.errors import CorruptSampleError

from ..errors import WorkerError
from ..settings import EpochMode, RayOptions
from . import messages as m
from .base import DeathListeners, StuckWorker
from .producer import BatchProducer, task_failure
from .ray_actor import RayWorker
from .ray_connection import CONNECT_TIMEOUT, CONNECTION, import_ray
from .ray_options import fits

log = logging.getLogger(__name__)

#: Seconds between checks (actor start deadlines) while waiting for results.
POLL_INTERVAL = 0.5
#: ``worker_id`` of read tasks run in the training process.
LOCAL_WORKER = -1
#: Seconds a shutdown waits for the processes of its killed actors on this machine to end.
ACTOR_EXIT_WAIT = 5.0
#: What a pending call to an actor's stream copy is waiting for (:meth:`RayExecutor.send_to`).
STREAM = "stream"


@dataclass
class ActorHandle:
    """One actor incarnation as the executor sees it."""

    worker_id: int
    actor: Any  # ray.actor.ActorHandle
    shard_id: str
    created: float  # time.monotonic() at creation: start_timeout counts from here
    outstanding: int = 0  # calls submitted and not yet taken
    ready: bool = False
    pid: int | None = None  # on the actor's node, which may be another machine
    node_id: str | None = None
    dead: bool = False


def gone(pids: list[int], timeout: float) -> None:
    """Wait up to `timeout` seconds for processes `pids` (not ours: Ray's) to end."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.Error:
            pass
    psutil.wait_procs(procs, timeout=timeout)


def writable(batch: Any) -> Any:
    """`batch` with every read-only array copied.

    Arrays Ray returns are read-only views of its object store, which stay
    pinned there while they live: a copy gives the training loop the writable
    arrays it gets from the process executor, and frees the store's memory now.
    """
    if isinstance(batch, np.ndarray):
        return batch if batch.flags.writeable else batch.copy()
    if isinstance(batch, dict):
        return {k: writable(v) for k, v in batch.items()}
    if isinstance(batch, list):
        return [writable(v) for v in batch]
    if isinstance(batch, tuple):
        items = [writable(v) for v in batch]
        return type(batch)(*items) if hasattr(batch, "_fields") else tuple(items)
    return batch


class RayExecutor(DeathListeners):
    """Compute tasks on Ray actors, read tasks in the training process (see the module docstring).

    Parameters
    ----------
    make_config
        Builds each actor incarnation's config (a fresh shard id every time).
    options
        The filled-in ``executor_options`` (:func:`loader.executors.ray_options.parse_executor`).
    max_restarts
        Actor deaths tolerated per epoch.
    local
        The training process's producer: it reads the cached epochs here.
    """

    writes_local_store = False  # actors may run on other machines

    def __init__(self, make_config: Callable[[int], m.WorkerConfig], options: RayOptions, max_restarts: int,
                 local: BatchProducer, copies: bool = False) -> None:
        self.ray = import_ray()
        self.copies = copies  # the actors hold a stream's copies: one that dies cannot be replaced
        self.make_config = make_config
        self.options = options
        self.nb_worker = options.num_workers
        self.max_restarts = max_restarts
        self.restarts = 0
        self.local = local
        self.workers: list[ActorHandle] = []
        self.closed = False
        DeathListeners.__init__(self)
        # ObjectRef -> (actor, its task; None: its start; STREAM: a command to its stream copy)
        self._pending: dict[Any, tuple[ActorHandle, m.Task | str | None]] = {}
        self._local: collections.deque[m.Task] = collections.deque()
        # A stream copy's answers in the order its commands were sent (ray.wait's is completion order).
        self._stream_calls: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)
        self._stream_done: dict[Any, Any] = {}
        self._answered: collections.deque[Any] = collections.deque()
        self._actor_options = {**options.actor_options, "max_restarts": 0, "max_task_retries": 0,
                               "max_concurrency": 1}
        cpus = self.nb_worker * float(self._actor_options.get("num_cpus", 1))  # type: ignore[arg-type]
        self._connected = CONNECTION.acquire(self.ray, options.address, options.init_options, cpus,
                                             min(options.start_timeout, CONNECT_TIMEOUT))
        try:
            self._actor_class = self.ray.remote(RayWorker)
            for wid in range(self.nb_worker):
                self.workers.append(self._start(wid))
        except BaseException:
            self.shutdown()
            raise

    # actors ------------------------------------------------------------------
    def _start(self, wid: int) -> ActorHandle:
        config = self.make_config(wid)
        actor = self._actor_class.options(**self._actor_options).remote(config)
        handle = ActorHandle(wid, actor, config.shard_id, time.monotonic())
        self._pending[actor.ready.remote()] = (handle, None)
        return handle

    @property
    def actors(self) -> list[Any]:
        """The Ray actor handles of the live incarnations, by worker id."""
        return [w.actor for w in self.workers]

    def pids(self) -> list[int]:
        """Empty: actors are not processes of this machine (their pids are in :attr:`workers`)."""
        return []

    def idle_workers(self) -> int:
        return sum(w.outstanding == 0 for w in self.workers if not w.dead)

    def worker_pid(self, worker_id: int) -> int | None:
        if worker_id == LOCAL_WORKER:
            return os.getpid()
        return next((w.pid for w in self.workers if w.worker_id == worker_id), None)

    def stuck_workers(self, tasks: set[tuple[int, int, int]]) -> list[StuckWorker]:
        """Actors holding any of `tasks`; their stacks are on their own nodes (``ray stack`` there)."""
        stuck: dict[int, StuckWorker] = {}
        held = [(w, t) for w, t in self._pending.values() if isinstance(t, m.Task)]
        for worker, task in held:
            if (task.epoch, task.seq, task.part) in tasks and worker.worker_id not in stuck:
                # An actor runs its calls in order: the oldest one it holds is the one running.
                running = next(t for w, t in held if w is worker)
                stack = (f"(not available here: a Ray actor on node {worker.node_id}; "
                         f"run `ray stack` on that node to see pid {worker.pid})")
                stuck[worker.worker_id] = StuckWorker(worker.worker_id, worker.pid, running, stack)
        return list(stuck.values())

    def begin_epoch(self) -> None:
        self.restarts = 0
        # Reads queued by an abandoned epoch are answered unread: their results are dropped anyway,
        # and the answer gives their shared-memory slot back (loader.epochs.scheduler.PoolEpoch._receive).
        while self._local:
            task = self._local.popleft()
            self._answered.append(m.BatchDone(task.epoch, task.seq, task.part, LOCAL_WORKER, None))

    def retire_slots(self, names: Sequence[str]) -> None:
        """Nothing to do: actors never map shared-memory slots (results travel through Ray)."""

    # tasks -------------------------------------------------------------------
    def submit(self, task: m.Task) -> None:
        if task.mode == EpochMode.READ:
            self._local.append(task)  # the store is on this node: read here (see the module docstring)
        else:
            self._submit_remote(task)

    def send_to(self, worker_id: int, msg: m.Command) -> None:
        """Send a stream command to actor `worker_id`'s copy; its answer comes from :meth:`next_message`."""
        assert isinstance(msg, (m.StreamBegin, m.StreamNext))
        worker = next(w for w in self.workers if w.worker_id == worker_id)
        ref = worker.actor.stream.remote(msg)
        self._pending[ref] = (worker, STREAM)
        self._stream_calls[worker_id].append(ref)

    def _submit_remote(self, task: m.Task) -> None:
        worker = min((w for w in self.workers if not w.dead), key=lambda w: w.outstanding)
        worker.outstanding += 1
        self._pending[worker.actor.run.remote(task)] = (worker, task)

    def next_message(self, timeout: float | None = None) -> Any:
        """The next result or failure; ``None`` after `timeout` seconds, or at once when nothing is pending.

        Results the actors have finished come first, then one read of this
        process; dead actors are replaced and their failed calls re-run meanwhile.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if self._answered:
                return self._answered.popleft()
            if self._pending:
                ready, _ = self.ray.wait(list(self._pending), num_returns=1, timeout=0)
                if ready:
                    msg = self._take(ready[0])
                    if msg is not None:
                        return msg
                    continue
            if self._local:
                msg = self._read_local(self._local.popleft())
                if msg is not None:
                    return msg
                continue
            if not self._pending:
                return None
            self._check_started()
            left = POLL_INTERVAL if deadline is None else max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            ready, _ = self.ray.wait(list(self._pending), num_returns=1, timeout=left)
            if ready:
                msg = self._take(ready[0])
                if msg is not None:
                    return msg
            elif deadline is not None and time.monotonic() >= deadline:
                return None

    def _take(self, ref: Any) -> Any:
        """The message of a finished call, or ``None`` when there is none to deliver (start, death)."""
        ray = self.ray
        worker, task = self._pending.pop(ref)
        if isinstance(task, m.Task):
            worker.outstanding -= 1
        try:
            value = ray.get(ref)
        except (ray.exceptions.RayActorError, ray.exceptions.ObjectLostError) as exc:
            self._lost(worker, exc)
            if isinstance(task, m.Task):
                self._submit_remote(task)  # re-run: its result never arrived
            return None
        except ray.exceptions.RayTaskError as exc:
            # Only what escapes RayWorker's own handling gets here (a result Ray cannot serialise, say).
            failed = exc.cause if isinstance(exc.cause, BaseException) else exc
            if not isinstance(task, m.Task):
                return m.TaskFailed.from_exception(failed, epoch=-1, seq=-1, part=-1, worker_id=worker.worker_id,
                                                   index=None, kind="init")
            return task_failure(failed, task, worker.worker_id)
        if task is None:
            worker.ready = True
            worker.pid, worker.node_id, failure = value
            return failure
        if task == STREAM:
            self._stream_answered(worker.worker_id, ref, value)
            return None
        if isinstance(value, m.BatchDone) and value.batch is not None:
            value = dataclasses.replace(value, batch=writable(value.batch))
        return value

    def _stream_answered(self, worker_id: int, ref: Any, value: Any) -> None:
        """Deliver the stream answers of actor `worker_id` that are now complete in the order sent."""
        self._stream_done[ref] = value
        calls = self._stream_calls[worker_id]
        while calls and calls[0] in self._stream_done:
            answer = self._stream_done.pop(calls.popleft())
            if isinstance(answer, m.StreamItems):
                answer = dataclasses.replace(answer, items=writable(answer.items))
            if answer is not None:  # a run's start answers nothing
                self._answered.append(answer)

    def _read_local(self, task: m.Task) -> Any:
        """A read task, run in this process; ``None`` when a corrupt record sent it to an actor instead."""
        producer = self.local
        try:
            reader = producer.reader(task.reader)
            try:
                batch = producer.gather(task, reader)
            except CorruptSampleError as exc:
                log.warning("%s; computing this batch on a Ray actor instead", str(exc))
                self._submit_remote(dataclasses.replace(task, reader=None))
                return None
        except Exception as exc:
            return task_failure(exc, task, LOCAL_WORKER)
        return m.BatchDone(task.epoch, task.seq, task.part, LOCAL_WORKER, None, batch=batch)

    def _lost(self, dead: ActorHandle, exc: BaseException) -> None:
        """An actor died (its call failed with `exc`): replace it once (see the module docstring)."""
        if dead.dead:
            return  # replaced already, at its first failed call
        if self.copies:
            raise WorkerError(f"stream worker {dead.worker_id} (Ray actor, pid {dead.pid} on node {dead.node_id}) "
                              "exited unexpectedly: a stream cannot be taken up again where a dead worker left it. "
                              f"Ray says: {type(exc).__name__}: {exc}") from exc
        self.restarts += 1
        if self.restarts > self.max_restarts:
            raise WorkerError(f"Ray actor of loader worker {dead.worker_id} (pid {dead.pid} on node {dead.node_id}) "
                              f"died; {self.restarts} actor deaths, more than max_worker_restarts="
                              f"{self.max_restarts}. Ray says: {type(exc).__name__}: {exc}") from exc
        dead.dead = True
        log.warning("Ray actor of loader worker %d (pid %s on node %s) died (%s); starting a new one and re-running "
                    "its unfinished batches", dead.worker_id, dead.pid, dead.node_id, type(exc).__name__)
        self.notify_death(dead.shard_id)
        try:
            self.ray.kill(dead.actor, no_restart=True)  # it may only look dead (an unreachable node)
        except Exception:
            pass
        self.workers[self.workers.index(dead)] = self._start(dead.worker_id)

    def _check_started(self) -> None:
        """Raise when an actor has waited longer than ``start_timeout`` to be placed and started."""
        limit = self.options.start_timeout
        now = time.monotonic()
        for worker in self.workers:
            if not worker.ready and not worker.dead and now - worker.created > limit:
                try:
                    available = self.ray.available_resources()
                except Exception:
                    available = "unknown"
                if isinstance(available, dict) and fits(self.options.actor_options, available):
                    raise WorkerError(f"Ray did not start loader actor {worker.worker_id} within {limit:.0f} s, "
                                      f"though the cluster has room for its options "
                                      f"{self.options.actor_options!r} now ({available!r}): its worker process "
                                      "was slow to start (a loaded machine, or the actors of a loader that ended "
                                      "still held the room). Raise executor_options['start_timeout']")
                raise WorkerError(f"Ray did not start loader actor {worker.worker_id} within {limit:.0f} s: no node "
                                  f"offers the actor's options {self.options.actor_options!r} (resources "
                                  f"available now: {available!r}). Add such a node (ray start --address=... "
                                  "--resources=...) or change executor_options['actor_options']; "
                                  "executor_options['start_timeout'] sets the wait")

    def start_flush(self) -> None:
        """Nothing to flush: actors never write shards (``writes_local_store`` is false)."""

    def flush_shards(self) -> list[str]:
        """Nothing to flush: actors never write shards (``writes_local_store`` is false)."""
        return []

    # shutdown ----------------------------------------------------------------
    def shutdown(self) -> None:
        """Kill the actors, close the Ray connection this loader opened (idempotent; see the module docstring)."""
        if self.closed:
            return
        self.closed = True
        ray = self.ray
        workers, self.workers = self.workers, []
        starting = {ref: w for ref, (w, task) in self._pending.items() if task is None and not w.dead}
        self._pending.clear()
        self._local.clear()
        self._stream_calls.clear()
        self._stream_done.clear()
        try:
            # Nothing of an actor's is worth waiting for (it writes nothing on the training node) but its
            # end: a process of this machine is gone when the executor is (ray.kill only asks for it). An
            # actor still starting is let start first: killed before, the process Ray started for it
            # stays in Ray's pool of idle workers.
            if ray.is_initialized():
                self._started(starting)
                here = ray.get_runtime_context().get_node_id()
                local = [w.pid for w in workers if w.pid is not None and w.node_id == here]
                for worker in workers:
                    try:
                        ray.kill(worker.actor, no_restart=True)
                    except Exception as exc:  # its node may be gone already
                        log.debug("could not kill Ray actor of worker %d: %s", worker.worker_id, str(exc))
                gone(local, ACTOR_EXIT_WAIT)
        finally:
            if self._connected:
                self._connected = False
                CONNECTION.release(ray)

    def _started(self, starting: dict[Any, ActorHandle]) -> None:
        """Wait (up to ``ACTOR_EXIT_WAIT``) for the actors of `starting` (their ``ready`` calls) to start,
        taking their pids and nodes."""
        if not starting:
            return
        done, _ = self.ray.wait(list(starting), num_returns=len(starting), timeout=ACTOR_EXIT_WAIT)
        for ref in done:
            try:
                starting[ref].pid, starting[ref].node_id, _failure = self.ray.get(ref)
            except Exception:  # it died starting: nothing of it is left to wait for
                pass

    def kill(self) -> None:
        """Same as :meth:`shutdown`: actors are killed at once either way."""
        self.shutdown()
