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

``docs/ARCHITECTURE.md`` (Shutdown) puts these rules next to the others.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing as mp
import multiprocessing.connection as mpc
import os
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from . import messages as m
from .errors import WorkerError
from .executor import DeathListener
from .worker import worker_main

log = logging.getLogger(__name__)

#: Seconds between liveness checks while waiting for results.
POLL_INTERVAL = 0.5
#: Seconds a worker gets to exit after Stop before it is terminated.
JOIN_TIMEOUT = 3.0


@dataclass
class WorkerHandle:
    worker_id: int
    process: Any  # multiprocessing.Process or threading.Thread
    conn: Any
    shard_id: str = ""
    pid: int | None = None
    outstanding: collections.deque = field(default_factory=collections.deque)
    ready: bool = False
    eof: bool = False

    @property
    def is_thread(self) -> bool:
        return isinstance(self.process, threading.Thread)

    def alive(self) -> bool:
        return self.process.is_alive()


class WorkerPool:
    """A fixed number of worker processes (or threads) with per-worker pipes.

    The default :class:`~loader.executor.Executor` (see the shutdown note above).
    """

    writes_local_store = True  # workers run on this machine

    def __init__(self, make_config: Callable[[int], m.WorkerConfig], nb_worker: int, use_threading: bool,
                 start_method: str, max_restarts: int) -> None:
        self.make_config = make_config
        self.nb_worker = nb_worker
        self.use_threading = use_threading
        self.ctx = mp.get_context(start_method)
        self.max_restarts = max_restarts
        self.restarts = 0
        self.workers: list[WorkerHandle] = []
        self._listeners: list[DeathListener] = []
        self.closed = False
        self._flushing: set[int] = set()  # workers asked to close their shard, not done yet
        for wid in range(nb_worker):
            self.workers.append(self._start(wid))

    def _start(self, wid: int) -> WorkerHandle:
        parent_conn, child_conn = mp.Pipe(duplex=True)
        config = self.make_config(wid)
        if self.use_threading:
            proc: Any = threading.Thread(target=worker_main, args=(child_conn, config, False),
                                         name=f"cachestore-worker-{wid}", daemon=True)
        else:
            proc = self.ctx.Process(target=worker_main, args=(child_conn, config),
                                    name=f"cachestore-worker-{wid}", daemon=True)
        proc.start()
        if not self.use_threading:
            child_conn.close()  # only the child holds its end: its death gives us EOF
        return WorkerHandle(wid, proc, parent_conn, shard_id=config.shard_id, pid=getattr(proc, "pid", os.getpid()))

    def pids(self) -> list[int]:
        return [w.pid for w in self.workers if w.pid is not None and not w.is_thread]

    def worker_pid(self, worker_id: int) -> int | None:
        return next((w.pid for w in self.workers if w.worker_id == worker_id), None)

    def begin_epoch(self) -> None:
        self.restarts = 0

    def add_death_listener(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def remove_death_listener(self, listener: DeathListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def submit(self, task: m.Task) -> None:
        worker = min(self.workers, key=lambda w: len(w.outstanding))
        worker.outstanding.append(task)
        self._send(worker, task)

    def _send(self, worker: WorkerHandle, msg: Any) -> None:
        try:
            worker.conn.send(msg)
        except (BrokenPipeError, ConnectionResetError, OSError):
            pass  # the death is handled when its sentinel fires

    def next_message(self, timeout: float | None = None) -> Any:
        """The next message from any worker; restarts dead workers meanwhile.

        Returns ``None`` when `timeout` passes without a message.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            conns = {w.conn: w for w in self.workers}
            waitables: list[Any] = list(conns)
            if not self.use_threading:
                waitables += [w.process.sentinel for w in self.workers]
            wait = POLL_INTERVAL if deadline is None else max(0.0, min(POLL_INTERVAL, deadline - time.monotonic()))
            ready = mpc.wait(waitables, timeout=wait)
            for obj in ready:
                worker = conns.get(obj)
                if worker is None:
                    continue
                try:
                    msg = worker.conn.recv()
                except (EOFError, OSError):
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
            return worker.conn.poll()
        except (EOFError, OSError):
            return False

    def _account(self, worker: WorkerHandle, msg: Any) -> Any:
        if isinstance(msg, m.Ready):
            worker.ready = True
            worker.pid = msg.pid
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
        if self.restarts > self.max_restarts:
            hint = ("Look for out-of-memory kills or crashes in native code of the dataset" if dead.ready else
                    "It died while starting: if the script creates the loader at import time, put that code "
                    "under `if __name__ == '__main__':` (workers start with spawn and import the main module)")
            raise WorkerError(f"loader worker {dead.worker_id} (pid {dead.pid}) died ({how}); "
                              f"{self.restarts} worker deaths, more than max_worker_restarts={self.max_restarts}. "
                              + hint)
        log.warning("loader worker %d (pid %s) died (%s); restarting it and re-running %d unfinished batches",
                    dead.worker_id, dead.pid, how, len(dead.outstanding))
        for listener in list(self._listeners):
            listener(dead.shard_id)
        dead.conn.close()
        replacement = self._start(dead.worker_id)
        self.workers[self.workers.index(dead)] = replacement
        for task in dead.outstanding:
            replacement.outstanding.append(task)
            self._send(replacement, task)
        if dead.worker_id in self._flushing:
            self._send(replacement, m.FlushShard())  # its predecessor's shard is on disk already

    def flush_shards(self, timeout: float = 120.0) -> list[str]:
        """Ask every worker to close its shard; wait for all; return their errors."""
        for w in self.workers:
            self._send(w, m.FlushShard())
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
            if not w.is_thread and w.process.is_alive():
                w.process.terminate()
                w.process.join(1.0)
                if w.process.is_alive():
                    w.process.kill()
                    w.process.join(1.0)
            try:
                w.conn.close()
            except OSError:
                pass
        self.workers = []

    def kill(self) -> None:
        """Stop workers without waiting for them to finish their task (errors, abandoned epochs)."""
        for w in self.workers:
            if not w.is_thread and w.process.is_alive():
                w.process.kill()
        for w in self.workers:
            w.process.join(JOIN_TIMEOUT)
            try:
                w.conn.close()
            except OSError:
                pass
        self.workers = []
        self.closed = True
