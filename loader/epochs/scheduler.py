"""Running one epoch: feed tasks to the executor (or run them inline), reorder, deliver.

The loader decides *what* an epoch does (:class:`EpochPlan`); this module
does it. Batches are delivered in order; at most ``max_in_flight`` batches
are in flight. Results of an epoch that was abandoned (``break``) are
recognised by their epoch number and dropped (see the shutdown note in
:mod:`loader.executors.process.pool` and ``docs/ARCHITECTURE.md``).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable, Iterator

import numpy as np

from cachestore.collate import stack_samples

from ..cache.build import GenerationBuild
from ..cache.refresh import BackgroundRefresh
from ..dataset import Batch, CollateFn, Sample
from ..executors import messages as m
from ..executors.base import Executor, late_work_report, worker_timeout
from ..executors.process.slots import SlotPool
from ..settings import EpochMode
from .plan import EpochPlan, EpochStats

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
    ``collate=False`` each batch is the list of its samples. ``build`` is the
    generation a generate epoch writes, ``reader`` the ``(StoreSpec,
    generation)`` a read epoch gathers from, and ``background`` a
    :class:`~loader.cache.refresh.BackgroundRefresh` that gets the workers' spare time.
    """

    executor: Executor
    slots: SlotPool
    max_in_flight: int
    on_failure: Callable[[], None]
    minibatch: int | None = None
    prefetch_time: float | None = None
    collate: bool = True
    build: GenerationBuild | None = None
    reader: m.ReadSource | None = None
    background: BackgroundRefresh | None = None
    timeout: float | None = None
    split_ends: bool = False
    collate_fn: CollateFn = stack_samples




def _join(parts: dict[int, list[Sample]], collate: CollateFn | None) -> Batch:
    """The batch of samples that came back in `parts` (by part number), collated when asked."""
    samples = [sample for part in sorted(parts) for sample in parts[part]]
    return collate(samples) if collate is not None else samples


def run_pool(plan: EpochPlan, run: PoolRun, stats: EpochStats) -> Iterator[Any]:
    """An epoch run by the executor; yields batches in order.

    ``plan.batches`` may be any iterable of position arrays (it is consumed
    ``run.max_in_flight`` batches ahead).
    """
    executor, slots, build, background = run.executor, run.slots, run.build, run.background
    batches: Iterable[np.ndarray] = plan.batches
    first_unserved = None  # sequence numbers from here on are computed and written, not served
    if plan.unserved:
        batches = list(batches)
        first_unserved = len(batches)
        batches += plan.unserved
    source = iter(batches)
    following = next(source, None)
    inflight: dict[tuple[int, int], m.Task] = {}
    parts_of: dict[int, int] = {}
    sizes: dict[int, int] = {}
    done: dict[int, dict[int, Any]] = {}
    submitted = delivered = 0
    exhausted = False
    background_start = background.computed if background is not None else 0
    prefetch_deadline = time.monotonic() + run.prefetch_time if run.prefetch_time else None
    depth = min(run.max_in_flight, INITIAL_DEPTH_PER_WORKER * executor.nb_worker)
    stats.extra["max_in_flight"] = depth
    waiting_for, wait_since, warned = -1, 0.0, False  # the batch the loop waits for, since when

    def submit(seq: int, positions: np.ndarray, last: bool) -> None:
        sizes[seq] = len(positions)
        if len(positions) == 0:
            parts_of[seq] = 1
            done[seq] = {0: []}
            return
        redraw = plan.repeats.get(seq)
        step = run.minibatch or len(positions)
        if run.split_ends and (seq == 0 or last) and executor.nb_worker > 1:
            step = min(step, -(-len(positions) // executor.nb_worker))
        if redraw is not None and redraw.whole:
            step = len(positions)  # it draws an index twice: one task computes it once
        starts = range(0, len(positions), step)
        parts_of[seq] = len(starts)
        # A batch computed in parts comes back as its samples, collated here, whole: a collate
        # function sees the batch it is given in torch, and parts of collated batches cannot be
        # joined without knowing what the collate made of them (a list sample, a list of strings).
        whole = run.collate and len(starts) == 1
        repeat = redraw.earlier if redraw is not None else None
        for part, s in enumerate(starts):
            chunk = positions[s:s + step]
            slot, name, size = slots.acquire()
            fields: dict[str, Any] = {"mode": EpochMode.COMPUTE}
            if plan.mode == EpochMode.READ:
                fields = {"mode": EpochMode.READ, "reader": run.reader}
            elif plan.mode == EpochMode.GENERATE and build is not None:
                fields = build.task_fields(chunk, repeat[s:s + step] if repeat is not None else None)
            served = first_unserved is None or seq < first_unserved
            task = m.Task(seq=seq, part=part, epoch=plan.epoch, indices=plan.indices[chunk], positions=chunk,
                          slot=slot, slot_name=name, slot_size=size, collate=whole,
                          transform_seed=plan.transform_seed if served and run.collate else None, **fields)
            inflight[(seq, part)] = task
            executor.submit(task)

    def received(upto: int) -> bool:
        """Whether batches up to `upto` are in: their samples are on disk (a worker flushes before it answers)."""
        return all(seq < delivered or (seq in done and len(done[seq]) == parts_of[seq])
                   for seq in range(delivered, upto + 1))

    def receive(msg: Any) -> None:
        if msg is None:
            return
        if background is not None:
            try:
                if background.handle(msg):
                    return
            except BaseException:
                run.on_failure()
                raise
        if isinstance(msg, m.TaskFailed):
            if msg.epoch != plan.epoch and msg.kind != "init":
                return  # from an abandoned epoch
            run.on_failure()
            raise msg.exception(pid=executor.worker_pid(msg.worker_id), epoch=plan.epoch)
        if not isinstance(msg, m.BatchDone):
            return
        if msg.epoch != plan.epoch:
            slots.release_task(msg)
            return
        task = inflight.pop((msg.seq, msg.part))
        if msg.meta is None:
            # Carried inline (an executor without shared memory, e.g. Ray): the slot was never written.
            slots.release(task.slot)
            done.setdefault(msg.seq, {})[msg.part] = msg.batch
        else:
            done.setdefault(msg.seq, {})[msg.part] = slots.view(task.slot, msg.meta)
        if plan.mode == EpochMode.READ:
            stats.read += len(task.indices)
        elif run.collate:
            stats.computed += len(task.indices) - msg.staged
            stats.read += msg.staged
            stats.waited += msg.waited
            if build is not None:
                stats.written += build.accept(msg)

    try:
        while True:
            while not exhausted and submitted - delivered < depth:
                redraw = plan.repeats.get(submitted)
                if redraw is not None and not received(redraw.after):
                    break  # it reads back samples an earlier batch still computes: once that one is in
                positions, following = following, next(source, None)  # one ahead: is this the last?
                if positions is None:
                    exhausted = True
                    break
                submit(submitted, positions, last=following is None)
                submitted += 1
            if exhausted and delivered == submitted:
                return
            if background is not None:
                # Keep idle workers busy even while every batch is ready ahead of the loop.
                background.pump(executor)
                while (msg := executor.next_message(timeout=0)) is not None:
                    receive(msg)
            parts = done.get(delivered)
            prefetching = (prefetch_deadline is not None and time.monotonic() < prefetch_deadline
                           and len(inflight) > 0)
            if parts is not None and len(parts) == parts_of[delivered] and not prefetching:
                del done[delivered]
                served = first_unserved is None or delivered < first_unserved
                batch = parts[0] if len(parts) == 1 else _join(parts, run.collate_fn if run.collate and served else None)
                parts = None  # the parts' samples are views of slots: lent until the last reference goes
                if run.collate and served:
                    stats.batches += 1
                    stats.samples += sizes[delivered]
                delivered += 1
                prefetch_deadline = None
                if served:
                    yield batch
                continue
            now = time.monotonic()
            if waiting_for != delivered:
                waiting_for, wait_since, warned = delivered, now, False
                if depth < run.max_in_flight and not exhausted and executor.idle_workers():
                    # The loop waits and a worker idles: the queue, not the workers, is the bottleneck.
                    depth += 1
                    stats.extra["max_in_flight"] = depth
                    continue
            # Checked before every wait: results of other batches may keep arriving meanwhile.
            if run.timeout is not None and now - wait_since >= run.timeout:
                late = {(plan.epoch, s, p) for (s, p) in inflight if s == delivered}
                exc = worker_timeout(executor, late, f"batch {delivered} of epoch {plan.epoch}", run.timeout,
                                     now - wait_since)
                run.on_failure()
                raise exc
            if not warned and now - wait_since >= HANG_WARNING_SECONDS:
                warned = True
                late = {(plan.epoch, s, p) for (s, p) in inflight if s == delivered}
                log.warning("the training loop is waiting for data: %s", late_work_report(
                    executor, late, f"batch {delivered} of epoch {plan.epoch}", now - wait_since)[0])
            deadlines = [wait_since + run.timeout] if run.timeout is not None else []
            if not warned:
                deadlines.append(wait_since + HANG_WARNING_SECONDS)
            if prefetching and prefetch_deadline is not None:
                deadlines.append(prefetch_deadline)
            wait = max(0.0, min(deadlines) - now) if deadlines else None
            t0 = time.perf_counter()
            msg = executor.next_message(timeout=wait)
            stats.wait_seconds += time.perf_counter() - t0
            if msg is None:
                prefetch_deadline = None
            receive(msg)
    finally:
        # Slots of tasks still running stay lent until their (dropped) results arrive.
        slots.orphan(inflight.values())
        if background is not None:
            stats.extra["background_computed"] = background.computed - background_start
