"""Running one epoch: feed tasks to workers (or run them inline), reorder, deliver.

The loader decides *what* an epoch does (:class:`EpochPlan`); this module
does it. Batches are delivered in order; at most ``max_queue_size`` batches
are in flight. Results of an epoch that was abandoned (``break``) are
recognised by their epoch number and dropped (see the shutdown note in
:mod:`loader.pool`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import numpy as np

from cachestore import codec
from cachestore.errors import BudgetExceededError

from . import messages as m
from .worker import SampleError

log = logging.getLogger(__name__)


@dataclass
class EpochPlan:
    """What one epoch does.

    ``mode``: ``"compute"`` (dataset only), ``"generate"`` (dataset, written into
    ``generation``), ``"read"`` (served from committed ``generation``),
    ``"rotate"`` (see :mod:`loader.rotation`). ``batches`` hold store
    positions; ``indices`` maps a position to the dataset index.
    """

    epoch: int
    mode: str
    generation: int | None
    batches: list[np.ndarray]
    indices: np.ndarray


@dataclass
class EpochStats:
    """What an epoch did; ``loader.epoch_stats`` keeps one per epoch."""

    epoch: int
    mode: str
    generation: int | None = None
    batches: int = 0
    samples: int = 0
    computed: int = 0  # dataset calls
    read: int = 0  # samples served from the store
    written: int = 0  # samples written into the store
    seconds: float = 0.0
    wait_seconds: float = 0.0  # time the training loop waited for data
    committed: bool = False
    extra: dict = field(default_factory=dict)


class GenerationSink:
    """Where the samples of a generate epoch go, and what happens on a budget error."""

    def __init__(self, writer: Any, policy: str, in_workers: bool) -> None:
        self.policy = policy
        self.spec = writer.shard_spec()
        # Workers write their own shards, except into an in-RAM store: that lives here.
        self.in_workers = in_workers
        self._main_shard: Any = None
        self.failed: str | None = None
        self.fits: int | None = None  # samples that would fit the budget, when known

    @property
    def active(self) -> bool:
        return self.failed is None

    def main_shard(self) -> Any:
        if self._main_shard is None:
            self._main_shard = self.spec.open("main")
        return self._main_shard

    def put_records(self, records: list) -> int:
        if not self.active:
            return 0
        shard = self.main_shard()
        for pos, record in records:
            try:
                shard.put(pos, codec.unflatten(*codec.decode_record(record, copy=False)))
            except BudgetExceededError as exc:
                self.over_budget(str(exc), exc)
                return 0
        return len(records)

    def over_budget(self, message: str, exc: BaseException | None = None, fits: int | None = None) -> None:
        if self.policy == "error":
            raise exc if exc is not None else BudgetExceededError(message)
        if self.failed is None:
            if self.policy == "stream":
                log.warning("cache disabled, serving uncached samples from now on: %s", message)
            self.fits = fits if fits is not None else getattr(exc, "fits_samples", None)
        self.failed = message

    def close_main(self) -> None:
        if self._main_shard is not None:
            self._main_shard.close()


def run_inline(plan: EpochPlan, producer: Any, reader: Any, sink: GenerationSink | None,
               stats: EpochStats) -> Iterator[Any]:
    """An epoch without workers (``nb_worker=0``, or a cached epoch of an in-RAM store)."""
    try:
        yield from _inline_batches(plan, producer, reader, sink, stats)
    except SampleError as exc:
        # In-process, the dataset's own exception is the clearest error: re-raise it as it is.
        exc.cause.add_note(f"raised by the dataset while computing sample {exc.index} of epoch {plan.epoch}")
        raise exc.cause from None


def _inline_batches(plan: EpochPlan, producer: Any, reader: Any, sink: GenerationSink | None,
                    stats: EpochStats) -> Iterator[Any]:
    for positions in plan.batches:
        if plan.mode == "read":
            task = m.Task(seq=0, part=0, epoch=plan.epoch, indices=plan.indices[positions], mode="read",
                          positions=positions)
            batch = producer.read(task, reader)
            stats.read += len(positions)
        else:
            writing = sink is not None and sink.active
            task = m.Task(seq=0, part=0, epoch=plan.epoch, indices=plan.indices[positions],
                          mode="generate" if writing else "compute", positions=positions,
                          shard=sink.spec if writing else None,
                          on_budget=sink.policy if sink is not None else "error")
            batch, written, _, budget_error = producer.produce(task)
            stats.computed += len(positions)
            stats.written += written
            if budget_error is not None and sink is not None:
                sink.over_budget(budget_error, fits=producer.budget_fits)
        stats.batches += 1
        stats.samples += len(positions)
        yield batch
    if sink is not None:
        producer.close_shard()  # before the loader commits or discards the generation


def concat_batches(parts: list[Any]) -> Any:
    """Join minibatches along the first axis (numpy, torch, lists)."""
    first = parts[0]
    if isinstance(first, dict):
        return {k: concat_batches([p[k] for p in parts]) for k in first}
    if isinstance(first, tuple):
        return tuple(concat_batches([p[i] for p in parts]) for i in range(len(first)))
    if isinstance(first, np.ndarray):
        return np.concatenate(parts)
    if isinstance(first, list):
        return [x for p in parts for x in p]
    if codec._is_tensor(first):
        import torch

        return torch.cat(parts)
    return parts


def run_pool(plan: EpochPlan, pool: Any, slots: Any, sink: GenerationSink | None, reader_key: tuple | None,
             max_in_flight: int, minibatch: int | None, stats: EpochStats, prefetch_time: float | None,
             on_failure: Callable[[], None], collate: bool = True, background: Any = None) -> Iterator[Any]:
    """An epoch run by the worker pool; yields batches in order.

    ``plan.batches`` may be any iterable of position arrays (it is consumed
    ``max_in_flight`` batches ahead). With ``collate=False`` each batch is the
    list of its samples. `background` (a :class:`loader.refresh.BackgroundRefresh`)
    gets the workers' spare time.
    """
    source = iter(plan.batches)
    inflight: dict[tuple[int, int], m.Task] = {}
    parts_of: dict[int, int] = {}
    sizes: dict[int, int] = {}
    done: dict[int, dict[int, Any]] = {}
    submitted = delivered = 0
    exhausted = False
    background_start = background.computed if background is not None else 0
    prefetch_deadline = time.monotonic() + prefetch_time if prefetch_time else None

    def submit(seq: int, positions: np.ndarray) -> None:
        sizes[seq] = len(positions)
        if len(positions) == 0:
            parts_of[seq] = 1
            done[seq] = {0: []}
            return
        step = minibatch or len(positions)
        starts = range(0, len(positions), step)
        parts_of[seq] = len(starts)
        for part, s in enumerate(starts):
            chunk = positions[s:s + step]
            slot, name, size = slots.acquire()
            fields: dict[str, Any] = {"seq": seq, "part": part, "epoch": plan.epoch, "indices": chunk,
                                      "mode": plan.mode, "slot": slot, "slot_name": name, "slot_size": size,
                                      "collate": collate}
            fields["indices"] = plan.indices[chunk]
            fields["positions"] = chunk
            if plan.mode == "read":
                fields["reader"] = reader_key
            else:
                if plan.mode == "generate" and sink is not None and sink.active:
                    if sink.in_workers:
                        fields["shard"] = sink.spec
                    else:
                        fields["send_records"] = True
                    fields["on_budget"] = sink.policy
                else:
                    fields["mode"] = "compute"
            task = m.Task(**fields)
            inflight[(seq, part)] = task
            pool.submit(task)

    def receive(msg: Any) -> None:
        if msg is None:
            return
        if background is not None:
            try:
                if background.handle(msg):
                    return
            except BaseException:
                on_failure()
                raise
        if isinstance(msg, m.TaskFailed):
            if msg.epoch != plan.epoch and msg.kind != "init":
                return  # from an abandoned epoch
            on_failure()
            pid = next((w.pid for w in pool.workers if w.worker_id == msg.worker_id), None)
            raise msg.exception(pid=pid, epoch=plan.epoch)
        if not isinstance(msg, m.BatchDone):
            return
        if msg.epoch != plan.epoch:
            slots.release_task(msg)
            return
        task = inflight.pop((msg.seq, msg.part))
        done.setdefault(msg.seq, {})[msg.part] = slots.view(task.slot, msg.meta)
        if plan.mode == "read":
            stats.read += len(task.indices)
        elif collate:
            stats.computed += len(task.indices)
            stats.written += msg.written
            if msg.records and sink is not None:
                stats.written += sink.put_records(msg.records)
            if msg.budget_error is not None and sink is not None:
                sink.over_budget(msg.budget_error, fits=msg.budget_fits)

    try:
        while True:
            while not exhausted and submitted - delivered < max_in_flight:
                positions = next(source, None)
                if positions is None:
                    exhausted = True
                    break
                submit(submitted, positions)
                submitted += 1
            if exhausted and delivered == submitted:
                return
            if background is not None:
                # Keep idle workers busy even while every batch is ready ahead of the loop.
                background.pump(pool)
                while (msg := pool.next_message(timeout=0)) is not None:
                    receive(msg)
            parts = done.get(delivered)
            prefetching = (prefetch_deadline is not None and time.monotonic() < prefetch_deadline
                           and len(inflight) > 0)
            if parts is not None and len(parts) == parts_of[delivered] and not prefetching:
                del done[delivered]
                batch = parts[0] if len(parts) == 1 else concat_batches([parts[p] for p in sorted(parts)])
                if collate:
                    stats.batches += 1
                    stats.samples += sizes[delivered]
                delivered += 1
                prefetch_deadline = None
                yield batch
                continue
            t0 = time.perf_counter()
            wait = None if not prefetching else max(0.0, prefetch_deadline - time.monotonic())
            msg = pool.next_message(timeout=wait)
            stats.wait_seconds += time.perf_counter() - t0
            if msg is None:
                prefetch_deadline = None
            receive(msg)
    finally:
        # Slots of tasks still running stay lent until their (dropped) results arrive.
        slots.orphan(inflight.values())
        if background is not None:
            stats.extra["background_computed"] = background.computed - background_start
