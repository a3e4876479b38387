"""The training process's part in read epochs, and the one place a read epoch's path is chosen.

:class:`ReadPaths` keeps what read epochs share from epoch to epoch: one
reader per generation (as workers keep theirs), the gather threads, and the
placement's memory of what each path costs per store. :meth:`ReadPaths.choose`
picks the read path (:mod:`loader.epochs.reads.base`) an epoch takes: the
streamed one for a generation larger than memory; the training process's own
gather where nothing else may read the store; otherwise the placement between
the training process, its threads and the workers.
"""

from __future__ import annotations

from typing import Callable, Protocol

from cachestore import ReadableStore, Reader, Store

from ...executors import messages as m
from ...executors.producer import BatchProducer
from ..plan import EpochStats, ReadPlan
from . import threads as gather_threads
from .base import ReadPath
from .main import MainReads
from .placement import GatherPlacement, Placed
from .streamed import StreamedReads
from .threads import GatherThreads, ThreadReads, usable_cpus
from .workers import WorkerReads


class ThreadsResource(Protocol):
    """Where the loader keeps its gather threads (:class:`~loader.resources.Resources`, released with it)."""

    threads: GatherThreads | None


class ReadPaths:
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

    def __init__(self, producer: BatchProducer, res: ThreadsResource, nb_worker: int, batch_size: int) -> None:
        self.producer = producer
        self.res = res
        self.nb_worker = nb_worker
        self.batch_size = batch_size
        self.placement = GatherPlacement()
        self._reader: Reader | None = None
        self._reader_at: float | None = None  # when its generation was committed (ReadPlan.committed_at)

    def reader(self, store: ReadableStore, generation: int, committed_at: float | None = None) -> Reader:
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

    def choose(self, plan: ReadPlan, stats: EpochStats, store: Store,
               workers: Callable[[], WorkerReads | None]) -> ReadPath:
        """The read path of read epoch `plan`, said in `stats` (`workers()`: the workers' path, ``None``
        where they cannot read `store`; asked only where they may read the epoch)."""
        reader = self.reader(store, plan.generation or 0, plan.committed_at)
        source: m.ReadSource = (store.spec, plan.generation or 0, plan.committed_at)
        if plan.stream:  # larger than memory: explicit reads ahead of the loop, in this process
            stats.extra["gather"] = StreamedReads.name
            return StreamedReads(self.producer, reader, source)
        main = MainReads(self.producer, reader, source)
        pool = workers()
        threads = None
        if self.nb_worker > 0 and gather_threads.usable(reader, self.producer):
            threads = ThreadReads(self.producer, reader, source, self.threads())
        if pool is None and threads is None:
            stats.extra["gather"] = main.name
            return main
        return Placed(self.placement, (store.path, plan.generation, self.batch_size), main, pool, threads)

    def remote(self, plan: ReadPlan, stats: EpochStats, store: ReadableStore) -> ReadPath:
        """The read path of a read epoch served from the cache's remote `store` directly."""
        reader = self.reader(store, plan.generation or 0, plan.committed_at)
        stats.extra["gather"] = "remote"
        return MainReads(self.producer, reader, (reader.spec, plan.generation or 0, plan.committed_at))

    def epoch_ended(self, stats: EpochStats) -> None:
        """A read epoch ended: the threads' free buffers go when the threads did not gather it (as
        slots go when not needed)."""
        places = stats.extra.get("gather_split") or [stats.extra.get("gather")]
        if self.res.threads is not None and "threads" not in places:
            self.res.threads.buffers.drop_free()
