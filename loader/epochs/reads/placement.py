"""Where a cached epoch gathers its batches: in the training process (inline or by
its threads), or in the workers.

A batch read from a committed store is one vectorised gather per leaf (plus its
checksums). Workers do it in parallel with the training loop, but each batch
then costs the training process a hand-off: a message, a slot mapped as arrays,
the reorder buffer. For small samples that hand-off costs more than the gather
itself (a cached epoch of 16-float samples ran slower with 2 workers than with
none); for large samples parallel copies win, and threads of the training
process copy in parallel without a hand-off (:mod:`loader.epochs.reads.threads`; only
where the reader allows it).

The rule: what counts is the training process's time per batch, since that is
what the training loop waits for. The first read epochs of a store, generation
and batch size measure each place, warm: the first gathers its first
``PROBE_BATCHES`` batches in the training process, timed on a second,
undelivered gather of the same batches (once the store's pages are mapped), and
the rest in the workers, or, where threads may gather too, in the threads; the
second is then the threads', timed. If the training process gathered faster than
the threads hand batches over, it gathers from then on: a gather that cheap loses
to any hand-off, and the workers' costs more than the threads' (a message and a
slot for each batch), so no worker is started to read (``docs/ARCHITECTURE.md``,
"Memory with many workers"). Else the third and fourth are
shared in halves by the workers and the threads, the workers first in one and
last in the other (the machine's speed drifts from epoch to epoch: each place
then meets both ends of it), every half timed; without threads the second is the
workers', timed. The first batches of each timed run, which fill its queue (and
allocate the threads' buffers), are not counted in its mean batch time (the
workers' slots grew in the first epoch) but as its start cost; a place's cost is
the least mean of its runs, plus the least start cost spread over an epoch's
batches (``_time``). The threads' buffers outlive the split epochs
(``extra["gather_split"]`` names their places in order). For an in-RAM store,
which workers cannot read, the threads serve the rest of the first epoch and the
second is theirs, timed. Each batch is timed
from the moment the loop asks for it until it has it (the loop's own time is not
counted; a batch that is ready when asked costs only its hand-off). The cheapest
place, per batch, serves the later read epochs of that key. The choice and the
costs are in ``EpochStats.extra`` (``"gather"``: ``"main"``, ``"threads"`` or
``"workers"``; ``"gather_costs"``: seconds per batch). While a background
refresh runs the workers gather (its chunks are scheduled between batch tasks).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from typing import Iterable, Iterator

from ...dataset import Batch
from ..plan import EpochStats, ReadPlan
from .base import ReadPath

#: What a choice of place holds for: (store path, generation, batch size).
PlaceKey = tuple[str, int | None, int]

#: Batches of the first read epoch gathered in the training process to time it.
PROBE_BATCHES = 4


def timed(batches: Iterable[Batch], times: list[float]) -> Iterator[Batch]:
    """`batches`, appending to `times` how long each took to come (the consumer's time excluded)."""
    it = iter(batches)
    try:
        while True:
            start = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                return
            times.append(time.perf_counter() - start)
            yield batch
    finally:
        # An epoch broken off closes this generator: close the pool run now too, so its slots
        # and in-flight tasks are handled as for any broken-off epoch, not whenever it is collected.
        close = getattr(it, "close", None)
        if close is not None:
            close()


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


class GatherPlacement:
    """The gather place chosen per key (store path, generation, batch size); see the module docstring."""

    def __init__(self) -> None:
        self.choices: dict[PlaceKey, tuple[str, dict[str, float]]] = {}
        # Per key and place, one entry per timed run of the probe epochs so far: its mean batch time
        # once warm, and what its start cost on top.
        self.runs: dict[PlaceKey, dict[str, list[tuple[float, float]]]] = {}

    def batches(self, key: PlaceKey, plan: ReadPlan, stats: EpochStats, main: ReadPath, workers: ReadPath | None,
                threads: ReadPath | None) -> Iterator[Batch]:
        """The batches of read epoch `plan`, read by `main` (the training process), `workers` or
        `threads`: ``None`` where they may not read this store (not both)."""
        parts = {path.name: path for path in (workers, threads) if path is not None}
        known = self.choices.get(key)
        if known is not None and known[0] == "threads-then-workers":
            if threads is not None:
                return self._threads_before_workers(key, plan, stats, threads, known[1])
            known = self.choices[key] = ("pending", known[1])  # threads may not gather now: the workers'
        if known is not None and known[0] == "pending":
            order = [parts[place] for place in ("workers", "threads") if place in parts]
            return self._time(key, plan, stats, order, known[1], then="pending-threads" if len(order) > 1 else None)
        if known is not None and known[0] == "pending-threads":
            order = [parts[place] for place in ("threads", "workers") if place in parts]
            return self._time(key, plan, stats, order, known[1])
        if known is not None:
            place, costs = known
            stats.extra.update(gather=place, gather_costs=costs)
            if place == "main":
                return main.batches(plan, stats)
            if place == "threads" and threads is not None:
                return threads.batches(plan, stats)
            if workers is None:
                stats.extra["gather"] = "main"
                return main.batches(plan, stats)
            stats.extra["gather"] = "workers"
            return workers.batches(plan, stats)
        return self._probe(key, plan, stats, main, threads or workers, workers is not None and threads is not None)

    def _probe(self, key: PlaceKey, plan: ReadPlan, stats: EpochStats, main: ReadPath,
               rest: ReadPath | None, workers_too: bool = False) -> Iterator[Batch]:
        """First read epoch: time the training process's gather; `rest` (the threads; without them,
        the workers) serves the rest, untimed (the threads' first buffers fault their pages in).
        Where both may gather (`workers_too`), the threads come first: see
        :meth:`_threads_before_workers`."""
        batches = list(plan.batches)
        head = PROBE_BATCHES if len(batches) >= 2 * PROBE_BATCHES + 2 else 0
        if rest is None:
            raise ValueError("a read epoch is placed between at least two places")
        stats.extra["gather"] = rest.name  # until the probe says otherwise
        if not head:  # too short an epoch to time both: probe the next one
            yield from rest.batches(plan, stats)
            return
        main_times: list[float] = []
        probe = dataclasses.replace(plan, batches=batches[:head])
        yield from main.batches(probe, stats)
        # Timed on a second gather of the same batches, not delivered: the first one also paid
        # for mapping the store's pages into this process, which a later epoch does not (its
        # reader stays open), and a probe that counted it sent 48 KiB samples to the workers
        # although the training process gathered them faster.
        for _ in timed(main.batches(probe, EpochStats(plan.epoch, plan.mode, plan.generation)), main_times):
            pass
        yield from rest.batches(dataclasses.replace(plan, batches=batches[head:]), stats)
        # Median: one batch that meets a page-table or allocator hiccup must not decide.
        costs = {"main": statistics.median(main_times)}
        then = "threads-then-workers" if workers_too else "pending" if rest.name == "workers" else "pending-threads"
        self.choices[key] = (then, costs)

    def _threads_before_workers(self, key: PlaceKey, plan: ReadPlan, stats: EpochStats, threads: ReadPath,
                                costs: dict[str, float]) -> Iterator[Batch]:
        """Second read epoch where both the threads and the workers may gather: the threads', timed
        warm. A training process that gathers a batch faster than its threads hand one over gathers
        from then on: a gather that cheap loses to any hand-off, and the workers' costs more than the
        threads' (a message and a slot for each batch), so no worker is started to read
        (``docs/ARCHITECTURE.md``, "Memory with many workers"). Else the workers are timed too, in
        the next two epochs."""
        yield from self._time(key, plan, stats, [threads], costs, then="pending")
        decided = self.choices[key]
        if decided[0] == "pending" and decided[1]["main"] <= decided[1].get("threads", float("inf")):
            del self.runs[key]
            self.choices[key] = ("main", decided[1])
            stats.extra.update(gather="main", gather_costs=decided[1], gather_probed=True)

    def _time(self, key: PlaceKey, plan: ReadPlan, stats: EpochStats, parts: list[ReadPath],
              costs: dict[str, float], then: str | None = None) -> Iterator[Batch]:
        """A later probe epoch: time each of `parts` (read paths) on its share of the
        batches, in order, now warm (the workers' first epoch mapped the store's pages and grew their
        slots, as the training process's timed gathers did not pay); then decide, or go on to the
        next probe epoch. Workers and threads share two epochs, in halves, one first in each: the
        machine's speed drifts from epoch to epoch, and each then meets both ends of the drift."""
        batches = list(plan.batches)
        stats.extra["gather"] = parts[0].name
        if len(parts) > 1:
            stats.extra["gather_split"] = [path.name for path in parts]
        runs = self.runs.setdefault(key, {})
        share = -(-len(batches) // len(parts))
        for k, path in enumerate(parts):
            place, warmup = path.name, path.warmup
            times: list[float] = []
            part = batches[k * share:(k + 1) * share]
            if part:
                yield from timed(path.batches(dataclasses.replace(plan, batches=part), stats), times)
            skip = min(warmup, len(times) // 2)
            steady = _mean(times[skip:])  # a mean: batches gathered ahead arrive in bursts
            if steady is not None and len(times) <= 2 * warmup:
                # A share no longer than twice the queue the place keeps ahead (a small store): its
                # batches after the warm-up were gathered while the first ones were awaited, so they
                # show no speed; the whole share's mean does (the warm part alone timed a small
                # store's workers at a third of what they served).
                runs.setdefault(place, []).append((sum(times) / len(times), 0.0))
            elif steady is not None:
                runs.setdefault(place, []).append((steady, max(0.0, sum(times[:skip]) - skip * steady)))
        if not batches:
            return  # an empty epoch (a resume at its end): decide at the next one
        # The least of a place's runs: an early run pays what later epochs do not (store pages
        # this process had not touched yet, which each worker maps for itself; the threads' first
        # buffers) and the machine drifts, so the cheapest run is the closest to a later epoch.
        # Every epoch also pays once for its place's start (the workers' first tasks, the threads'
        # first gathers), spread over its batches. The mean of all batches often chose the slower
        # place (benchmarks/measurements.md).
        costs = dict(costs)
        for place, timed_runs in runs.items():
            costs[place] = min(mean for mean, _ in timed_runs) + min(start for _, start in timed_runs) / len(batches)
        if then is not None:  # another probe epoch follows
            self.choices[key] = (then, costs)
            stats.extra["gather_costs"] = costs
            return
        del self.runs[key]
        best = min(costs, key=costs.__getitem__)
        self.choices[key] = (best, costs)
        stats.extra.update(gather=best, gather_costs=costs, gather_probed=True)


class Placed(ReadPath):
    """A read epoch that several paths may read: where `placement` says (see the module docstring)."""

    name = "placed"

    def __init__(self, placement: GatherPlacement, key: PlaceKey, main: ReadPath, workers: ReadPath | None,
                 threads: ReadPath | None) -> None:
        self.placement, self.key = placement, key
        self.main, self.workers, self.threads = main, workers, threads

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        return self.placement.batches(self.key, plan, stats, self.main, self.workers, self.threads)
