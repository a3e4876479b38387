"""A stream's batches in torch's turn: its copies on the workers, or its iterator in this process.

A stream (an ``IterableDataset``, or any object with ``__iter__`` and no
``__getitem__``) has no indices to hand out: torch's ``DataLoader`` gives each
worker a copy, lets it split the work through ``get_worker_info()``, asks the
workers for batches in turn and serves them in that order, a worker whose
copy ran out dropping out of the turn. :class:`StreamTurn` does the same over
an executor of the loader's kind (processes, threads or Ray actors: the one
worker loop, whose :class:`~loader.executors.stream_copy.StreamCopy` answers):
per run, every worker starts a new iterator of its copy
(:class:`~loader.executors.messages.StreamBegin`) and answers each
:class:`~loader.executors.messages.StreamNext` with its next batch (collated
where it is served as it is; the samples themselves where the training process
writes them into a generation, ``docs/ARCHITECTURE.md``, "Streams"). Each
worker has `prefetch` requests in flight, as torch's ``prefetch_factor``.
:class:`InlineStream` iterates the stream in this process (``num_workers=0``).

A stream whose dataset or iterator has its own ``state_dict()``/``load_state_dict()``
(torchdata's ``Stateful``) sends its copy's position with each batch; :class:`StreamAt` is where a
run got (each worker's position after the last batch taken from it, whose turn is next), and a run
begun from one continues there instead of iterating the stream again from its start. Each epoch
reseeds the workers' generators from the run's seed and the epoch
(:func:`loader.executors.seeds.epoch_reseed`): an epoch served again, or resumed, draws the same.

The workers hold the copies: one that dies cannot be replaced (its copy's position is lost), and
the executor raises :class:`~loader.errors.WorkerError`; every wait watches the loader's ``timeout``.
"""

from __future__ import annotations

import collections
import time
from typing import Any, Callable, Generator, Iterator

from ..datapipes import seed_pipes, shard
from ..dataset import CollateFn
from ..errors import WorkerError, WorkerTimeoutError
from . import messages as m
from .base import Executor
from .positions import StreamAt, iterate_from, position, take
from .stream_copy import close_iterator

#: Seconds between checks of the overall timeout while waiting for a copy's answer.
WAIT_SLICE = 0.5


class StreamTurn:
    """The copies of a stream on `executor`'s workers, and the turn they serve in (see the module docstring).

    Parameters
    ----------
    executor
        Its workers hold the copies (made for them: ``copies=True``); closed with this object.
    batch_size, drop_last
        Each worker's batches, as torch's: up to `batch_size` samples, a short last one dropped with `drop_last`.
    prefetch
        Requests in flight per worker.
    timeout
        Seconds one wait may take (``None``: as long as it takes).
    pipe_seed
        A datapipe's: the seed of its random pipes in an epoch (:func:`loader.datapipes.epoch_seed`).
    world
        torch.distributed's ``(world size, rank)``: a datapipe's shards.
    """

    def __init__(self, executor: Executor, batch_size: int, drop_last: bool, prefetch: int, timeout: float | None,
                 pipe_seed: Callable[[int], int] | None = None, world: tuple[int, int] = (1, 0)) -> None:
        self.executor = executor
        self.workers = executor.nb_worker
        self.batch_size, self.drop_last = batch_size, drop_last
        self.prefetch, self.timeout = max(1, prefetch), timeout
        self.pipe_seed, self.world = pipe_seed, world
        self.at: StreamAt | None = None  # a stateful stream's position after the latest batch items() gave
        self.end_at: StreamAt | None = None  # where the copies are after the latest run that ran to its end
        self._runs = 0  # runs begun so far (see items)
        self.closed = False
        self._held: dict[int, collections.deque[Any]] = collections.defaultdict(collections.deque)

    def items(self, epoch: int, collate: bool, resume: StreamAt | None = None, reseed: int | None = None,
              in_order: bool = True) -> Generator[tuple[int, int, Any], None, None]:
        """``(worker_id, count, batch or samples)`` of epoch `epoch`, in torch's turn: worker 0's first batch,
        worker 1's first, ..., worker 0's second, each worker leaving the turn when its copy runs out; from
        position `resume` on, when given; `reseed`: see :class:`~loader.executors.messages.StreamBegin`.
        Not `in_order` (torch's ``in_order=False``): each batch as soon as a copy gives it, the position
        counting each copy's batches (:attr:`StreamAt.taken`)."""
        n = self.workers
        # Each run has its own tag, which the answers carry: an epoch served again (a state loaded into this
        # loader) must not take the answers of its earlier run.
        tag, self._runs = self._runs, self._runs + 1
        self._held.clear()
        states = list(resume.states) if resume is not None else [None] * n
        ended = list(resume.ended) if resume is not None else [False] * n
        arrived = resume.arrived if resume is not None else 0
        counted = not in_order or (resume is not None and resume.taken is not None)
        taken = list(resume.taken) if resume is not None and resume.taken is not None else [0] * n
        # A copy that keeps no state is iterated again up to the batches it gave before.
        replay = [taken[w] if states[w] is None else 0 for w in range(n)]
        seed = self.pipe_seed(epoch) if self.pipe_seed is not None else None
        for worker in range(n):
            self.executor.send_to(worker, m.StreamBegin(tag, collate, self.batch_size, self.drop_last, self.world,
                                                        seed, states[worker], reseed))
            for _ in range(self.prefetch if not ended[worker] else 0):
                self.executor.send_to(worker, m.StreamNext(tag))
        active = [w for w in range(n) if not ended[w]]
        pos = active.index(resume.next) if resume is not None and resume.next in active else 0
        self.at = self.end_at = None
        while active:
            worker, msg = self._receive(active[pos:] + active[:pos] if not in_order else [active[pos]], epoch, tag)
            if isinstance(msg, m.StreamEnd):
                at = active.index(worker)
                active.pop(at)
                ended[worker] = True
                pos = (pos - (at < pos)) % len(active) if active else 0
                states[worker] = msg.state  # ended: out of this run's turn, its dataset's state for the next
                continue
            self.executor.send_to(worker, m.StreamNext(tag))
            pos = (active.index(worker) + 1) % len(active)
            if replay[worker]:
                replay[worker] -= 1  # given before the resume
                continue
            arrived += msg.count
            taken[worker] += 1
            if msg.state is not None:
                states[worker] = msg.state
            if counted or any(state is not None for state in states):
                self.at = StreamAt(tuple(states), tuple(ended), active[pos], arrived,
                                   tuple(taken) if counted else None)
            yield worker, msg.count, msg.items
        self.end_at = StreamAt(tuple(states), (False,) * n, 0, 0) if any(s is not None for s in states) else None

    def _receive(self, workers: list[int], epoch: int, tag: int) -> tuple[int, m.StreamItems | m.StreamEnd]:
        """The next answer in run `tag` (of epoch `epoch`) of the first of `workers` that has one; answers of
        the others are held for their turn, those of earlier runs dropped."""
        deadline = None if self.timeout is None else time.monotonic() + self.timeout
        while not any(self._held[w] for w in workers):
            if self.closed:  # by another thread (a background refresh stopped under its wait)
                raise WorkerError(f"the stream's workers were stopped while epoch {epoch} waited for {workers}")
            if deadline is not None and any(self.executor.worker_pid(w) is None for w in workers):
                # Not started yet (a Ray actor waiting for its node): the executor says when that is too long.
                deadline = time.monotonic() + self.timeout  # type: ignore[operator]
            left = WAIT_SLICE if deadline is None else min(WAIT_SLICE, deadline - time.monotonic())
            if left <= 0:
                pids = [self.executor.worker_pid(w) for w in workers]
                raise WorkerTimeoutError(f"stream worker(s) {workers} (pid {', '.join(map(str, pids))}) gave no "
                                         f"batch in {self.timeout} s (timeout={self.timeout})")
            msg = self.executor.next_message(timeout=left)  # a dead worker: WorkerError (it holds a copy)
            if isinstance(msg, m.TaskFailed) and msg.kind == "init":
                raise msg.exception(pid=self.executor.worker_pid(msg.worker_id), epoch=epoch)
            if isinstance(msg, (m.StreamItems, m.StreamEnd)) and msg.tag == tag or (
                    isinstance(msg, m.TaskFailed) and msg.epoch == tag):
                self._held[msg.worker_id].append(msg)  # a failure too: raised in its turn, as torch raises it
        worker = next(w for w in workers if self._held[w])
        answer = self._held[worker].popleft()
        if isinstance(answer, m.TaskFailed):
            raise answer.exception(pid=self.executor.worker_pid(worker), epoch=epoch)
        assert isinstance(answer, (m.StreamItems, m.StreamEnd))
        return worker, answer

    def pids(self) -> list[int]:
        return self.executor.pids()

    def close(self) -> None:
        """Stop the workers (their copies' iterators end with them)."""
        self.closed = True
        self.executor.shutdown()


class InlineStream:
    """A stream iterated in the training process (``nb_worker=0``), as torch's single-process loading
    (`pipe_seed` and `world`: a datapipe's, as for :class:`StreamTurn`; `after`: called as each
    epoch's iteration ends)."""

    def __init__(self, dataset: Any, batch_size: int, drop_last: bool, collate_fn: CollateFn,
                 pipe_seed: Callable[[int], int] | None = None, world: tuple[int, int] = (1, 0),
                 after: Callable[[], None] | None = None) -> None:
        self.dataset = dataset
        self.after = after  # called when an epoch's iteration ends (here, or broken off)
        self.batch_size, self.drop_last, self.collate_fn = batch_size, drop_last, collate_fn
        self.pipe_seed, self.world = pipe_seed, world
        self.at: StreamAt | None = None  # as StreamTurn.at
        self.end_at: StreamAt | None = None  # as StreamTurn.end_at
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

    def items(self, epoch: int, collate: bool, resume: StreamAt | None = None, reseed: int | None = None,
              in_order: bool = True) -> Generator[tuple[int, int, Any], None, None]:
        del reseed, in_order  # this process's generators are the loop's own; one copy is always in turn
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
                    at = position(self.dataset, None)  # as the workers' StreamEnd: the dataset's own state
                    self.end_at = StreamAt((at,), (False,), 0, 0) if at is not None else None
                    return
                arrived += len(samples)
                at = position(self.dataset, iterator)
                if at is not None:
                    self.at = StreamAt((at,), (False,), 0, arrived)
                yield 0, len(samples), self.collate_fn(samples) if collate else samples
        finally:
            close_iterator(iterator)
            if self.after is not None:
                self.after()

    def pids(self) -> list[int]:
        return []

    def close(self) -> None:
        primed, self._primed = self._primed, None
        if primed is not None:
            close_iterator(primed[1])
