"""Running an epoch's tasks on the executor: submit them, reorder the results, deliver the batches.

The epoch's kind decides what its tasks do (:mod:`loader.epochs.work`); this
module runs them. Batches are delivered in order (with ``in_order=False``, as they
are done: each one's number in the epoch is noted for the state); at most
``max_in_flight`` batches are in flight. Results of an epoch that was abandoned (``break``) are
recognised by their epoch number and dropped (see the shutdown note in
:mod:`loader.executors.process.pool` and ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from cachestore.format.collate import stack_samples

from ..cache.refresh import BackgroundRefresh
from ..dataset import Batch, CollateFn, Sample
from ..executors import messages as m
from ..executors.base import Executor, late_work_report, worker_timeout
from ..executors.process.slots import SlotPool
from ..errors import FailedBatch
from .inline import failed
from .plan import EpochPlan, EpochStats
from .work import ComputeWork, Work

log = logging.getLogger(__name__)

#: Seconds the training loop waits for one batch before a warning says who is stuck where.
HANG_WARNING_SECONDS = 60.0
#: Batches in flight per worker at the start of an epoch (see PoolRun).
INITIAL_DEPTH_PER_WORKER = 2


@dataclass
class PoolRun:
    """How the executor runs one epoch, beside its :class:`EpochPlan`.

    At most ``max_in_flight`` batches are submitted ahead of the training
    loop: the depth starts at two per worker and grows by one (up to that
    bound) each time the loop waits while a worker has nothing to do, so a
    loop slower than its workers holds few batches in memory;
    ``minibatch`` splits each batch into tasks of at most that many samples;
    ``split_ends`` splits the epoch's first and last batches into one task per
    worker: the loop waits for the first while every worker is idle (it comes
    in a worker's share of the time), and splitting the last as well keeps the
    workers' shares even (the first alone left one worker half a batch behind);
    ``prefetch_time`` lets the queue fill before the first batch;
    ``on_failure`` stops the workers before an error propagates; ``timeout``
    bounds the wait for one batch (:class:`~loader.errors.WorkerTimeoutError`). With
    ``collate=False`` each batch is the list of its samples (and nothing is
    counted: rotation counts its serves itself). ``background`` is a
    :class:`~loader.cache.refresh.BackgroundRefresh` that gets the workers' spare time.
    ``in_order=False`` (torch's): a batch done before an earlier one is served first; its number
    goes into ``EpochStats.positions``, which a state records (``loader.state``).
    """

    executor: Executor
    slots: SlotPool
    max_in_flight: int
    on_failure: Callable[[], None]
    minibatch: int | None = None
    prefetch_time: float | None = None
    collate: bool = True
    background: BackgroundRefresh | None = None
    timeout: float | None = None
    split_ends: bool = False
    collate_fn: CollateFn = stack_samples
    in_order: bool = True




def _join(parts: dict[int, list[Sample]], collate: CollateFn | None) -> Batch:
    """The batch of samples that came back in `parts` (by part number), collated when asked."""
    samples = [sample for part in sorted(parts) for sample in parts[part]]
    return collate(samples) if collate is not None else samples


class PoolEpoch:
    """One epoch run by the executor (see :func:`run_pool`): its tasks in flight, its results
    reordered, its waits bounded.

    Each step of the loop is a method: :meth:`_fill` submits batches up to the
    in-flight depth, :meth:`_take` delivers the next batch once all its parts
    are in, :meth:`_grow` deepens the queue when the loop waits on an idle
    worker, :meth:`_wait` waits for one message (or raises past the timeout).
    """

    def __init__(self, plan: EpochPlan, run: PoolRun, stats: EpochStats, work: Work) -> None:
        self.plan, self.run, self.stats, self.work = plan, run, stats, work
        self.executor, self.slots = run.executor, run.slots
        self.inflight: dict[tuple[int, int], m.Task] = {}
        self.parts_of: dict[int, int] = {}  # batch -> tasks it was split into
        self.sizes: dict[int, int] = {}  # batch -> samples
        self.done: dict[int, dict[int, Any]] = {}  # batch -> part -> result
        self.submitted = self.delivered = 0
        # Out of order: batches taken past `delivered` (the first not taken yet).
        self.out_of_order = not run.in_order and run.collate
        self.taken: set[int] = set()
        self.exhausted = False
        self.first_unserved: int | None = None  # batches from here on are computed and written, not served
        self.source: Iterator[np.ndarray] = iter(())
        self.following: np.ndarray | None = None  # the next batch to submit (one ahead: is this the last?)
        self.depth = 0
        self.prefetch_deadline: float | None = None
        self.waiting_for, self.wait_since, self.warned = -1, 0.0, False  # the batch the loop waits for, since when

    def batches(self) -> Iterator[Any]:
        """The epoch's batches, in order (a generator: nothing happens before the first is asked for)."""
        background = self.run.background
        background_start = background.computed if background is not None else 0
        self._start()
        try:
            while True:
                self._fill()
                if self.exhausted and self.delivered == self.submitted:
                    return
                if background is not None:
                    # Keep idle workers busy even while every batch is ready ahead of the loop.
                    background.pump(self.executor)
                    while (msg := self.executor.next_message(timeout=0)) is not None:
                        self._receive(msg)
                prefetching = self._prefetching()
                ready = self._take(prefetching)
                if ready is not None:
                    served, batch = ready
                    if served:
                        yield batch
                    continue
                now = time.monotonic()
                if not self._grow(now):
                    self._wait(now, prefetching)
        finally:
            # Slots of tasks still running stay lent until their (dropped) results arrive.
            self.slots.orphan(self.inflight.values())
            if background is not None:
                self.stats.extra["background_computed"] = background.computed - background_start

    def _start(self) -> None:
        plan, run = self.plan, self.run
        batches: Iterable[np.ndarray] = plan.batches
        if self.work.unserved:
            batches = list(batches)
            self.first_unserved = len(batches)
            batches += self.work.unserved
        self.source = iter(batches)
        self.following = next(self.source, None)
        self.prefetch_deadline = time.monotonic() + run.prefetch_time if run.prefetch_time else None
        self.depth = min(run.max_in_flight, INITIAL_DEPTH_PER_WORKER * self.executor.nb_worker)
        self.stats.extra["max_in_flight"] = self.depth

    def _served(self, seq: int) -> bool:
        """Whether batch `seq` is served: not one computed only to be written, nor one a resumed epoch served
        before its stop, out of order (``plan.ahead``)."""
        return (self.first_unserved is None or seq < self.first_unserved) and seq not in self.plan.ahead

    # submitting -----------------------------------------------------------------
    def _fill(self) -> None:
        """Submit batches while fewer than the depth are ahead of the loop."""
        while not self.exhausted and self.submitted - self.delivered - len(self.taken) < self.depth:
            redraw = self.work.repeats.get(self.submitted)
            if redraw is not None and not self._received(redraw.after):
                break  # it reads back samples an earlier batch still computes: once that one is in
            positions, self.following = self.following, next(self.source, None)
            if positions is None:
                self.exhausted = True
                break
            self._submit(self.submitted, positions, last=self.following is None)
            self.submitted += 1

    def _submit(self, seq: int, positions: np.ndarray, last: bool) -> None:
        plan, run, executor = self.plan, self.run, self.executor
        self.sizes[seq] = len(positions)
        if len(positions) == 0 or (seq in plan.ahead and isinstance(self.work, ComputeWork) and self.work.build is None):
            # Nothing to compute: no samples, or a batch served before a resume that nothing writes.
            self.parts_of[seq] = 1
            self.done[seq] = {0: []}
            return
        redraw = self.work.repeats.get(seq)
        step = run.minibatch or len(positions)
        if run.split_ends and (seq == 0 or last) and executor.nb_worker > 1:
            step = min(step, -(-len(positions) // executor.nb_worker))
        if (redraw is not None and redraw.whole) or plan.keys:
            # It draws an index twice: one task computes it once; or dataset[list] computes it whole.
            step = len(positions)
        starts = range(0, len(positions), step)
        self.parts_of[seq] = len(starts)
        # A batch computed in parts comes back as its samples, collated here, whole: a collate
        # function sees the batch it is given in torch, and parts of collated batches cannot be
        # joined without knowing what the collate made of them (a list sample, a list of strings).
        whole = run.collate and len(starts) == 1
        repeat = redraw.earlier if redraw is not None else None
        for part, s in enumerate(starts):
            chunk = positions[s:s + step]
            slot, name, size = self.slots.acquire()
            fields = self.work.part(chunk, repeat[s:s + step] if repeat is not None else None)
            task = m.Task(seq=seq, part=part, epoch=plan.epoch, indices=plan.indices[chunk], positions=chunk,
                          slot=slot, slot_name=name, slot_size=size, collate=whole,
                          transform_seed=plan.transform_seed if self._served(seq) and run.collate else None,
                          keys=plan.keys, draws_seed=plan.draws_seed, **fields)
            self.inflight[(seq, part)] = task
            executor.submit(task)

    # receiving ------------------------------------------------------------------
    def _received(self, upto: int) -> bool:
        """Whether batches up to `upto` are in: their samples are on disk (a worker flushes before it answers)."""
        return all(seq < self.delivered or seq in self.taken or self._complete(seq)
                   for seq in range(self.delivered, upto + 1))

    def _complete(self, seq: int) -> bool:
        return seq in self.done and len(self.done[seq]) == self.parts_of[seq]

    def _receive(self, msg: Any) -> None:
        run, plan, stats = self.run, self.plan, self.stats
        if msg is None:
            return
        if run.background is not None:
            try:
                if run.background.handle(msg):
                    return
            except BaseException:
                run.on_failure()
                raise
        if isinstance(msg, m.TaskFailed):
            if msg.epoch != plan.epoch and msg.kind != "init":
                return  # from an abandoned epoch
            if msg.kind in ("dataset", "read_transform") and (msg.seq, msg.part) in self.inflight:
                # Raised for its batch alone; the epoch goes on, as torch's does (the worker is well).
                task = self.inflight.pop((msg.seq, msg.part))
                self.slots.release(task.slot)
                failed(stats)
                error = msg.exception(pid=self.executor.worker_pid(msg.worker_id), epoch=plan.epoch)
                self.done.setdefault(msg.seq, {})[msg.part] = FailedBatch(error)
                return
            run.on_failure()
            raise msg.exception(pid=self.executor.worker_pid(msg.worker_id), epoch=plan.epoch)
        if not isinstance(msg, m.BatchDone):
            return
        if msg.epoch != plan.epoch:
            self.slots.release_task(msg)
            return
        task = self.inflight.pop((msg.seq, msg.part))
        if msg.meta is None:
            # Carried inline (an executor without shared memory, e.g. Ray): the slot was never written.
            self.slots.release(task.slot)
            self.done.setdefault(msg.seq, {})[msg.part] = msg.batch
        else:
            self.done.setdefault(msg.seq, {})[msg.part] = self.slots.view(task.slot, msg.meta)
        if run.collate:
            self.work.count(task, msg, stats)

    def _take(self, prefetching: bool) -> tuple[bool, Any] | None:
        """``(served, batch)`` for the next batch when all its parts are in (and no prefetch holds it back);
        out of order, for the first batch that is."""
        if prefetching:
            return None
        seq = self.delivered
        if not self._complete(seq):
            if not self.out_of_order:
                return None
            seq = min((s for s in self.done if self._complete(s)), default=-1)
            if seq < 0:
                return None
        parts = self.done.pop(seq)
        served = self._served(seq)
        collate = self.run.collate_fn if self.run.collate and served else None
        failure = next((part for part in parts.values() if isinstance(part, FailedBatch)), None)
        batch = failure if failure is not None else parts[0] if len(parts) == 1 else _join(parts, collate)
        del parts  # the parts' samples are views of slots: lent until the last reference goes
        if self.run.collate and served:
            self.stats.batches += 1
            self.stats.samples += self.sizes[seq]
            if self.out_of_order:
                self.stats.positions.append(seq)
        self.taken.add(seq)
        while self.delivered in self.taken:
            self.taken.discard(self.delivered)
            self.delivered += 1
        self.prefetch_deadline = None
        return served, batch

    def _prefetching(self) -> bool:
        return (self.prefetch_deadline is not None and time.monotonic() < self.prefetch_deadline
                and len(self.inflight) > 0)

    # waiting --------------------------------------------------------------------
    def _grow(self, now: float) -> bool:
        """At the start of a wait for a new batch: deepen the queue when a worker idles (then submit, no wait)."""
        if self.waiting_for == self.delivered:
            return False
        self.waiting_for, self.wait_since, self.warned = self.delivered, now, False
        if self.depth < self.run.max_in_flight and not self.exhausted and self.executor.idle_workers():
            # The loop waits and a worker idles: the queue, not the workers, is the bottleneck.
            self.depth += 1
            self.stats.extra["max_in_flight"] = self.depth
            return True
        return False

    def _wait(self, now: float, prefetching: bool) -> None:
        """Wait for one message (up to the next deadline: the timeout, the hang warning, the prefetch)."""
        run, plan = self.run, self.plan
        # Checked before every wait: results of other batches may keep arriving meanwhile.
        if run.timeout is not None and now - self.wait_since >= run.timeout:
            exc = worker_timeout(self.executor, self._late(), f"batch {self.delivered} of epoch {plan.epoch}",
                                 run.timeout, now - self.wait_since)
            run.on_failure()
            raise exc
        if not self.warned and now - self.wait_since >= HANG_WARNING_SECONDS:
            self.warned = True
            log.warning("the training loop is waiting for data: %s", late_work_report(
                self.executor, self._late(), f"batch {self.delivered} of epoch {plan.epoch}",
                now - self.wait_since)[0])
        deadlines = [self.wait_since + run.timeout] if run.timeout is not None else []
        if not self.warned:
            deadlines.append(self.wait_since + HANG_WARNING_SECONDS)
        if prefetching and self.prefetch_deadline is not None:
            deadlines.append(self.prefetch_deadline)
        wait = max(0.0, min(deadlines) - now) if deadlines else None
        t0 = time.perf_counter()
        msg = self.executor.next_message(timeout=wait)
        self.stats.wait_seconds += time.perf_counter() - t0
        if msg is None:
            self.prefetch_deadline = None
        self._receive(msg)

    def _late(self) -> set[tuple[int, int, int]]:
        """The tasks of the batch the loop waits for."""
        return {(self.plan.epoch, s, p) for (s, p) in self.inflight if s == self.delivered}


def run_pool(plan: EpochPlan, run: PoolRun, stats: EpochStats, work: Work | None = None) -> Iterator[Any]:
    """An epoch run by the executor, its tasks doing `work` (default: compute); yields batches in order.

    ``plan.batches`` may be any iterable of position arrays (it is consumed
    ``run.max_in_flight`` batches ahead).
    """
    return PoolEpoch(plan, run, stats, work if work is not None else ComputeWork()).batches()
