"""What the drop-in loaders share: the once-per-process explanations of arguments that are
not needed here, the check of pass-through keywords, and :class:`CompatLoader`, a
:class:`~loader.CachedLoader` with what the original loaders added around an epoch.
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import os
import threading
import weakref
from collections import deque
from typing import Any, Iterator

from ..api import CachedLoader
from ..arguments import ALIASES
from ..epochs.plan import EpochStats
from .logging import LogRouting

log = logging.getLogger(__name__)

# Why an original argument is not needed here, by argument name. Said once per
# process (like the warnings registry): a training script that builds a loader
# per epoch or per rank should not repeat the same paragraph in its log.
WHY_NOT_NEEDED = {
    "max_minibatch_length": (
        "dataset_server sized one shared-memory buffer per worker from the first sample; here a batch "
        "that outgrows its shared-memory slot gets a larger one, so no size is needed"),
    "use_threading": (
        "dataset_server used a thread to poll the workers; here the training process waits on all "
        "workers at once without polling, so no thread is needed (workers stay processes)"),
    "qt_threading": (
        "dataset_server used a thread to poll the servers; here the training process waits on all "
        "workers at once without polling"),
    "multithread": (
        "swift_loader used one thread per worker to receive its batches; here the training process "
        "waits on all workers at once without polling, so no thread is needed"),
    "batch_encoder": (
        "batches are not serialised: workers write their arrays into shared memory and the training "
        "process reads them in place"),
    "batch_decoder": (
        "batches are not serialised: workers write their arrays into shared memory and the training "
        "process reads them in place"),
    "message_queue_size": (
        "control messages to and from the workers are a few bytes each and never queue up; the "
        "batches in flight are bounded by data_queue_size (our max_queue_size)"),
    "max_buffer_size": (
        "there is no reassembly buffer: a batch arrives whole, in one shared-memory slot"),
    "start_port": "there are no TCP servers: workers are local processes joined by pipes and shared memory",
    "packet_size": "there are no TCP servers: workers are local processes joined by pipes and shared memory",
    "retry_interval": (
        "there are no connections to retry: a worker that dies is noticed within seconds and "
        "restarted, and its unfinished samples are computed again"),
    "client_wait_time": (
        "there are no connections to retry: a worker that dies is noticed within seconds and "
        "restarted, and its unfinished samples are computed again"),
    "nb_retry": (
        "there are no connections to retry: a worker that dies is noticed within seconds and "
        "restarted (max_worker_restarts per epoch), and its unfinished samples are computed again"),
    "cache_setting['side']": (
        "there is one side: workers write the cache and the training process reads it"),
    "min_rotation_size": (
        "the window holds at most max_rotation_size samples, serves each exactly `rotation` times "
        "and never twice in one batch once it is larger than the batch: no lower bound is needed"),
    "logger['name']": "the records keep their own logger names (loader.*, cachestore.*)",
    "logger['suffix']": "the log file is named <path>_Dataloader-<consumer_index>, as swift_loader named it",
    "logger['separate_sink']": "one file per consumer, as swift_loader's default",
}

_explained: set[str] = set()
_explained_lock = threading.Lock()


def explain(name: str, origin: str) -> None:
    """Log once per process that `name` (an argument of `origin`) is accepted and why it is not needed."""
    with _explained_lock:
        if name in _explained:
            return
        _explained.add(name)
    log.info("%s: %s is accepted and not needed here: %s", origin, name, WHY_NOT_NEEDED[name])


def check_pass_through(owner: str, given: dict[str, object], own: set[str]) -> None:
    """`given` may hold CachedLoader keywords (or their aliases) that `owner`'s original lacked; any other
    name is a TypeError."""
    keywords = {p.name for p in inspect.signature(CachedLoader).parameters.values()
                if p.kind is not inspect.Parameter.VAR_KEYWORD}
    allowed = (keywords | set(ALIASES)) - own - {"self"}
    for name in given:
        if name not in allowed:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")


def _read_ahead(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """Yield from `batches`, keeping `depth` more already taken (and so already moved to the device)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(batch)
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


class CompatLoader(CachedLoader):
    """A CachedLoader with what the original arguments add around an epoch.

    * per-epoch stats (``benchmark``, ``benchmark_file``): one JSON line per
      epoch appended to the file, or one INFO line in the log, when the epoch
      ends (or is broken off);
    * device read-ahead (``max_nb_batch_on_device``): batches moved to the
      device ahead of the training loop, so a non-blocking copy overlaps the
      training step of the batch before;
    * log routing (``logger``), removed at close.

    Subclasses call :meth:`_setup_compat` before ``CachedLoader.__init__``.
    """

    def _setup_compat(self, benchmark: bool = False, benchmark_file: str | os.PathLike | None = None,
                      max_on_device: int = 1) -> None:
        if isinstance(max_on_device, bool) or not isinstance(max_on_device, int) or max_on_device < 1:
            raise ValueError(f"max_nb_batch_on_device must be an int >= 1, got {max_on_device!r}")
        self._benchmark = bool(benchmark) or benchmark_file is not None
        self.benchmark_file = os.fspath(benchmark_file) if benchmark_file is not None else None
        self.max_nb_batch_on_device = max_on_device
        self._routing: LogRouting | None = None
        self._routing_finalizer: Any = None

    def _route_logs(self, handlers: list[logging.Handler], level: int | None) -> None:
        if not handlers and level is None:
            return
        self._routing = LogRouting(handlers, level)
        # A loader that is garbage-collected unclosed must not leave its handlers behind.
        self._routing_finalizer = weakref.finalize(self, LogRouting.remove, self._routing)

    def __iter__(self) -> Iterator[Any]:
        # The loader appends one EpochStats per epoch, when the epoch starts: this epoch's is the next one.
        index = len(self.epoch_stats)
        return self._compat_epoch(super().__iter__(), index)

    def _compat_epoch(self, inner: Iterator[Any], index: int) -> Iterator[Any]:
        moves = self.device is not None or self.to_device is not None or self.pin_memory
        depth = self.max_nb_batch_on_device - 1 if moves else 0
        finished = False
        try:
            yield from (_read_ahead(inner, depth) if depth > 0 else inner)
            finished = True
        finally:
            close = getattr(inner, "close", None)
            if close is not None:
                close()  # the loader's own epoch clean-up first: it completes the epoch's stats
            # Only this epoch's entry: an iterator abandoned and collected later must not report the
            # epochs that started since.
            if self._benchmark:
                for stats in self.epoch_stats[index:index + 1]:
                    self._report(stats, finished)

    def _report(self, stats: EpochStats, finished: bool) -> None:
        entry = dataclasses.asdict(stats)
        entry["finished"] = finished
        entry["samples_per_second"] = stats.samples / stats.seconds if stats.seconds > 0 else None
        if self.benchmark_file is None:
            log.info("epoch %d (%s): %d batches, %d samples in %.3f s, waited %.3f s for data; %s",
                     stats.epoch, stats.mode, stats.batches, stats.samples, stats.seconds, stats.wait_seconds,
                     json.dumps(entry))
            return
        directory = os.path.dirname(os.path.abspath(self.benchmark_file))
        os.makedirs(directory, exist_ok=True)
        # Appended and closed per epoch: the file is complete up to the last epoch even if the run dies.
        with open(self.benchmark_file, "a", encoding="utf-8") as f:
            f.write(json.dumps(entry) + "\n")

    def close(self) -> None:
        """Stop workers, release shared memory, remove the log handlers this loader added (idempotent)."""
        try:
            super().close()
        finally:
            if self._routing_finalizer is not None:
                self._routing_finalizer()


