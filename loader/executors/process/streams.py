"""The workers of a stream: each iterates its own copy of an iterable dataset, as torch's workers do.

A stream (an ``IterableDataset``, or any object with ``__iter__`` and no
``__getitem__``) has no indices to hand out: torch's ``DataLoader`` gives each
worker a copy, lets it split the work through ``get_worker_info()``, asks the
workers for batches in turn and serves them in that order, a worker whose
copy ran out dropping out of the turn. :class:`StreamWorkers` does the same:
per epoch, every worker starts a new iterator of its copy (:class:`Begin`) and
answers each :class:`Next` with its next batch (collated where it is served
as it is; the samples themselves where the training process writes them into a
generation, ``docs/ARCHITECTURE.md``, "Streams"). Each worker has
`prefetch` requests in flight, as torch's ``prefetch_factor``.

A stream whose dataset or iterator has its own ``state_dict()``/``load_state_dict()``
(torchdata's ``Stateful``) sends its copy's position with each batch (:func:`position`: both
states, as torchdata records them); :class:`StreamAt` is where an epoch got (each worker's
position after the last batch taken from it, whose turn is next), and an epoch begun from one
continues there (:func:`iterate_from`: the dataset's state loaded before ``iter()``, the
iterator's into the iterator ``__iter__`` returned), instead of iterating the stream again from
its start. Each epoch reseeds the workers' generators from the run's seed and the epoch
(:func:`loader.executors.seeds.epoch_reseed`): an epoch served again, or resumed, draws the same.

Workers die with the training process (the parent-death signal of
:func:`~loader.executors.process.worker.die_with_parent`), ignore Ctrl-C, and
every wait on them watches their sentinels with the loader's ``timeout``.
"""

from __future__ import annotations

import collections
import errno
import importlib
import importlib.util
import multiprocessing
import multiprocessing.connection
import os
import signal
from dataclasses import dataclass
from typing import Any, Callable, Generator, Iterator

from ...datapipes import is_datapipe, seed_pipes, shard
from ...dataset import CollateFn, DatasetSource, WorkerInitFn
from ...errors import WorkerError, WorkerTimeoutError
from .. import messages as m
from ..seeds import seed_worker
from ..transport import Portable
from ..worker_info import WorkerIdentity
from .positions import StreamAt, iterate_from, position, take
from .start import context_for, start
from .worker import die_with_parent, orphaned

#: torch's message when a batch cannot be received for want of file descriptors.
TOO_MANY_FILES = ("Too many open files. Communication with the workers is no longer possible. Please increase the "
                  "limit using `ulimit -n` in the shell or change the sharing strategy by calling "
                  "`torch.multiprocessing.set_sharing_strategy('file_system')` at the beginning of your code")

#: Seconds a worker waits for its parent between checks that it is still there.
IDLE_POLL = 1.0


@dataclass(frozen=True)
class StreamConfig:
    """What a stream worker needs: its copy of the stream, its place among the workers, the batching."""

    dataset: Portable[DatasetSource]
    worker_id: int
    num_workers: int
    seed: int
    batch_size: int
    drop_last: bool
    collate_fn: Portable[CollateFn]
    worker_init_fn: Portable[WorkerInitFn] | None = None
    world: tuple[int, int] = (1, 0)  # torch.distributed's (world size, rank): a datapipe's shards


@dataclass(frozen=True)
class Begin:
    """Start epoch `epoch` (the run's tag, which answers carry): a new iterator of the worker's copy (after loading `state` into the copy, when
    given); batches are collated when `collate`; a datapipe's random pipes are seeded from `seed` first
    (the same in every worker); the worker's global generators from ``(reseed, worker_id)`` when given
    (a background refresh: each generation draws its own, however often the workers were started)."""

    epoch: int
    collate: bool
    seed: int | None = None
    state: Any = None
    reseed: int | None = None


@dataclass(frozen=True)
class Next:
    """One more batch of epoch `epoch`."""

    epoch: int


@dataclass(frozen=True)
class Stop:
    """Exit."""


@dataclass(frozen=True)
class Items:
    """A batch of `count` samples of epoch `epoch`: collated, or the list of samples; a stateful stream's
    copy's `state` after it."""

    epoch: int
    worker_id: int
    count: int
    items: Any
    state: Any = None


@dataclass(frozen=True)
class End:
    """The worker's copy of the stream ran out in epoch `epoch`, leaving the dataset at `state` (:func:`position`
    without the spent iterator's)."""

    epoch: int
    worker_id: int
    state: Any = None


def _pull(iterator: Iterator[Any], config: StreamConfig) -> list[Any] | None:
    """The next batch's samples, ``None`` when the stream ran out (a short last batch with ``drop_last``)."""
    samples = take(iterator, config.batch_size)
    if not samples or (config.drop_last and len(samples) < config.batch_size):
        return None
    return samples


def _close(iterator: Iterator[Any] | None) -> None:
    """End an iterator left before its end (a generator's ``finally`` closes its files now, not at exit)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # the stream's own clean-up failing must not fail the next epoch
            pass


def _latest(conn: Any, waiting: collections.deque[object]) -> None:
    """Take what was sent; a newer :class:`Begin` makes the requests before it moot."""
    while conn.poll(0):
        waiting.append(conn.recv())
    begins = [i for i, msg in enumerate(waiting) if isinstance(msg, (Begin, Stop))]
    for _ in range(begins[-1] if begins else 0):
        waiting.popleft()


def stream_worker_main(conn: Any, config: StreamConfig) -> None:
    """Entry point of a stream worker process."""
    parent = os.getppid()
    spawner = multiprocessing.parent_process()
    trainer = spawner.pid if spawner is not None and spawner.pid else parent
    die_with_parent(parent, trainer)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        if importlib.util.find_spec("torch") is not None:
            # A stream splits its work by get_worker_info(), which must answer from its first sample on, even
            # where torch is imported only inside __iter__ (too late for WorkerIdentity.install to see it).
            importlib.import_module("torch.utils.data")
        seed_worker(config.seed, config.worker_id)
        dataset = config.dataset.load().build()
        identity = WorkerIdentity(config.worker_id, config.num_workers, config.seed + config.worker_id,
                                  lambda: dataset, thread=False)
        identity.install()
        if is_datapipe(dataset):  # its sharding filters keep this worker's share, as torch's workers do
            shard(dataset, config.num_workers, config.worker_id, config.world)
        if config.worker_init_fn is not None:
            config.worker_init_fn.load()(config.worker_id)
        identity.install()  # torch imported by worker_init_fn
        collate = config.collate_fn.load()
    except BaseException as exc:
        conn.send(m.TaskFailed.from_exception(exc, epoch=-1, seq=-1, part=-1, worker_id=config.worker_id,
                                              index=None, kind="init"))
        return
    waiting: collections.deque[object] = collections.deque()
    epoch, iterator, collated, state = -1, None, True, None
    try:
        while True:
            _latest(conn, waiting)
            if not waiting:
                if not conn.poll(IDLE_POLL) and orphaned(parent, trainer):
                    return
                continue
            msg = waiting.popleft()
            if isinstance(msg, Stop):
                return
            if isinstance(msg, Begin):
                _close(iterator)
                epoch, iterator, collated, state = msg.epoch, None, msg.collate, msg.state
                if msg.seed is not None:
                    seed_pipes(dataset, msg.seed)
                if msg.reseed is not None:
                    seed_worker(msg.reseed, config.worker_id)
                continue
            if not isinstance(msg, Next) or msg.epoch != epoch:
                continue
            try:
                if iterator is None:
                    iterator = iterate_from(dataset, state)
                samples = _pull(iterator, config)
                if samples is None:
                    # An iterator that ran out is done: the next epoch starts a new one, from the dataset's state.
                    answer: object = End(epoch, config.worker_id, position(dataset, None))
                else:
                    answer = Items(epoch, config.worker_id, len(samples), collate(samples) if collated else samples,
                                   position(dataset, iterator))
            except Exception as exc:
                answer = m.TaskFailed.from_exception(exc, epoch=epoch, seq=-1, part=-1, worker_id=config.worker_id,
                                                     index=None, kind="dataset")
            conn.send(answer)
    except (BrokenPipeError, EOFError, ConnectionResetError, OSError):
        return


class StreamWorkers:
    """The worker processes of a stream and the turn they serve in (see the module docstring).

    Parameters
    ----------
    source
        The stream (its class and parameters, or the instance: each worker gets a copy).
    workers
        How many processes.
    seed
        Their generators are seeded from ``(seed, worker_id)``; torch's ``WorkerInfo.seed`` is ``seed + id``.
    batch_size, drop_last, collate_fn
        Each worker's batches, as torch's: up to `batch_size` samples, a short last one dropped with `drop_last`.
    prefetch
        Requests in flight per worker.
    timeout
        Seconds one wait may take (``None``: as long as it takes).
    pipe_seed
        A datapipe's: the seed of its random pipes in an epoch (:func:`loader.datapipes.epoch_seed`).
    """

    def __init__(self, source: DatasetSource, workers: int, seed: int, batch_size: int, drop_last: bool,
                 collate_fn: CollateFn, worker_init_fn: WorkerInitFn | None, prefetch: int,
                 timeout: float | None, start_method: str, pipe_seed: Callable[[int], int] | None = None,
                 world: tuple[int, int] = (1, 0)) -> None:
        self.timeout = timeout
        self.prefetch = max(1, prefetch)
        self.pipe_seed = pipe_seed
        dataset = Portable(source, "dataset")
        collate = Portable(collate_fn, "collate_fn")
        init = Portable(worker_init_fn, "worker_init_fn") if worker_init_fn is not None else None
        module = source.dataset_class.__module__
        self.conns: list[Any] = []
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.at: StreamAt | None = None  # a stateful stream's position after the latest batch items() gave
        self._runs = 0  # epochs begun so far (see items)
        self.end_at: StreamAt | None = None  # where the copies are after the latest epoch that ran to its end
        try:
            for worker_id in range(workers):
                ctx = context_for(start_method, True, module)
                ours, theirs = ctx.Pipe()
                config = StreamConfig(dataset, worker_id, workers, seed % 2**32, batch_size, drop_last, collate, init,
                                      world)
                proc = ctx.Process(target=stream_worker_main, args=(theirs, config),  # type: ignore[attr-defined]
                                   daemon=True, name=f"cachestore-stream-{worker_id}")
                start(proc, ctx.get_start_method())
                theirs.close()
                self.conns.append(ours)
                self.procs.append(proc)
        except BaseException:
            self.close()
            raise

    def items(self, epoch: int, collate: bool, resume: StreamAt | None = None,
              reseed: int | None = None) -> Generator[tuple[int, int, Any], None, None]:
        """``(worker_id, count, batch or samples)`` of epoch `epoch`, in torch's turn: worker 0's first batch,
        worker 1's first, ..., worker 0's second, each worker leaving the turn when its copy runs out; from
        position `resume` on, when given (a stateful stream's); `reseed`: see :class:`Begin`."""
        n = len(self.conns)
        # Each run of an epoch has its own tag, which the workers' answers carry: an epoch served again
        # (a state loaded into this loader) must not take the answers of its earlier run.
        tag, self._runs = self._runs, self._runs + 1
        states = list(resume.states) if resume is not None else [None] * n
        ended = list(resume.ended) if resume is not None else [False] * n
        arrived = resume.arrived if resume is not None else 0
        seed = self.pipe_seed(epoch) if self.pipe_seed is not None else None
        for worker in range(n):
            self._send(worker, Begin(tag, collate, seed, states[worker], reseed), epoch)
            for _ in range(self.prefetch if not ended[worker] else 0):
                self._send(worker, Next(tag), epoch)
        active = [w for w in range(n) if not ended[w]]
        pos = active.index(resume.next) if resume is not None and resume.next in active else 0
        self.at = self.end_at = None
        while active:
            worker = active[pos]
            msg = self._receive(worker, epoch, tag)
            if isinstance(msg, End):
                active.pop(pos)
                ended[worker] = True
                pos = pos % len(active) if active else 0
                states[worker] = msg.state  # ended: out of this epoch's turn, its dataset's state for the next
                continue
            self._send(worker, Next(tag), epoch)
            pos = (pos + 1) % len(active)
            arrived += msg.count
            if msg.state is not None:
                states[worker] = msg.state
            if any(state is not None for state in states):
                self.at = StreamAt(tuple(states), tuple(ended), active[pos], arrived)
            yield worker, msg.count, msg.items
        self.end_at = StreamAt(tuple(states), (False,) * n, 0, 0) if any(s is not None for s in states) else None

    def _send(self, worker: int, msg: object, epoch: int) -> None:
        """Send `msg` to worker `worker`; a worker that died (its pipe broken) is a :class:`WorkerError`."""
        try:
            self.conns[worker].send(msg)
        except (BrokenPipeError, ConnectionResetError):
            proc = self.procs[worker]
            proc.join(5.0)
            raise WorkerError(f"stream worker {worker} (pid {proc.pid}) exited unexpectedly (exit code "
                              f"{proc.exitcode}) before epoch {epoch}: a stream cannot be taken up again where a "
                              "dead worker left it") from None

    def _receive(self, worker: int, epoch: int, tag: int) -> Items | End:
        """Worker `worker`'s next answer in epoch `epoch`, begun as `tag` (an earlier run's are dropped)."""
        conn, proc = self.conns[worker], self.procs[worker]
        while True:
            ready = multiprocessing.connection.wait([conn, proc.sentinel], self.timeout)
            if not ready:
                raise WorkerTimeoutError(f"stream worker {worker} (pid {proc.pid}) gave no batch in {self.timeout} s "
                                         f"(timeout={self.timeout})")
            try:
                msg = conn.recv() if conn in ready and conn.poll(0) else None
            except (RuntimeError, OSError) as exc:
                # torch tensors travel as file descriptors: none left to receive one with
                if "ancdata" in str(exc) or getattr(exc, "errno", None) == errno.EMFILE:
                    raise RuntimeError(TOO_MANY_FILES) from exc
                msg = None
            except EOFError:
                msg = None
            if msg is None:
                proc.join(5.0)  # its pipe closed: it is dead, or about to be
                raise WorkerError(f"stream worker {worker} (pid {proc.pid}) exited unexpectedly (exit code "
                                  f"{proc.exitcode}) in epoch {epoch}: a stream cannot be taken up again where a "
                                  "dead worker left it")
            if isinstance(msg, m.TaskFailed):
                if msg.kind == "init" or msg.epoch == tag:
                    raise msg.exception(pid=proc.pid, epoch=epoch)
                continue
            if isinstance(msg, (Items, End)) and msg.epoch == tag:
                return msg

    def pids(self) -> list[int]:
        return [p.pid for p in self.procs if p.pid is not None]

    def close(self) -> None:
        """Stop the workers (killed when they do not stop within a second) and close the pipes."""
        for conn in self.conns:
            try:
                conn.send(Stop())
            except (OSError, ValueError):
                pass
        for proc in self.procs:
            proc.join(1.0)
            if proc.is_alive():
                proc.kill()
                proc.join(5.0)
        for conn in self.conns:
            conn.close()
        self.conns, self.procs = [], []


class InlineStream:
    """A stream iterated in the training process (``nb_worker=0``), as torch's single-process loading
    (`pipe_seed` and `world`: a datapipe's, as for :class:`StreamWorkers`; `after`: called as each
    epoch's iteration ends)."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool, collate_fn: CollateFn,
                 pipe_seed: Callable[[int], int] | None = None, world: tuple[int, int] = (1, 0),
                 after: Callable[[], None] | None = None) -> None:
        self.dataset = dataset
        self.after = after  # called when an epoch's iteration ends (here, or broken off)
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        self.pipe_seed, self.world = pipe_seed, world
        self.at: StreamAt | None = None  # as StreamWorkers.at
        self.end_at: StreamAt | None = None  # as StreamWorkers.end_at
        self._primed: tuple[int, Iterator[Any]] | None = None  # (epoch, its iterator opened at iter())

    def _open(self, epoch: int, resume: StreamAt | None) -> Iterator[Any]:
        if self.pipe_seed is not None:
            shard(self.dataset, 1, 0, self.world)  # this rank's share, as torch's single-process iterator
            seed_pipes(self.dataset, self.pipe_seed(epoch))
        return iterate_from(self.dataset, resume.states[0] if resume is not None else None)

    def prime(self, epoch: int) -> StreamAt | None:
        """Open epoch `epoch`'s iterator now, from the start, as torch's single-process iterator does at
        ``iter()``: a state taken before the first batch is then the iterator's own state (its random
        generator's, torchdata's); returns that position (``None``: the stream keeps none)."""
        self.close()
        iterator = self._open(epoch, None)
        self._primed = (epoch, iterator)
        at = position(self.dataset, iterator)
        return StreamAt((at,), (False,), 0, 0) if at is not None else None

    def items(self, epoch: int, collate: bool, resume: StreamAt | None = None,
              reseed: int | None = None) -> Generator[tuple[int, int, Any], None, None]:
        del reseed  # the training process's generators are the loop's own: never reseeded here
        self.at = self.end_at = None
        primed, self._primed = self._primed, None
        if resume is not None and resume.ended[0]:
            return
        arrived = resume.arrived if resume is not None else 0
        if primed is not None and primed[0] == epoch and resume is None:
            iterator = primed[1]
        else:
            iterator = self._open(epoch, resume)
        try:
            while True:
                samples = take(iterator, self.batch_size)
                if not samples or (self.drop_last and len(samples) < self.batch_size):
                    at = position(self.dataset, None)  # as the workers' End: the dataset's own state
                    self.end_at = StreamAt((at,), (False,), 0, 0) if at is not None else None
                    return
                arrived += len(samples)
                at = position(self.dataset, iterator)
                if at is not None:
                    self.at = StreamAt((at,), (False,), 0, arrived)
                yield 0, len(samples), self.collate_fn(samples) if collate else samples
        finally:
            _close(iterator)
            if self.after is not None:
                self.after()

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        primed, self._primed = self._primed, None
        if primed is not None:
            _close(primed[1])
