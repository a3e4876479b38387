"""A worker's copy of a stream: the fetcher of an iterable dataset, in every kind of worker.

A map-style dataset is fetched by index; a stream has no indices, so each
worker iterates its own copy, as torch's workers do, and the training process
asks each copy for its next batch (:mod:`loader.executors.stream_turn` deals the
turn). The same worker loop runs both (processes and threads:
:func:`loader.executors.process.worker.worker_main`; Ray actors:
:class:`loader.executors.ray.RayWorker`); a stream's commands go to the
worker's :class:`StreamCopy`: :class:`~loader.executors.messages.StreamBegin`
starts a run (a new iterator, from a recorded position where given),
:class:`~loader.executors.messages.StreamNext` takes its next batch
(``docs/ARCHITECTURE.md``, "Streams").
"""

from __future__ import annotations

import copy
import importlib
import importlib.util
import logging
from typing import Any, Callable, Iterator

from ..datapipes import is_datapipe, seed_pipes, shard
from . import messages as m
from .positions import iterate_from, position, take
from .seeds import seed_worker

log = logging.getLogger(__name__)


def close_iterator(iterator: Iterator[Any] | None) -> None:
    """End an iterator left before its end (a generator's ``finally`` closes its files now, not at exit)."""
    close = getattr(iterator, "close", None)
    if callable(close):
        try:
            close()
        except Exception:  # the stream's own clean-up failing must not fail the next run
            pass


def import_worker_info() -> None:
    """Import ``torch.utils.data`` where torch is installed: a stream splits its work by
    ``get_worker_info()``, which must answer from its first sample on, even where the stream imports torch
    only inside ``__iter__`` (too late for the worker's identity to be installed)."""
    if importlib.util.find_spec("torch") is not None:
        importlib.import_module("torch.utils.data")


def private_copy(dataset: Any) -> Any:
    """A worker thread's own copy of a stream, as a worker process has one: what the stream keeps on itself
    (its position, a count of its passes) is each copy's; one that cannot be copied (an open file, a
    lock) is shared by the threads, each with its own iterator."""
    try:
        return copy.deepcopy(dataset)
    except Exception as exc:
        log.warning("the stream cannot be copied for each worker thread (%s: %s): the threads share it, each "
                    "with its own iterator, and what it keeps on itself is shared; use processes to give each "
                    "worker its own copy", type(exc).__name__, exc)
        return dataset


class StreamCopy:
    """Worker `worker_id`'s copy of the stream `dataset()` builds (at the first run), run by run.

    `own_process`: the worker is a process of its own, whose global generators a run may reseed (a
    thread's are the training process's, never reseeded here), and whose dataset is its own (a thread
    takes a :func:`private_copy`). `arrived`: called once the dataset is built and torch may be
    imported (the worker installs torch's worker info then).
    """

    def __init__(self, dataset: Callable[[], Any], worker_id: int, num_workers: int, own_process: bool,
                 arrived: Callable[[], None] = lambda: None) -> None:
        self._dataset, self.worker_id, self.num_workers = dataset, worker_id, num_workers
        self.own_process, self._arrived = own_process, arrived
        self._sharded = False
        self._own: Any = None
        self.run: m.StreamBegin | None = None
        self.iterator: Iterator[Any] | None = None
        self.failure: BaseException | None = None  # of the run's start: reported at its first StreamNext

    def _copy(self) -> Any:
        if self._own is None:
            dataset = self._dataset()
            self._own = dataset if self.own_process else private_copy(dataset)
        return self._own

    def handle(self, msg: m.StreamBegin | m.StreamNext, collate: Callable[[list[Any]], Any]) -> object | None:
        """The answer to `msg` (``None``: none is due: a run begun, or a request of an earlier run)."""
        if isinstance(msg, m.StreamBegin):
            self._begin(msg)
            return None
        run = self.run
        if run is None or msg.tag != run.tag:
            return None
        try:
            if self.failure is not None:
                raise self.failure
            dataset = self._copy()
            if self.iterator is None:
                self.iterator = iterate_from(dataset, run.state)
            samples = take(self.iterator, run.batch_size)
            if not samples or (run.drop_last and len(samples) < run.batch_size):
                # An iterator that ran out is done: the next run starts a new one, from the dataset's state.
                self.run = None
                return m.StreamEnd(run.tag, self.worker_id, position(dataset, None))
            return m.StreamItems(run.tag, self.worker_id, len(samples), collate(samples) if run.collate else samples,
                                 position(dataset, self.iterator))
        except Exception as exc:
            return m.TaskFailed.from_exception(exc, epoch=run.tag, seq=-1, part=-1, worker_id=self.worker_id,
                                               index=None, kind="dataset")

    def _begin(self, msg: m.StreamBegin) -> None:
        close_iterator(self.iterator)
        self.run, self.iterator, self.failure = msg, None, None
        try:
            if not self._sharded:
                import_worker_info()
                dataset = self._copy()
                self._arrived()
                if is_datapipe(dataset):  # its sharding filters keep this worker's share, as torch's workers do
                    shard(dataset, self.num_workers, self.worker_id, msg.world)
                self._sharded = True
            if msg.pipe_seed is not None:
                seed_pipes(self._copy(), msg.pipe_seed)
            if msg.reseed is not None and self.own_process:
                seed_worker(msg.reseed, self.worker_id)
        except Exception as exc:
            self.failure = exc

    def close(self) -> None:
        """End the run under way (the worker exits)."""
        close_iterator(self.iterator)
        self.iterator = self.run = None
