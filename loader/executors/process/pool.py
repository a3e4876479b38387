"""The worker pool: start, feed, watch, restart and stop worker processes.

Shutdown design note (referenced from every function that takes part in it)
--------------------------------------------------------------------------
Nothing may outlive the loader: not a process, not a shared-memory segment,
not a staging directory, and no wait may hang.

* Every worker has its own duplex pipe. The training process never blocks on
  a worker without a timeout: it waits on the pipes *and* the process
  sentinels together (``multiprocessing.connection.wait``), so a worker that
  dies - SIGKILL, segfault, OOM - is seen within one wait.
* A dead worker is replaced and its unfinished tasks are re-sent to its
  replacement; death listeners are told (the generation being written drops
  index entries the dead worker wrote for batches that were never delivered).
  After ``max_restarts`` deaths in an epoch the pool raises :class:`WorkerError`.
* Workers exit on :class:`Stop`, on EOF of their pipe, or when their parent
  pid changes (checked every second while idle), so a SIGKILLed training
  process does not leave orphans.
* :meth:`WorkerPool.shutdown` sends Stop, joins with a timeout, then
  terminates and finally kills what is left. It is idempotent and is also
  run by the loader's ``weakref.finalize`` (garbage collection, interpreter
  exit).

``docs/ARCHITECTURE.md``, "Shutdown rules", puts these rules next to the others.
"""

from __future__ import annotations

import collections
import concurrent.futures
import errno
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import multiprocessing.process
import functools
import os
import queue
import signal
import threading
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Sequence, Union

from ...errors import WorkerError
from .. import messages as m
from ..base import DeathListeners, StuckWorker
from .start import context_for, forks, start
from .stacks import process_stack, thread_stack
from .worker import worker_main

log = logging.getLogger(__name__)

#: A worker: a process, or a thread of this process (``use_threading``).
Worker = Union[multiprocessing.process.BaseProcess, threading.Thread]

#: torch's message when a batch cannot be received for want of file descriptors.
TOO_MANY_FILES = ("Too many open files. Communication with the workers is no longer possible. Please increase the "
                  "limit using `ulimit -n` in the shell or change the sharing strategy by calling "
                  "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code")
#: Seconds between liveness checks while waiting for results.
POLL_INTERVAL = 0.5
#: Seconds a worker gets to exit after Stop before it is terminated.
JOIN_TIMEOUT = 3.0


@dataclass
class WorkerHandle:
    worker_id: int
    process: Worker  # a process, or a thread (use_threading)
    conn: mpc.Connection
    shard_id: str = ""
    pid: int | None = None
    outstanding: collections.deque[m.Task] = field(default_factory=collections.deque)
    ready: bool = False
    eof: bool = False
    stack_fd: int = -1  # the worker's stack-dump file (see worker.stack_dump_file)

    @property
    def is_thread(self) -> bool:
        return isinstance(self.process, threading.Thread)

    @property
    def os_process(self) -> multiprocessing.process.BaseProcess | None:
        """The worker's process (``None`` for a thread)."""
        return None if isinstance(self.process, threading.Thread) else self.process

    def alive(self) -> bool:
        return bool(self.process.is_alive())


class WorkerPool(DeathListeners):
    """A fixed number of worker processes (or threads) with per-worker pipes.

    The default :class:`~loader.executors.base.Executor` (see the shutdown note above).
    """

    writes_local_store = True  # workers run on this machine

    def __init__(self, make_config: Callable[[int], m.WorkerConfig], nb_worker: int, use_threading: bool,
                 start_method: str, max_restarts: int, dataset_module: str | None = None,
                 in_turn: bool = False, copies: bool = False) -> None:
        self.make_config = make_config
        self.copies = copies  # the workers hold a stream's copies: one that dies cannot be replaced
        self.in_turn = in_turn  # torch's dealing: LoaderSettings.deals_in_turn
        self.nb_worker = nb_worker
        self.use_threading = use_threading
        self.start_method = start_method  # "auto": fork or spawn, start by start (process/start.py)
        self.dataset_module = dataset_module  # what a forkserver imports before it forks workers
        self.max_restarts = max_restarts
        self.restarts = 0
        self._workers: list[WorkerHandle] = []
        DeathListeners.__init__(self)
        self.closed = False
        self._flushing: set[int] = set()  # workers asked to close their shard, not done yet
        self._spawner: _Spawner | None = None
        if use_threading or (start_method == "auto" and forks(first=True)):
            # Threads, or forks from this thread (the only one, or a script's that a spawn would run
            # again): done in a few ms, here. A forked worker's parent-death signal follows this
            # thread, the main one (process/worker.py).
            self._starting = [_done(self._start(wid, first=True)) for wid in range(nb_worker)]
        else:
            # Processes start from a thread of their own, so the constructor does not wait for them.
            self._spawner = _Spawner()
            self._starting = [self._spawner.submit(functools.partial(self._start, wid, True))
                              for wid in range(nb_worker)]

    @property
    def workers(self) -> list[WorkerHandle]:
        """The workers' handles (waits for the ones still starting)."""
        if self._starting:
            starting, self._starting = self._starting, []
            failed: BaseException | None = None
            for future in starting:
                try:
                    self._workers.append(future.result())
                except BaseException as exc:  # the others started: kept, so that shutdown() stops them
                    failed = failed or exc
            if failed is not None:
                raise failed
        return self._workers

    def _spawn(self, wid: int) -> WorkerHandle:
        """Start worker `wid` now (a replacement), from the spawner thread (never a fork of this process,
        which by now runs threads and holds slots: see :mod:`loader.executors.process.start`)."""
        if self.use_threading:
            return self._start(wid, first=False)
        if self._spawner is None:
            self._spawner = _Spawner()
        return self._spawner.submit(functools.partial(self._start, wid, False)).result()

    def _start(self, wid: int, first: bool) -> WorkerHandle:
        parent_conn, child_conn = mp.Pipe(duplex=True)
        config = self.make_config(wid)
        proc: Worker
        if self.use_threading:
            proc = threading.Thread(target=worker_main, args=(child_conn, config, False),
                                    name=f"cachestore-worker-{wid}", daemon=True)
            proc.start()
        else:
            ctx = context_for(self.start_method, first, self.dataset_module)
            process = ctx.Process(target=worker_main, args=(child_conn, config),  # type: ignore[attr-defined]
                                  name=f"cachestore-worker-{wid}", daemon=True)
            start(process, ctx.get_start_method())
            proc = process
        if not self.use_threading:
            child_conn.close()  # only the child holds its end: its death gives us EOF
        return WorkerHandle(wid, proc, parent_conn, shard_id=config.shard_id, pid=getattr(proc, "pid", os.getpid()))

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None and not w.is_thread]

    def idle_workers(self) -> int:
        return sum(not w.outstanding for w in self.workers)

    def worker_pid(self, worker_id: int) -> int | None:
        return next((w.pid for w in self.workers if w.worker_id == worker_id), None)

    def stuck_workers(self, tasks: set[tuple[int, int, int]]) -> list[StuckWorker]:
        stuck = []
        for w in self.workers:
            if any((t.epoch, t.seq, t.part) in tasks for t in w.outstanding):
                running = w.outstanding[0] if w.outstanding else None
                stuck.append(StuckWorker(w.worker_id, w.pid, running, (thread_stack(w.process.ident) if w.is_thread else process_stack(w.pid, w.stack_fd))))
        return stuck

    def begin_epoch(self) -> None:
        self.restarts = 0

    def retire_slots(self, names: Sequence[str]) -> None:
        """Tell every worker to close slots `names`; it does before its next task (messages keep their order).

        A replacement started later never mapped them: a slot retires only when no task holds it.
        """
        if not names:
            return
        msg = m.RetireSlots(tuple(names))
        for worker in self.workers:
            self._send(worker, msg)

    def submit(self, task: m.Task) -> None:
        # The parts of one batch go to different workers (a batch split so that they compute it
        # together: loader.epochs.scheduler, split_ends; one worker given both halves of the last
        # batch ends the epoch half a batch late). Then the least batch work queued, in samples,
        # so half batches weigh half; a worker takes batch tasks before queued background chunks,
        # so those only break ties.
        def load(w: WorkerHandle) -> tuple[bool, int, int]:
            sibling = any(t.epoch == task.epoch and t.seq == task.seq for t in w.outstanding)
            work = sum(len(t.indices) for t in w.outstanding if t.epoch != m.BACKGROUND_EPOCH)
            return sibling, work, len(w.outstanding)
        if self.in_turn and task.epoch != m.BACKGROUND_EPOCH:
            # Batch i of an epoch to worker i mod N, as torch deals them (a background chunk has no turn).
            worker = self.workers[(task.seq + task.part) % len(self.workers)]
        else:
            worker = min(self.workers, key=load)
        worker.outstanding.append(task)
        self._send(worker, task)

    def send_to(self, worker_id: int, msg: m.Command) -> None:
        """Send `msg` to worker `worker_id` (a stream's copy lives in one worker)."""
        self._send(next(w for w in self.workers if w.worker_id == worker_id), msg)

    def _send(self, worker: WorkerHandle, msg: m.Command) -> None:
        try:
            worker.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the death is handled when its sentinel fires

    def next_message(self, timeout: float | None = None) -> m.Message | None:
        """The next message from any worker; restarts dead workers meanwhile.

        Returns ``None`` when `timeout` passes without a message.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            conns = {w.conn: w for w in self.workers}
            waitables: list[mpc.Connection | int] = list(conns)
            waitables += [proc.sentinel for w in self.workers if (proc := w.os_process) is not None]
            wait = POLL_INTERVAL if deadline is None else max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            ready = mpc.wait(waitables, timeout=wait)
            for obj in ready:
                worker = conns.get(obj) if isinstance(obj, mpc.Connection) else None
                if worker is None:
                    continue
                try:
                    msg = worker.conn.recv()
                except (EOFError, OSError, RuntimeError) as exc:
                    # torch tensors in a stream's batches travel as file descriptors: none left to receive one
                    if "ancdata" in str(exc) or getattr(exc, "errno", None) == errno.EMFILE:
                        raise RuntimeError(TOO_MANY_FILES) from exc
                    if isinstance(exc, RuntimeError):
                        raise
                    worker.eof = True  # it died or is exiting: replaced below
                    continue
                return self._account(worker, msg)
            for worker in list(self.workers):
                if worker.eof or not worker.alive():
                    if not worker.eof and self._has_data(worker):
                        continue  # read what it sent before dying first
                    worker.process.join(JOIN_TIMEOUT)
                    self._replace(worker)
            if deadline is not None and time.monotonic() >= deadline:
                return None

    @staticmethod
    def _has_data(worker: WorkerHandle) -> bool:
        try:
            return bool(worker.conn.poll())
        except (EOFError, OSError):
            return False

    def _account(self, worker: WorkerHandle, msg: m.Message) -> m.Message:
        if isinstance(msg, m.Ready):
            worker.ready = True
            worker.pid = msg.pid
            worker.stack_fd = msg.stack_fd
            return msg
        if isinstance(msg, (m.BatchDone, m.TaskFailed)) and msg.seq >= 0:
            for i, task in enumerate(worker.outstanding):
                if (task.epoch, task.seq, task.part) == (msg.epoch, msg.seq, msg.part):
                    del worker.outstanding[i]
                    break
        return msg

    def _replace(self, dead: WorkerHandle) -> None:
        code = getattr(dead.process, "exitcode", None)
        self.restarts += 1
        how = f"exit code {code}" if code is not None and code >= 0 else (
            f"signal {-code}" if code is not None else "thread ended")
        if self.copies:
            raise WorkerError(f"stream worker {dead.worker_id} (pid {dead.pid}) exited unexpectedly ({how}): a "
                              "stream cannot be taken up again where a dead worker left it")
        if self.restarts > self.max_restarts:
            hint = ("Look for out-of-memory kills or crashes in native code of the dataset" if dead.ready else
                    "It died while starting: if the script creates the loader at import time, put that code "
                    "under `if __name__ == '__main__':` (a worker started by spawn or a forkserver imports the main "
                    "module)")
            raise WorkerError(f"loader worker {dead.worker_id} (pid {dead.pid}) died ({how}); "
                              f"{self.restarts} worker deaths, more than max_worker_restarts={self.max_restarts}. "
                              + hint)
        log.warning("loader worker %d (pid %s) died (%s); restarting it and re-running %d unfinished batches",
                    dead.worker_id, dead.pid, how, len(dead.outstanding))
        self.notify_death(dead.shard_id)
        dead.conn.close()
        replacement = self._spawn(dead.worker_id)
        self._workers[self._workers.index(dead)] = replacement
        for task in dead.outstanding:
            replacement.outstanding.append(task)
            self._send(replacement, task)
        if dead.worker_id in self._flushing:
            self._send(replacement, m.FlushShard())  # its predecessor's shard is on disk already

    def start_flush(self) -> None:
        """Ask every worker to close its shard; the answers come as ``ShardFlushed`` messages."""
        for w in self.workers:
            self._send(w, m.FlushShard())

    def wait_ready(self, timeout: float | None) -> None:
        """Wait until every worker has run its initialisation (``worker_init_fn``); raise the first
        failure there, as torch's stateful loader does at ``iter()``. Called before any task is sent,
        so the only messages are the workers' ``Ready`` and their initialisation failures."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while not all(w.ready for w in self.workers):
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self.next_message(timeout=left)
            if msg is None:
                waiting = sorted(w.worker_id for w in self.workers if not w.ready)
                raise WorkerError(f"workers {waiting} did not finish starting within {timeout:.0f} s (timeout=)")
            if isinstance(msg, m.TaskFailed) and msg.kind == "init":
                raise msg.exception(self.worker_pid(msg.worker_id))

    def flush_shards(self, timeout: float = 120.0) -> list[str]:
        """Ask every worker to close its shard; wait for all; return their errors."""
        self.start_flush()
        pending = self._flushing = {w.worker_id for w in self.workers}
        try:
            errors: list[str] = []
            deadline = time.monotonic() + timeout
            while pending:
                msg = self.next_message(timeout=max(0.0, deadline - time.monotonic()))
                if msg is None:
                    raise WorkerError(f"workers {sorted(pending)} did not close their shards within {timeout:.0f} s")
                if isinstance(msg, m.ShardFlushed):
                    pending.discard(msg.worker_id)
                    if msg.error:
                        errors.append(msg.error)
                elif isinstance(msg, m.TaskFailed) and msg.kind == "init":
                    raise msg.exception()
        finally:
            self._flushing = set()
        return errors

    def shutdown(self) -> None:
        """Stop every worker (see the shutdown note). Idempotent."""
        if self.closed:
            return
        self.closed = True
        for w in self.workers:
            self._send(w, m.Stop())
        deadline = time.monotonic() + JOIN_TIMEOUT
        for w in self.workers:
            w.process.join(max(0.0, deadline - time.monotonic()))
        for w in self.workers:
            proc = w.os_process
            if proc is not None and proc.is_alive():
                proc.terminate()
                proc.join(1.0)
                if proc.is_alive():
                    proc.kill()
                    proc.join(1.0)
            try:
                w.conn.close()
            except OSError:
                pass
        self._workers = []
        self._close_spawner()

    def kill(self) -> None:
        """Stop workers without waiting for them to finish their task (errors, abandoned epochs)."""
        for w in self.workers:
            proc = w.os_process
            if proc is not None and proc.is_alive():
                proc.kill()
        for w in self.workers:
            w.process.join(JOIN_TIMEOUT)
            try:
                w.conn.close()
            except OSError:
                pass
        self._workers = []
        self.closed = True
        self._close_spawner()

    def _close_spawner(self) -> None:
        # Only after the workers are gone: its thread's exit is their parent-death signal.
        spawner, self._spawner = self._spawner, None
        if spawner is not None:
            spawner.close()


def forks_afresh(use_threading: bool, start_method: str) -> bool:
    """Whether a pool started now forks its workers from this process (processes, not threads;
    ``start_method`` ``"fork"``, or ``"auto"`` where forking is safe): a fresh fork holds no page of
    its own, where a worker that computed samples holds a copy of every page of the dataset's
    objects it read (``docs/ARCHITECTURE.md``, "Memory with many workers")."""
    if use_threading:
        return False
    return start_method == "fork" or (start_method == "auto" and forks(first=True))


def _done(value: WorkerHandle) -> concurrent.futures.Future[WorkerHandle]:
    future: concurrent.futures.Future[WorkerHandle] = concurrent.futures.Future()
    future.set_result(value)
    return future


class _Spawner:
    """Starts worker processes from one thread that lives as long as the pool.

    Two reasons for a thread of its own: the loader's constructor returns while
    the workers start, so their start overlaps whatever the training script does
    next (building the model); and a worker's parent-death signal (Linux) fires
    when the *thread* that started it exits, so that thread must outlive the
    workers - neither the constructor's thread nor any other may be it.
    """

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[tuple[Callable[[], WorkerHandle], Future[WorkerHandle]] | None] = \
            queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="cachestore-spawner", daemon=True)
        self._thread.start()

    def submit(self, fn: Callable[[], WorkerHandle]) -> Future[WorkerHandle]:
        future: Future[WorkerHandle] = Future()
        self._queue.put((fn, future))
        return future

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            fn, future = item
            try:
                future.set_result(fn())
            except BaseException as exc:  # handed to whoever waits for this worker
                future.set_exception(exc)

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(JOIN_TIMEOUT)
