"""Read epochs gathered in the training process: its reader, its gather threads, the placement.

A cached epoch gathers where it costs the loop least (:mod:`loader.epochs.placement`):
in the training process (inline, or by its threads where the reader allows),
or in the workers. This module holds the training process's side of that:
one reader per generation, kept from epoch to epoch as workers keep theirs,
the gather threads, and the placement's memory of what each store costs.
"""

from __future__ import annotations

from typing import Iterator

from cachestore import Reader, Store

from ..dataset import Batch
from ..executors.producer import BatchProducer
from ..resources import Resources
from . import threads as gather_threads
from .inline import run_inline
from .placement import GatherPlacement, PoolBatches
from .plan import EpochPlan, EpochStats
from .threads import GatherThreads, usable_cpus



class ReadPlaces:
    """The training process's part in read epochs (see the module docstring).

    Parameters
    ----------
    producer
        The training process's producer (its gathers and recomputed batches).
    res
        Where the gather threads are kept (released with the loader).
    nb_worker
        The loader's workers: as many gather threads, at most one per usable CPU.
    batch_size
        The loader's batch size (what a place costs is measured per store, generation and batch size).
    """

    def __init__(self, producer: BatchProducer, res: Resources, nb_worker: int, batch_size: int) -> None:
        self.producer = producer
        self.res = res
        self.nb_worker = nb_worker
        self.batch_size = batch_size
        self.placement = GatherPlacement()
        self._reader: Reader | None = None
        self._reader_at: float | None = None  # when its generation was committed (EpochPlan.committed_at)

    def reader(self, store: Store, generation: int, committed_at: float | None = None) -> Reader:
        """A reader of `generation` in this process, kept from epoch to epoch (as workers keep theirs).

        A reader opened per epoch would map the store afresh, so every page an
        epoch touches would be faulted in again.
        """
        if self._reader is None or (self._reader.generation, self._reader_at) != (generation, committed_at):
            self.drop_reader()
            self._reader = store.reader(generation)
            self._reader_at = committed_at
        return self._reader

    def drop_reader(self) -> None:
        """After a commit: a generation written again under the same id (it was damaged) must not
        be served from the old files the kept reader still maps."""
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def threads(self) -> GatherThreads:
        """The gather threads, as many as workers (the CPUs the user gave to loading), at most one per
        CPU this process may run on."""
        if self.res.threads is None:
            self.res.threads = GatherThreads(min(self.nb_worker, usable_cpus()))
        return self.res.threads

    def in_process(self, plan: EpochPlan, stats: EpochStats, store: Store) -> Iterator[Batch]:
        """A read epoch without workers to gather it (``nb_worker=0``, or an in-RAM store workers
        cannot open): inline, or by the threads when that is cheaper."""
        reader = self.reader(store, plan.generation or 0, plan.committed_at)
        if self.nb_worker > 0 and gather_threads.usable(reader, self.producer):
            return self.placed(plan, stats, store, None, 0)
        stats.extra["gather"] = "main"
        return run_inline(plan, self.producer, reader, None, stats)

    def placed(self, plan: EpochPlan, stats: EpochStats, store: Store, pool: PoolBatches | None,
               warmup: int) -> Iterator[Batch]:
        """Read epoch `plan` where it costs the loop least: in this process, inline or by its threads
        where the reader allows, or by `pool` (``None``: no workers may read this store)."""
        reader = self.reader(store, plan.generation or 0, plan.committed_at)
        by_threads = None
        if gather_threads.usable(reader, self.producer):
            by_threads = lambda p, counts: gather_threads.thread_batches(  # noqa: E731
                p, counts, reader, self.producer, self.threads())
        return self.placement.batches(
            (store.path, plan.generation, self.batch_size), plan, stats,
            lambda p, counts: run_inline(p, self.producer, reader, None, counts), pool, warmup=warmup,
            threads=by_threads, threads_warmup=self.threads().buffers.keep if by_threads is not None else 0)

    def epoch_ended(self, stats: EpochStats) -> None:
        """A read epoch ended: the threads' free buffers go when the threads did not gather it (as
        slots go when not needed)."""
        places = stats.extra.get("gather_split") or [stats.extra.get("gather")]
        if self.res.threads is not None and "threads" not in places:
            self.res.threads.buffers.drop_free()
