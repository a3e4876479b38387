"""Rotation (data echoing): each generated sample is served R times from a bounded window.

Schedule
--------
The window has ``W = min(S, N)`` slots. Slot ``k`` holds a sequence of
samples, one after the other; each sample is served R times and then replaced
by the next one. A batch is a set of *distinct slots*, so it never holds the
same sample twice, and a slot holds one sample at a time, so the window never
holds more than W samples. Choosing the slots of each batch is the classic
problem of realising a bipartite degree sequence (slot k needs ``R * m_k``
serves, batch j has ``n_j`` places): taking, for every batch, the slots with
the most serves left - ties broken at random - succeeds whenever any schedule
with distinct slots does (Gale-Ryser / Havel-Hakimi). With balanced ``m_k``
it does in the common cases; where it cannot (tiny datasets, ``S`` equal to
the batch size, rounding) a batch takes a slot twice - at a sample boundary
when there is one, so the batch still holds distinct samples - and each
sample is still served exactly R times.

The tie-breaking makes slots cycle like passes over the window with a fresh
random partition each pass: a sample's R serves are spread about ``W / B``
batches apart. Which dataset index a sample is comes from a fresh permutation
every epoch, deterministic in ``(seed, epoch)``.

No batch holds a sample twice when ``S > batch_size`` and either
``N >= 3 S`` or ``N < S`` (``tests/loader/epochs/test_rotation.py`` checks a
grid of configurations); a few configurations with ``S <= N < 3 S`` or
``S == batch_size`` end with one batch that does, because a slot holding one
or two samples has no sample boundary left to place its double at
(``benchmarks/measurements.md`` has the share).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Callable, Iterator

import numpy as np

from ..dataset import Batch, CollateFn, ReadTransform, Sample
from ..errors import SampleError, add_note
from ..executors.producer import transform as _transform_sample
from .plan import EpochStats, RotatePlan
from .windows import RotationWindow

#: Computes the fresh samples of each array of dataset indices, in order (ahead, on the workers).
FreshSamples = Callable[[Iterator[np.ndarray]], Iterator[list[Sample]]]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serve:
    slot: int
    sample: int  # generation order: the i-th sample this epoch generates
    fresh: bool  # first serve: the sample must be computed
    last: bool  # last serve: the slot is free afterwards


def batch_sizes(n: int, rotation: int, batch_size: int, drop_last: bool) -> list[int]:
    total = rotation * n
    sizes = [batch_size] * (total // batch_size)
    if total % batch_size and not drop_last:
        sizes.append(total % batch_size)
    return sizes


def rotation_schedule(n: int, rotation: int, size: int, batch_size: int, drop_last: bool,
                      rng: np.random.Generator) -> Iterator[list[Serve]]:
    """Batches of serves covering ``rotation * n`` serves, built lazily (see the module docstring).

    Slot ``k`` gives ``d_k = rotation * m_k`` serves in ``nb`` batches. When
    ``d_k > nb`` (``S`` close to ``batch_size``, rounding) the slot must appear
    twice in ``d_k - nb`` batches: those *doubles* are placed where one sample's
    last serve meets the next one's first, so the batch still holds distinct samples.
    """
    if n == 0:
        return
    slots = min(size, n)
    per_slot = np.full(slots, n // slots, dtype=np.int64)
    per_slot[rng.permutation(slots)[: n % slots]] += 1
    sizes = batch_sizes(n, rotation, batch_size, drop_last)
    if not sizes:
        return  # fewer serves than a batch, and drop_last drops them
    demand = per_slot * rotation
    # Batches each slot still appears in; the serves beyond that (rem - appear) are doubles.
    # At most `sizes[-1]` slots fit in a short last batch: the others appear at most nb - 1 times.
    nb = len(sizes)
    appear = np.minimum(demand, nb - 1 if nb > 1 else nb)
    room = np.argsort(-(demand + rng.random(slots)))[: sizes[-1]]
    appear[room] = np.minimum(demand[room], nb)
    # Slots kept out of the short last batch: one of their absences is spoken for.
    reserved = np.ones(slots, dtype=bool)
    reserved[room] = False
    reserved &= demand >= nb
    done = np.zeros(slots, dtype=np.int64)
    current = np.full(slots, -1, dtype=np.int64)
    next_sample = 0
    for j, need in enumerate(sizes):
        left = len(sizes) - j  # batches left, this one included
        key = appear + rng.random(slots)
        key[appear == 0] = -np.inf
        width = min(slots, need)
        best = np.argpartition(-key, width - 1)[:width] if width < slots else np.arange(slots)
        picked = [int(t) for t in best[np.argsort(-key[best])] if appear[t] > 0]
        # Turn picks into doubles where a slot owes one and sits at a sample boundary; each
        # double takes the place of the weakest pick that is not mandatory (a slot with as many
        # appearances left as batches left must appear in every remaining batch).
        owes = demand - done > appear
        twice: set[int] = set()
        for t in list(picked):
            if not (owes[t] and done[t] % rotation == rotation - 1 and demand[t] - done[t] >= 2):
                continue
            if len(picked) + len(twice) < need:
                twice.add(t)
                continue
            drop = next((u for u in reversed(picked) if u != t and u not in twice and not owes[u]
                         and appear[u] < left - (reserved[u] and left > 1)), None)
            if drop is not None:
                picked.remove(drop)
                twice.add(t)
        batch: list[Serve] = []
        for t in picked:
            appear[t] -= 1
            for _ in range(2 if t in twice else 1):
                batch.append(_serve(t, done, current, rotation, next_sample))
                next_sample += batch[-1].fresh
        while len(batch) < need:
            # Not enough distinct slots (tiny datasets): serve a slot again, at a boundary if any.
            owed = [t for t in range(slots) if demand[t] > done[t]]
            if not owed:
                break
            t = min(owed, key=lambda u: (done[u] % rotation != 0, -(demand[u] - done[u])))
            if t not in picked:
                appear[t] -= 1
                picked.append(t)
            batch.append(_serve(t, done, current, rotation, next_sample))
            next_sample += batch[-1].fresh
            appear[t] = min(appear[t], demand[t] - done[t])
        yield batch


def _serve(t: int, done: np.ndarray, current: np.ndarray, rotation: int, next_sample: int) -> Serve:
    """The next serve of slot `t` (a new sample every `rotation` serves)."""
    fresh = done[t] % rotation == 0
    if fresh:
        current[t] = next_sample
    done[t] += 1
    return Serve(t, int(current[t]), bool(fresh), bool(done[t] % rotation == 0))


def run_rotation(schedule: Iterator[list[Serve]], dataset_index: np.ndarray, window: RotationWindow,
                 fresh_batches: FreshSamples, collate: CollateFn, stats: EpochStats, rng: np.random.Generator,
                 skip: int = 0, epoch: int = 0, adopted: bool = False, transform: ReadTransform | None = None,
                 seed: int = 0) -> Iterator[Batch]:
    """Serve one rotation epoch `epoch` (from batch `skip` on, after a resume).

    ``fresh_batches(iterator of dataset-index arrays)`` returns an iterator of
    sample lists, one per array, in order (computed ahead by the workers).
    The serves of a batch are applied in schedule order - a slot's last read
    and free come before its next sample is stored, so a slot never holds two
    samples - and delivered in random order. The first `skip` batches are
    not delivered: with a window `adopted` from the stopped run they are only
    counted (it already holds what they left), otherwise they are replayed -
    the window is rebuilt, its fresh samples computed again. Either way the
    same random numbers are drawn. The window records its position around
    every batch (:meth:`RotationWindow.mark`). The window keeps samples as
    computed; each serve goes through `transform` (``read_transform``) on
    its way out, the sample's first serve seeded by ``(seed, epoch, index)``,
    its later ones by ``(seed, epoch, index, serve)``.
    """
    batches = iter(schedule)
    pending: list[list[Serve]] = []
    serves: dict[int, int] = {}  # generated sample -> its serves so far (each draws its own augmentation)

    def upcoming() -> Iterator[np.ndarray]:
        for number, batch in enumerate(batches):
            pending.append(batch)
            if adopted and number < skip:
                yield np.zeros(0, dtype=np.int64)  # nothing to compute: the window holds its state
            else:
                yield np.array([dataset_index[s.sample] for s in batch if s.fresh], dtype=np.int64)

    for number, samples in enumerate(fresh_batches(upcoming())):
        batch = pending.pop(0)
        ordinals = [serves.get(s.sample, 0) for s in batch]
        for s in batch:
            serves[s.sample] = serves.get(s.sample, 0) + 1
        if adopted and number < skip:
            rng.permutation(len(batch))  # the draws of the stopped run, to stay in step with it
            continue
        window.mark(epoch, number, clean=False)
        served: list[Sample] = []
        fresh = iter(samples)
        for serve in batch:
            if serve.fresh:
                served.append(next(fresh))
                if not serve.last:
                    window.put(serve.slot, served[-1])
            else:
                served.append(window.get(serve.slot))
                if serve.last:
                    window.free(serve.slot)
        window.mark(epoch, number + 1, clean=True)
        stats.computed += len(samples)
        order = rng.permutation(len(served))
        if number < skip:
            continue
        stats.read += len(batch) - len(samples)
        stats.batches += 1
        stats.samples += len(batch)
        stats.extra["window_peak"] = max(stats.extra.get("window_peak", 0), window.held())
        if transform is not None:
            served = [_transform(transform, sample, seed, epoch, int(dataset_index[s.sample]), r)
                      for sample, s, r in zip(served, batch, ordinals)]
        yield collate([served[i] for i in order])


def _transform(fn: ReadTransform, sample: Sample, seed: int, epoch: int, index: int, serve: int) -> Sample:
    """One serve through ``read_transform``; its error is raised as the user's own, with where."""
    try:
        return _transform_sample(fn, sample, seed, epoch, index, serve)
    except SampleError as exc:
        add_note(exc.cause, f"raised by read_transform {exc.doing} of epoch {epoch}")
        raise exc.cause from None


def rotation_epoch(plan: RotatePlan, stats: EpochStats, rotation: int, window: RotationWindow, batch_size: int,
                   drop_last: bool, seed: int, fresh: FreshSamples, collate: CollateFn,
                   transform: ReadTransform | None = None) -> Iterator[Batch]:
    """The batches of rotation epoch `plan` (from batch ``plan.skip`` on) through `window`.

    The schedule and the order within each batch come from generators of
    their own, seeded by ``(seed, epoch)``: the schedule is drawn as far ahead
    as the workers compute, which varies, so one shared generator would make
    the batches depend on timing.
    """
    schedule = rotation_schedule(len(plan.indices), rotation, window.slots, batch_size, drop_last,
                                 np.random.default_rng([seed, plan.epoch, 2]))
    adopted = plan.skip > 0 and window.resumes(plan.epoch, plan.skip)
    if not adopted:
        window.reset()
    shuffle = np.random.default_rng([seed, plan.epoch, 3])
    return run_rotation(schedule, plan.indices, window, fresh, collate, stats, shuffle, skip=plan.skip,
                        epoch=plan.epoch, adopted=adopted, transform=transform, seed=seed)
