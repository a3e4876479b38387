"""The loop of a worker process (or thread): receive tasks, run them, answer.

See the shutdown note in :mod:`loader.executors.process.pool` for how a
worker exits, and ``docs/ARCHITECTURE.md`` for the path of a batch.
"""

from __future__ import annotations

import collections
import contextlib
import ctypes
import logging
import multiprocessing
import os
import re
import signal
import sys
from typing import Any

from cachestore.errors import CorruptSampleError
from cachestore.space.scratch import pid_alive

from ...settings import EpochMode
from .. import messages as m
from ..producer import BatchProducer, task_failure
from ..seeds import seed_torch_only, seed_worker, worker_seed
from ..stream_copy import StreamCopy
from ..worker_info import WorkerIdentity
from .segments import WorkerSegments, gather_batch, write_batch
from .stacks import stack_dump_file

log = logging.getLogger(__name__)


def run_task(producer: BatchProducer, segments: WorkerSegments, task: m.Task, worker_id: int) -> m.BatchDone:
    """Run one task and put its batch into the task's slot."""
    if task.mode == EpochMode.READ and producer.gathers_whole(task):
        try:
            meta = gather_batch(segments, task.slot, task.slot_name, task.slot_size,
                                producer.reader(task.reader), task.stored_at)
        except CorruptSampleError as exc:
            meta = write_batch(segments, task.slot, task.slot_name, task.slot_size, producer.recompute(task, exc))
        if meta is not None:
            return m.BatchDone(task.epoch, task.seq, task.part, worker_id, meta)
    out = producer.produce(task)
    # A task without a slot (background refresh) only writes the store.
    meta = write_batch(segments, task.slot, task.slot_name, task.slot_size, out.batch) if task.slot >= 0 else None
    return m.BatchDone(task.epoch, task.seq, task.part, worker_id, meta, shard_id=producer.shard_id,
                       written=out.written, records=out.records, budget_error=out.budget_error,
                       staged=out.staged, waited=out.waited)


def _next(waiting: collections.deque[m.Command]) -> m.Command:
    """The first message that is not a background chunk, else the oldest chunk; a stream's requests
    before a newer run's start are moot (dropped: nobody takes their answers)."""
    begins = [i for i, msg in enumerate(waiting) if isinstance(msg, m.StreamBegin)]
    if begins:
        kept = [msg for i, msg in enumerate(waiting) if i >= begins[-1] or not isinstance(msg, m.StreamNext)]
        waiting.clear()
        waiting.extend(kept)
    for i, msg in enumerate(waiting):
        if not (isinstance(msg, m.Task) and msg.epoch == m.BACKGROUND_EPOCH):
            del waiting[i]
            return msg
    return waiting.popleft()


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int, trainer: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies; exit now if it is dead already.

    Why: a worker stuck in ``__getitem__`` never gets back to the loop that
    notices a changed parent pid, so after a SIGKILL or SIGTERM of the
    training process it ran forever (reparented to init), holding memory,
    shared-memory slots and the GPU. SIGKILL, not a handler: it must work in
    native code that never returns to Python. The signal is armed only now,
    after the worker started, so the parent may already have died: hence the
    checks right after. `parent` is the process that forked this one: the
    training process (`trainer`), or a forkserver, which exits when the
    training process dies (:mod:`loader.executors.process.start`), its workers
    with it. Caveat (Linux): the signal fires when the parent *thread* that
    started this worker exits, so the loader starts its workers from a thread
    that lives as long as they do (the main thread, or a thread of its own).
    """
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
            log.warning("could not set the parent-death signal (errno %d): this worker may outlive "
                        "a killed training process", ctypes.get_errno())
    except (OSError, AttributeError):  # no libc prctl: keep the idle check of the parent pid
        pass
    if trainer != parent:
        # A forkserver's child holds the server's "alive" pipe, which keeps the server running until
        # every holder is gone: closed, the training process's death ends the server, and so us.
        server = getattr(sys.modules.get("multiprocessing.forkserver"), "_forkserver", None)
        alive = getattr(server, "_forkserver_alive_fd", None)
        if isinstance(alive, int):
            with contextlib.suppress(OSError):
                os.close(alive)
            server._forkserver_alive_fd = None  # type: ignore[union-attr]
    if orphaned(parent, trainer):
        raise SystemExit(0)  # orphaned before the signal was armed: nobody wants our results


def orphaned(parent: int, trainer: int) -> bool:
    """Whether the process that forked this worker, or the training process, is gone."""
    return os.getppid() != parent or (trainer != parent and not pid_alive(trainer))


class LazyDataset:
    """A worker's dataset, built at its first use: a worker that only reads cached samples never
    builds it, nor imports its module (and what that imports, torch maybe) when it came pickled.

    A failure to build it is kept (:attr:`failure`) and raised again at every use: the worker
    reports it as a failure to build its dataset, as the training process built it without one.
    """

    def __init__(self, config: m.WorkerConfig, seeded: bool) -> None:
        self._config = config
        self._seeded = seeded  # this process's generators were seeded at start (a process of its own)
        self._torch_seeded = "torch" in sys.modules  # seeded with the others, if seeded
        self._dataset: Any = None
        self.failure: BaseException | None = None
        seed = worker_seed(config.seed, config.worker_id) if config.seed is not None else 0
        self.identity = WorkerIdentity(config.worker_id, config.num_workers, seed, self.built, thread=not seeded)

    def built(self) -> Any:
        if self.failure is not None:
            raise self.failure
        if self._dataset is None:
            try:
                self._dataset = self._config.dataset.load().build()
            except BaseException as exc:
                self.failure = exc
                raise
            self.torch_arrived()
        return self._dataset

    def torch_arrived(self) -> None:
        """Once torch is imported (by the dataset's module, ``worker_init_fn``, a task): seed its generator
        as the process's others were at start, and give it torch's worker info (each done once)."""
        if self._torch_seeded or "torch" not in sys.modules:
            return
        self._torch_seeded = True
        if self._seeded:
            one_torch_thread()
            if self._config.seed is not None:
                seed_torch_only(self._config.seed, self._config.worker_id)
        self.identity.install()

    def __getitem__(self, index: int) -> Any:
        return self.built()[index]

    def __len__(self) -> int:
        return len(self.built())


def one_torch_thread() -> None:
    """torch's intra-op threads down to one, as torch's workers have them: the workers are the
    parallelism, and a pool forked from a training process that ran it deadlocks (a conv in ``__getitem__``)."""
    sys.modules["torch"].set_num_threads(1)


def initialise(config: m.WorkerConfig, dataset: LazyDataset, own_process: bool) -> None:
    """Seed a worker process's generators, give it torch's worker info, run ``worker_init_fn``.

    ``worker_init_fn`` arrived pickled together with the dataset (one pickle,
    :class:`~loader.executors.base.WorkerConfigFactory`), so a bound method
    ``dataset.open_files`` and ``get_worker_info().dataset`` change the very copy
    the worker's tasks run on.
    """
    if own_process and config.seed is not None:  # a process of its own (a thread shares ours)
        seed_worker(config.seed, config.worker_id)
    if own_process and "torch" in sys.modules:
        one_torch_thread()
    dataset.identity.install()
    if config.worker_init_fn is not None:
        init = config.worker_init_fn.load()
        dataset.torch_arrived()  # unpickling it may have imported torch
        init(config.worker_id)


def worker_main(conn: Any, config: m.WorkerConfig, watch_parent: bool = True) -> None:
    """Entry point of a worker process (or thread). See :mod:`loader.executors.process.pool` for shutdown."""
    parent = os.getppid()  # what forked us: the training process, or a forkserver
    trainer = parent
    stack_dump = None
    if watch_parent:
        # The training process's pid, as it passed it: getppid() is a forkserver's, or already
        # init's if the training process died while this worker was starting.
        spawner = multiprocessing.parent_process()
        trainer = spawner.pid if spawner is not None and spawner.pid else parent
        die_with_parent(parent, trainer)
        # Ctrl-C reaches the whole process group: the training process handles it and stops
        # its workers (see loader.executors.process.pool); a worker dying of it mid-task would only add noise.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack_dump = stack_dump_file()
    if config.gpu_index is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(config.gpu_index)
    dataset = LazyDataset(config, seeded=watch_parent)
    try:
        initialise(config, dataset, own_process=watch_parent)
    except BaseException as exc:
        conn.send(m.TaskFailed.from_exception(exc, epoch=-1, seq=-1, part=-1, worker_id=config.worker_id,
                                              index=None, kind="init"))
        return
    collate_fn = config.collate_fn.load() if config.collate_fn is not None else None
    read_transform = config.read_transform.load() if config.read_transform is not None else None
    producer = BatchProducer(dataset, collate_fn, config.shard_id, config.allow_pickle,
                             read_transform=read_transform)
    segments = WorkerSegments()
    stream = StreamCopy(dataset.built, config.worker_id, config.num_workers, own_process=watch_parent,
                        arrived=dataset.torch_arrived)
    conn.send(m.Ready(config.worker_id, os.getpid(), stack_dump.fileno() if stack_dump is not None else -1))
    waiting: collections.deque[m.Command] = collections.deque()
    try:
        while True:
            try:
                while conn.poll(0):  # take all that was sent: a batch may overtake background chunks
                    waiting.append(conn.recv())
            except (EOFError, OSError):
                return
            if not waiting:
                # Poll with a timeout so an orphaned worker notices its parent is gone.
                if not conn.poll(1.0) and watch_parent and orphaned(parent, trainer):
                    return
                continue
            msg = _next(waiting)
            if isinstance(msg, m.Stop):
                return
            if isinstance(msg, m.RetireSlots):
                segments.forget(msg.names)
                continue
            if isinstance(msg, (m.StreamBegin, m.StreamNext)):
                answer = stream.handle(msg, producer.collate)
                if answer is not None:
                    conn.send(answer)
                continue
            if isinstance(msg, m.FlushShard):
                try:
                    producer.close_shard()
                    conn.send(m.ShardFlushed(config.worker_id))
                except Exception as exc:
                    conn.send(m.ShardFlushed(config.worker_id, error=f"{type(exc).__name__}: {exc}"))
                continue
            try:
                dataset.torch_arrived()  # a task may have imported torch
                result: Any = run_task(producer, segments, msg, config.worker_id)
            except Exception as exc:
                result = task_failure(exc, msg, config.worker_id) if dataset.failure is None else \
                    m.TaskFailed.from_exception(dataset.failure, epoch=msg.epoch, seq=msg.seq, part=msg.part,
                                                worker_id=config.worker_id, index=None, kind="init")
            conn.send(result)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return
    finally:
        try:
            stream.close()
            producer.close()
        finally:
            segments.close()
            dataset.identity.uninstall()

