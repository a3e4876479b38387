"""Compute and generate epochs run in the training process (``nb_worker=0``).

The same tasks the workers would run, one batch at a time as the loop asks
(:class:`loader.executors.producer.BatchProducer`); a generate epoch's
samples are written into the training process's own shard. Read epochs in
the training process are a read path of their own
(:mod:`loader.epochs.reads.main`).
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from ..errors import FailedBatch, SampleError, add_note
from ..executors import messages as m
from ..executors.producer import BatchProducer
from .plan import EpochPlan, EpochStats
from .work import ComputeWork


def run_inline(plan: EpochPlan, producer: BatchProducer, work: ComputeWork, stats: EpochStats) -> Iterator[Any]:
    """The batches of compute or generate epoch `plan`, computed (and written, as `work` says) in this
    process; then its unserved batches, computed and written, never delivered."""
    try:
        yield from _inline_batches(plan, producer, work, stats)
    except SampleError as exc:
        raise dataset_error(exc, plan.epoch) from None


def failed(stats: EpochStats) -> None:
    """Count a batch the dataset failed: a generate epoch with one keeps its generation partial."""
    stats.extra["failed_batches"] = int(stats.extra.get("failed_batches", 0)) + 1


def dataset_error(exc: SampleError, epoch: int) -> BaseException:
    """The dataset's own exception behind `exc`, raised in this process, noted with where it came from.

    In-process, the dataset's own exception is the clearest error: it is re-raised as it is.
    """
    who = "read_transform" if exc.stage == "read_transform" else "the dataset"
    add_note(exc.cause, f"raised by {who} {exc.doing} of epoch {epoch}")
    return exc.cause


def _inline_batches(plan: EpochPlan, producer: BatchProducer, work: ComputeWork,
                    stats: EpochStats) -> Iterator[Any]:
    build = work.build
    served_batches = list(plan.batches)
    for number, positions in enumerate(itertools.chain(served_batches, work.unserved)):
        served = number < len(served_batches) and number not in plan.ahead
        if not served and build is None:
            continue  # served before a resume, out of order: nothing to write either
        redraw = work.repeats.get(number)
        task = m.Task(seq=0, part=0, epoch=plan.epoch, indices=plan.indices[positions], positions=positions,
                      transform_seed=plan.transform_seed if served else None, keys=plan.keys, draws_seed=plan.draws_seed,
                      **work.part(positions, redraw.earlier if redraw is not None else None, here=True))
        try:
            out = producer.produce(task)
        except SampleError as exc:
            failed(stats)
            if served:  # raised for this batch; the epoch goes on (torch's), the generation stays partial
                stats.batches += 1
                yield FailedBatch(dataset_error(exc, plan.epoch))
            continue
        stats.computed += len(positions) - out.staged
        stats.read += out.staged
        stats.waited += out.waited
        stats.written += out.written
        if build is not None:
            build.count_inline(out.written)
            if out.budget_error is not None:
                build.over_budget(out.budget_error)
        if served:
            stats.batches += 1
            stats.samples += len(positions)
            yield out.batch
    if build is not None:
        producer.close_shard()  # before the loader commits or discards the generation
