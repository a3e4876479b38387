"""The worker side: build the dataset, run tasks, write shards, fill slots.

:class:`BatchProducer` holds the per-process logic and is also used in the
training process itself when ``nb_worker=0``.
"""

from __future__ import annotations

import collections
import ctypes
import faulthandler
import logging
import multiprocessing
import os
import signal
import sys
import tempfile
from dataclasses import dataclass
from typing import Any

from cachestore import Reader, codec
from cachestore.collate import stack_samples
from cachestore.errors import BudgetExceededError, CacheStoreError, CorruptSampleError

from . import messages as m
from .settings import BudgetPolicy, EpochMode
from .shm import WorkerSegments, gather_batch, write_batch

log = logging.getLogger(__name__)


class SampleError(Exception):
    """Wraps an exception from ``dataset[index]`` with the index.

    The dataset's exception itself gets ``sample_index`` too: it is what the
    training process re-raises, with or without workers.
    """

    def __init__(self, index: int, cause: BaseException) -> None:
        super().__init__(index)
        self.index = index
        self.cause = cause
        tag_sample_index(cause, index)


def tag_sample_index(exc: BaseException, index: int) -> None:
    """Give the dataset's exception the index it was raised for (``exc.sample_index``)."""
    try:
        exc.sample_index = index  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass  # __slots__ without it: the index is still in the message's notes


@dataclass
class Produced:
    """What one task produced: the batch, and what it wrote into the generation."""

    batch: Any
    written: int = 0  # samples written into the task's shard
    records: list | None = None  # encoded samples for the training process to write
    budget_error: str | None = None  # why writing stopped, when the budget ran out
    staged: int = 0  # samples read back from the staging area instead of computed


class BatchProducer:
    """Turns tasks into batches: call the dataset, write the generation, read the store."""

    def __init__(self, dataset: Any, collate_fn: Any, shard_id: str, allow_pickle: bool) -> None:
        self.dataset = dataset
        self.collate = collate_fn or stack_samples
        self.custom_collate = collate_fn is not None
        self.shard_id = shard_id
        self.allow_pickle = allow_pickle
        self._shard: Any = None
        self._shard_token: Any = None
        self._staging: Any = None  # reads back samples a partial generation already holds
        self._staging_token: Any = None
        self._writing = True
        self._reader: Any = None
        self._reader_key: Any = None

    # generation shards ---------------------------------------------------
    def _shard_for(self, spec: Any) -> Any:
        if self._shard_token != spec.token:
            self.close_shard()
            self._shard = spec.open(self.shard_id)
            self._shard_token = spec.token
            self._writing = True
        return self._shard if self._writing else None

    def close_shard(self) -> None:
        shard, self._shard, self._shard_token = self._shard, None, None
        self._writing = True
        staging, self._staging, self._staging_token = self._staging, None, None
        if staging is not None:
            staging.close()
        if shard is not None:
            shard.close()

    def _staged(self, spec: Any, pos: int) -> Any:
        """Sample `pos` as the generation being written already holds it, ``None`` when it cannot be read here."""
        if spec is None:
            return None  # records travel to the training process: nothing to read from here
        if self._staging_token != spec.token:
            if self._staging is not None:
                self._staging.close()
            self._staging, self._staging_token = spec.open_staging(), spec.token
        if self._staging is None:
            return None
        try:
            return self._staging.read(pos)
        except CacheStoreError as exc:
            # Adoption checked every record: this is damage since. Serve a computed sample; the
            # stored one stays (it must not be written twice) and a cached read recomputes it.
            log.warning("%s; computing it from the dataset instead", exc)
            return None

    # reading ---------------------------------------------------------------
    def reader(self, key: tuple) -> Any:
        if self._reader_key != key:
            if self._reader is not None:
                self._reader.close()
            spec, generation = key
            self._reader = Reader.open(spec, generation)
            self._reader_key = key
        return self._reader

    # tasks -----------------------------------------------------------------
    def compute(self, task: m.Task) -> Produced:
        """Samples of `task` from the dataset, written to the shard if asked, collated."""
        shard = self._shard_for(task.shard) if task.mode == EpochMode.GENERATE and task.shard is not None else None
        positions = task.positions if task.positions is not None else task.indices
        samples, written, staged, budget_error = [], 0, 0, None
        records: list | None = [] if task.send_records else None
        present = task.present.tolist() if task.present is not None else None
        for k, (index, pos) in enumerate(zip(task.indices.tolist(), positions.tolist())):
            if present is not None and present[k]:
                # Already in the generation (written before an interruption): served, never rewritten.
                sample = self._staged(task.shard, pos)
                if sample is None:
                    sample = self._call(index)
                else:
                    staged += 1
                samples.append(sample)
                continue
            sample = self._call(index)
            samples.append(sample)
            if shard is not None:
                try:
                    shard.put(pos, sample)
                    written += 1
                except BudgetExceededError as exc:
                    budget_error = self._stop_writing(task, exc)
                    shard = None
            if records is not None:
                records.append((pos, codec.encode_record(*codec.flatten(sample, self.allow_pickle))))
        if shard is not None:
            try:
                shard.flush()  # before the result is sent: what was delivered is on disk
            except BudgetExceededError as exc:
                # A buffering backend (lmdb) meets the full disk here, not in put().
                budget_error = self._stop_writing(task, exc)
        return Produced(self.collate(samples) if task.collate else samples, written, records, budget_error, staged)

    def _call(self, index: int) -> Any:
        try:
            return self.dataset[index]
        except Exception as exc:
            raise SampleError(index, exc) from exc

    def _stop_writing(self, task: m.Task, exc: BudgetExceededError) -> str:
        """The generation does not fit: raise (policy "error") or stop writing it and keep serving."""
        if task.on_budget == BudgetPolicy.ERROR:
            raise exc
        self._writing = False
        return str(exc)

    def samples(self, indices: Any, epoch: int) -> list:
        """``dataset[i]`` for each of `indices`, in this process: a dataset error is raised as itself,
        with the index (``sample_index``) and a note saying where, as every other path does."""
        out = []
        for index in (int(i) for i in indices):
            try:
                out.append(self.dataset[index])
            except Exception as exc:
                tag_sample_index(exc, index)
                exc.add_note(f"raised by the dataset while computing sample {index} of epoch {epoch}")
                raise
        return out

    def read(self, task: m.Task, reader: Any = None) -> Any:
        """The batch from the committed generation; a corrupt record is a miss: recompute the batch."""
        reader = reader if reader is not None else self.reader(task.reader)
        try:
            if self.custom_collate:
                return self.collate([reader.get(int(i), copy=False) for i in task.positions])
            return reader.get_batch(task.positions)
        except CorruptSampleError as exc:
            return self.recompute(task, exc)

    def recompute(self, task: m.Task, exc: CorruptSampleError) -> Any:
        log.warning("%s; computing this batch from the dataset instead", str(exc))
        samples = []
        for index in task.indices.tolist():
            try:
                samples.append(self.dataset[index])
            except Exception as err:
                raise SampleError(index, err) from err
        return self.collate(samples)

    def produce(self, task: m.Task) -> Produced:
        """Run `task` in this process (read, or compute and maybe write)."""
        if task.mode == EpochMode.READ:
            return Produced(self.read(task))
        return self.compute(task)

    def close(self) -> None:
        try:
            self.close_shard()
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None


def _failure(exc: BaseException, task: m.Task | None, worker_id: int) -> m.TaskFailed:
    epoch, seq, part = (task.epoch, task.seq, task.part) if task is not None else (-1, -1, -1)
    if isinstance(exc, SampleError):
        return m.TaskFailed.from_exception(exc.cause, epoch=epoch, seq=seq, part=part, worker_id=worker_id,
                                           index=exc.index, kind="dataset")
    kind = "budget" if isinstance(exc, BudgetExceededError) else (
        "store" if isinstance(exc, CacheStoreError) else "dataset")
    failed = m.TaskFailed.from_exception(exc, epoch=epoch, seq=seq, part=part, worker_id=worker_id,
                                         index=None, kind=kind)
    if isinstance(exc, BudgetExceededError) and exc.fits_samples is not None:
        failed.extra["fits_samples"] = exc.fits_samples
    return failed


def run_task(producer: BatchProducer, segments: WorkerSegments, task: m.Task, worker_id: int) -> m.BatchDone:
    """Run one task and put its batch into the task's slot."""
    if task.mode == EpochMode.READ and not producer.custom_collate and task.collate:
        try:
            meta = gather_batch(segments, task.slot, task.slot_name, task.slot_size,
                                producer.reader(task.reader), task.positions)
        except CorruptSampleError as exc:
            meta = write_batch(segments, task.slot, task.slot_name, task.slot_size, producer.recompute(task, exc))
        if meta is not None:
            return m.BatchDone(task.epoch, task.seq, task.part, worker_id, meta)
    out = producer.produce(task)
    # A task without a slot (background refresh) only writes the store.
    meta = write_batch(segments, task.slot, task.slot_name, task.slot_size, out.batch) if task.slot >= 0 else None
    return m.BatchDone(task.epoch, task.seq, task.part, worker_id, meta, shard_id=producer.shard_id,
                       written=out.written, records=out.records, budget_error=out.budget_error,
                       staged=out.staged)


def _next(waiting: collections.deque) -> Any:
    """The first message that is not a background chunk, else the oldest chunk."""
    for i, msg in enumerate(waiting):
        if not (isinstance(msg, m.Task) and msg.epoch == m.BACKGROUND_EPOCH):
            del waiting[i]
            return msg
    return waiting.popleft()


def stack_dump_file() -> Any:
    """An unlinked temporary file that this process's Python stack is dumped into on SIGUSR1.

    When a batch times out, the training process signals the worker and reads
    the dump through ``/proc/<pid>/fd/<fd>``: faulthandler writes it from the
    signal handler itself, so it works even while ``__getitem__`` is stuck in C
    code. Unlinked from the start, the file disappears with the process.
    """
    dump = tempfile.TemporaryFile(prefix="cachestore-stack-")
    faulthandler.register(signal.SIGUSR1, file=dump, all_threads=True)
    return dump


_PR_SET_PDEATHSIG = 1


def die_with_parent(parent: int) -> None:
    """Have the kernel SIGKILL this process when its parent dies; exit now if it is dead already.

    Why: a worker stuck in ``__getitem__`` never gets back to the loop that
    notices a changed parent pid, so after a SIGKILL or SIGTERM of the
    training process it ran forever (reparented to init), holding memory,
    shared-memory slots and the GPU. SIGKILL, not a handler: it must work in
    native code that never returns to Python. The signal is armed only now,
    after the spawned interpreter started, so the parent may already have died:
    hence the check of ``getppid()`` right after. Caveat (Linux): the signal
    fires when the parent *thread* that started this worker exits, so the
    loader must start its workers from a thread that lives as long as they do.
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
    if os.getppid() != parent:
        raise SystemExit(0)  # orphaned before the signal was armed: nobody wants our results


def worker_main(conn: Any, config: m.WorkerConfig, watch_parent: bool = True) -> None:
    """Entry point of a worker process (or thread). See :mod:`loader.pool` for shutdown."""
    parent = os.getppid()
    stack_dump = None
    if watch_parent:
        # The pid that started us, as the training process passed it: getppid() may already be
        # init's if it died while this interpreter was starting.
        spawner = multiprocessing.parent_process()
        parent = spawner.pid if spawner is not None and spawner.pid else parent
        die_with_parent(parent)
        # Ctrl-C reaches the whole process group: the training process handles it and stops
        # its workers (see loader.pool); a worker dying of it mid-task would only add noise.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stack_dump = stack_dump_file()
    if config.gpu_index is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = str(config.gpu_index)
    try:
        dataset = config.dataset_class(**config.dataset_params)
    except BaseException as exc:
        conn.send(m.TaskFailed.from_exception(exc, epoch=-1, seq=-1, part=-1, worker_id=config.worker_id,
                                              index=None, kind="init"))
        return
    producer = BatchProducer(dataset, config.collate_fn, config.shard_id, config.allow_pickle)
    segments = WorkerSegments()
    conn.send(m.Ready(config.worker_id, os.getpid(), stack_dump.fileno() if stack_dump is not None else -1))
    waiting: collections.deque = collections.deque()
    try:
        while True:
            try:
                while conn.poll(0):  # take all that was sent: a batch may overtake background chunks
                    waiting.append(conn.recv())
            except (EOFError, OSError):
                return
            if not waiting:
                # Poll with a timeout so an orphaned worker notices its parent is gone.
                if not conn.poll(1.0) and watch_parent and os.getppid() != parent:
                    return
                continue
            msg = _next(waiting)
            if isinstance(msg, m.Stop):
                return
            if isinstance(msg, m.RetireSlots):
                segments.forget(msg.names)
                continue
            if isinstance(msg, m.FlushShard):
                try:
                    producer.close_shard()
                    conn.send(m.ShardFlushed(config.worker_id))
                except Exception as exc:
                    conn.send(m.ShardFlushed(config.worker_id, error=f"{type(exc).__name__}: {exc}"))
                continue
            try:
                result: Any = run_task(producer, segments, msg, config.worker_id)
            except Exception as exc:
                result = _failure(exc, msg, config.worker_id)
            conn.send(result)
    except (BrokenPipeError, EOFError, ConnectionResetError):
        return
    finally:
        try:
            producer.close()
        finally:
            segments.close()
