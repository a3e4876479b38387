"""Drop-in constructors for users of ``dataset_server`` and ``swift_loader``.

``from loader.compat import DataLoader, AsyncDataLoader, SwiftLoader`` takes
the place of ``from dataset_server import DataLoader`` (its shared-memory
version), ``from dataset_server import AsyncDataLoader`` (its older TCP
version) and ``from swift_loader import SwiftLoader``. Each class keeps its
original signature - positional order, names and documented defaults - and
is a :class:`~loader.CachedLoader` configured equivalently.

Every original argument either maps to ours (see the table in the README,
"Migrating from dataset_server and swift-loader") or is accepted and, when
given a value other than its default, explained once per process in the log
(``loader.compat`` logger, INFO): why this loader does not need it. Keyword
arguments of :class:`~loader.CachedLoader` that the original did not have
(``cache_setting`` for a ``SwiftLoader``, ``seed``, ``drop_last``, ...) are
passed through; any other name is a :class:`TypeError`, as from any Python
function (``swift_loader`` silently ignored misspelt options).

Two original names live on in ``CachedLoader`` with another meaning, and
are therefore *not* passed on by these classes: ``use_threading`` (in
``dataset_server`` a thread that polls the workers; in ours, workers that
are threads) and ``max_minibatch_length`` (in ``dataset_server`` bytes of a
per-worker shared-memory buffer; in ours samples per task).
"""

from __future__ import annotations

import dataclasses
import inspect
import json
import logging
import math
import os
import threading
import weakref
from collections import deque
from typing import Any, Callable, Iterator

from cachestore.collate import stack_samples

from .cached_loader import CachedLoader
from .compat_logging import LogRouting, log_handlers
from .epoch import EpochStats

log = logging.getLogger(__name__)

__all__ = ["AsyncDataLoader", "DataLoader", "SwiftLoader"]


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


def _check_pass_through(owner: str, given: dict, own: set[str]) -> None:
    """`given` may hold CachedLoader keywords that `owner`'s original lacked; any other name is a TypeError."""
    allowed = set(inspect.signature(CachedLoader).parameters) - own - {"self"}
    for name in given:
        if name not in allowed:
            raise TypeError(f"{owner}() got an unexpected keyword argument {name!r}")


def validate_dataset(dataset_class: type, dataset_params: dict, batch_size: int,
                     collate_fn: Callable | None) -> None:
    """swift_loader's ``validate=True``: build the dataset and collate one batch here, before any worker starts.

    An error in the constructor, in ``__getitem__`` or in `collate_fn` is
    raised in the training process, with a note saying which step failed.
    """
    step = f"constructing {dataset_class.__qualname__}(**dataset_kwargs)"
    try:
        dataset = dataset_class(**dataset_params)
        n = min(batch_size, len(dataset))
        step = f"reading samples 0..{n - 1}"
        samples = [dataset[i] for i in range(n)]
        step = f"collating samples 0..{n - 1} with {getattr(collate_fn, '__qualname__', 'collate_fn')}" \
            if collate_fn is not None else f"collating samples 0..{n - 1}"
        if samples:
            (collate_fn or stack_samples)(samples)
    except Exception as exc:
        if hasattr(exc, "add_note"):  # Python >= 3.11
            exc.add_note(f"validate=True: failed while {step}, in the training process, before any worker started")
        log.error("validate=True: failed while %s", step)
        raise


# ---------------------------------------------------------------------------- logging
def parse_logger_spec(spec: Any) -> dict | logging.Logger | None:
    """Check swift_loader's ``logger`` argument; a dict (or the Logger, or ``None``) back.

    `spec` is ``None`` (nothing), a file prefix (``str``), a dict with
    ``path``, ``stdout``, ``level`` (as swift_loader documented), or a
    :class:`logging.Logger` to forward our records to.
    """
    if spec is None or isinstance(spec, logging.Logger):
        return spec
    if isinstance(spec, (str, os.PathLike)):
        spec = {"path": os.fspath(spec)}
    if not isinstance(spec, dict):
        raise TypeError(f"logger must be a str (a file prefix), a dict, or a logging.Logger; got {type(spec).__name__}")
    unknown = sorted(set(spec) - {"path", "stdout", "level", "name", "suffix", "separate_sink"})
    if unknown:
        raise ValueError(f"logger has unknown key(s) {', '.join(map(repr, unknown))}; allowed: path, stdout, level")
    level = logging.getLevelName(str(spec.get("level", "DEBUG")).upper())
    if not isinstance(level, int):
        raise ValueError(f"logger['level'] {spec.get('level')!r} is not a logging level name")
    for key in ("name", "suffix", "separate_sink"):
        if key in spec:
            explain(f"logger[{key!r}]", "SwiftLoader")
    return {**spec, "level": level}


def _read_ahead(batches: Iterator[Any], depth: int) -> Iterator[Any]:
    """Yield from `batches`, keeping `depth` more already taken (and so already moved to the device)."""
    pending: deque = deque()
    for batch in batches:
        pending.append(batch)
        if len(pending) > depth:
            yield pending.popleft()
    while pending:
        yield pending.popleft()


class _CompatLoader(CachedLoader):
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


# ---------------------------------------------------------------------------- dataset_server.DataLoader
class DataLoader(_CompatLoader):
    """``dataset_server.DataLoader`` (its shared-memory version), as a :class:`~loader.CachedLoader`.

    Parameters
    ----------
    dataset_class, dataset_params, batch_size, nb_worker
        As in ``CachedLoader`` (``nb_worker`` is required here, as there).
    max_minibatch_length
        Accepted, not needed: bytes of dataset_server's per-worker buffer;
        our shared-memory slots grow to fit any batch.
    max_queue_size, prefetch_time, device, pin_memory, gpu_indices, nearby_shuffle, collate_fn
        As in ``CachedLoader``.
    shuffle
        Default ``False``, as in dataset_server.
    cache_setting, rotation_setting
        As in ``CachedLoader`` (the same keys; ``prefix`` is a directory).
    use_threading
        Accepted, not needed: dataset_server's thread that polls the workers.
        (``CachedLoader(use_threading=True)`` means worker *threads*; it is
        not set from this.)
    **cached_loader_kwargs
        Other keyword arguments of ``CachedLoader`` (``seed``, ``drop_last``, ...).
    """

    def __init__(self, dataset_class: type, dataset_params: dict, batch_size: int, nb_worker: int,
                 max_minibatch_length: int | None = None, max_queue_size: int = 20,
                 prefetch_time: float | None = None, shuffle: bool = False, device: Any = None,
                 pin_memory: bool = False, gpu_indices: list[int] | None = None, nearby_shuffle: int = 0,
                 cache_setting: dict | None = None, rotation_setting: dict | None = None,
                 use_threading: bool = False, collate_fn: Callable | None = None,
                 **cached_loader_kwargs: Any) -> None:
        own = {"dataset_class", "dataset_params", "dataset_kwargs", "batch_size", "nb_worker", "worker_per_consumer",
               "max_minibatch_length", "max_queue_size", "prefetch_time", "shuffle", "device", "pin_memory",
               "gpu_indices", "nearby_shuffle", "cache_setting", "rotation_setting", "use_threading", "collate_fn"}
        _check_pass_through(type(self).__name__, cached_loader_kwargs, own)
        if max_minibatch_length is not None:
            explain("max_minibatch_length", "DataLoader")
        if use_threading:
            explain("use_threading", "DataLoader")
        self._setup_compat()
        super().__init__(dataset_class=dataset_class, dataset_params=dataset_params, batch_size=batch_size,
                         nb_worker=nb_worker, shuffle=shuffle,
                         nearby_shuffle=nearby_shuffle, collate_fn=collate_fn, max_queue_size=max_queue_size,
                         prefetch_time=prefetch_time, device=device, pin_memory=pin_memory,
                         gpu_indices=gpu_indices, cache_setting=cache_setting, rotation_setting=rotation_setting,
                         **cached_loader_kwargs)


# ---------------------------------------------------------------------------- dataset_server.AsyncDataLoader
def _async_cache_setting(cache_setting: dict | None) -> dict | None:
    if cache_setting is None:
        return None
    if not isinstance(cache_setting, dict):
        return cache_setting  # CachedLoader names the problem
    setting = dict(cache_setting)
    if "side" in setting:
        setting.pop("side")
        explain("cache_setting['side']", "AsyncDataLoader")
    return setting


def _async_rotation_setting(client: dict | None, server: dict | None) -> dict | None:
    """One ``rotation_setting`` from AsyncDataLoader's two.

    The server rotated samples, the client rotated the batches it received:
    each sample was served ``server_rotation * client_rotation`` times. Ours
    rotates samples through one window: the product of the two rotations, the
    window of the server setting when there is one (else the client's),
    ``max_rotation_size`` as its size.
    """
    given = [s for s in (server, client) if s is not None]
    if not given:
        return None
    for setting in given:
        if not isinstance(setting, dict):
            return setting  # CachedLoader names the problem
    primary = given[0]
    setting = {k: v for k, v in primary.items() if k not in ("min_rotation_size", "max_rotation_size")}
    if "max_rotation_size" in primary:
        setting["size"] = primary["max_rotation_size"]
    if any("min_rotation_size" in s for s in given):
        explain("min_rotation_size", "AsyncDataLoader")
    if len(given) == 2:
        rotations = [s.get("rotation") for s in given]
        if all(isinstance(r, int) and not isinstance(r, bool) for r in rotations):
            setting["rotation"] = math.prod(rotations)
            log.info("AsyncDataLoader: server rotation %d x client rotation %d: each sample is served %d times "
                     "from one window", rotations[0], rotations[1], setting["rotation"])
    return setting


class AsyncDataLoader(_CompatLoader):
    """``dataset_server.AsyncDataLoader`` (the older TCP version), as a :class:`~loader.CachedLoader`.

    Its servers become worker processes (``nb_servers`` -> ``nb_worker``) and
    ``wait_time`` (seconds to preload before the first batch) becomes
    ``prefetch_time``, which ends as soon as the queue is full. Networking
    arguments (``start_port``, ``packet_size``, ``retry_interval``,
    ``nb_retry``) are accepted and not needed. ``cache_setting`` may keep its
    ``side`` key (there is one side here). ``client_rotation_setting`` and
    ``server_rotation_setting`` become one ``rotation_setting`` (see
    :func:`_async_rotation_setting`). Versions of AsyncDataLoader that took
    ``client_wait_time`` or ``qt_threading`` are accepted too (keywords only).
    """

    def __init__(self, dataset_class: type, dataset_params: dict, batch_size: int, nb_servers: int,
                 start_port: int = 11111, max_queue_size: int = 20, shuffle: bool = False, device: Any = None,
                 pin_memory: bool = False, packet_size: int = 125000, wait_time: float = 10,
                 retry_interval: float = 10, nb_retry: int = 10, gpu_indices: list[int] | None = None,
                 nearby_shuffle: int = 0, cache_setting: dict | None = None,
                 client_rotation_setting: dict | None = None, server_rotation_setting: dict | None = None,
                 *, client_wait_time: float | None = None, qt_threading: bool | None = None,
                 **cached_loader_kwargs: Any) -> None:
        own = {"dataset_class", "dataset_params", "dataset_kwargs", "batch_size", "nb_worker", "worker_per_consumer",
               "max_queue_size", "shuffle", "device", "pin_memory", "prefetch_time", "gpu_indices",
               "nearby_shuffle", "cache_setting", "rotation_setting"}
        _check_pass_through(type(self).__name__, cached_loader_kwargs, own)
        for name, value, default in (("start_port", start_port, 11111), ("packet_size", packet_size, 125000),
                                     ("retry_interval", retry_interval, 10), ("nb_retry", nb_retry, 10),
                                     ("client_wait_time", client_wait_time, None),
                                     ("qt_threading", qt_threading, None)):
            if value != default:
                explain(name, "AsyncDataLoader")
        self._setup_compat()
        super().__init__(dataset_class=dataset_class, dataset_params=dataset_params, batch_size=batch_size,
                         nb_worker=nb_servers, shuffle=shuffle,
                         nearby_shuffle=nearby_shuffle, max_queue_size=max_queue_size, prefetch_time=wait_time,
                         device=device, pin_memory=pin_memory, gpu_indices=gpu_indices,
                         cache_setting=_async_cache_setting(cache_setting),
                         rotation_setting=_async_rotation_setting(client_rotation_setting, server_rotation_setting),
                         **cached_loader_kwargs)


# ---------------------------------------------------------------------------- swift_loader.SwiftLoader
class SwiftLoader(_CompatLoader):
    """``swift_loader.SwiftLoader``, as a :class:`~loader.CachedLoader` with a deferred start.

    Nothing runs until :meth:`start` names the consumer (as in swift_loader,
    ``len()`` and iteration before it are a ``RuntimeError``); ``validate``
    runs at construction.

    Parameters
    ----------
    dataset_class, dataset_kwargs, batch_size
        As in ``CachedLoader``.
    nb_consumer
        Consumers (GPUs, ranks) sharing the data; each gets a disjoint part.
    worker_per_consumer
        Worker processes of this consumer (``nb_worker``).
    shuffle
        Default ``True``.
    seed, seed_numer
        The shuffle seed (swift_loader's README spells it ``seed_numer``, its
        code reads ``seed``; give either). Default: random for one consumer,
        0 for several (every rank must draw the same partition).
    data_queue_size
        Batches in flight ahead of the training loop (``max_queue_size``).
    message_queue_size, max_buffer_size, batch_encoder, batch_decoder, multithread
        Accepted, not needed (explained in the log when set).
    collate_fn
        As in ``CachedLoader``.
    logger
        A file prefix, a dict (``path``, ``stdout``, ``level``) or a
        :class:`logging.Logger`: where the ``loader`` and ``cachestore``
        loggers also write while this loader lives (see :func:`loader.compat_logging.log_handlers`).
    nearby_shuffle
        Default ``5 * batch_size``, as in swift_loader (0: a full shuffle).
    benchmark, benchmark_file
        Per-epoch stats (:class:`~loader.EpochStats`) after each epoch: one
        JSON line appended to `benchmark_file`, else one INFO log line.
    validate
        Build the dataset and collate one batch in the training process at
        construction, so a broken dataset or collate fails here.
    max_nb_batch_on_device
        Batches on the device at once: ``N - 1`` batches are moved ahead of
        the one the loop holds (with ``device``, ``to_device`` or ``pin_memory``).
    **cached_loader_kwargs
        Keyword arguments of ``CachedLoader`` that swift_loader lacked
        (``cache_setting``, ``rotation_setting``, ``drop_last``, ...).
    """

    def __init__(self, dataset_class: type, dataset_kwargs: dict, batch_size: int, nb_consumer: int,
                 worker_per_consumer: int, shuffle: bool = True, *, seed: int | None = None,
                 seed_numer: int | None = None, data_queue_size: int = 10, message_queue_size: int = 10,
                 collate_fn: Callable | None = None, logger: Any = None, batch_encoder: Callable | None = None,
                 batch_decoder: Callable | None = None, nearby_shuffle: int | None = None,
                 benchmark: bool = True, benchmark_file: str | os.PathLike | None = None, validate: bool = True,
                 multithread: bool = False, max_nb_batch_on_device: int = 1, max_buffer_size: int | None = None,
                 **cached_loader_kwargs: Any) -> None:
        own = {"dataset_class", "dataset_params", "dataset_kwargs", "batch_size", "nb_worker", "worker_per_consumer",
               "shuffle", "seed", "max_queue_size", "collate_fn", "nearby_shuffle", "nb_consumer",
               "consumer_index", "device", "to_device"}
        _check_pass_through(type(self).__name__, cached_loader_kwargs, own)
        if seed is not None and seed_numer is not None and seed != seed_numer:
            raise ValueError(f"give seed or its spelling seed_numer, not both (got {seed} and {seed_numer})")
        for name, value, default in (("message_queue_size", message_queue_size, 10),
                                     ("max_buffer_size", max_buffer_size, None),
                                     ("batch_encoder", batch_encoder, None), ("batch_decoder", batch_decoder, None),
                                     ("multithread", multithread, False)):
            if value != default:
                explain(name, "SwiftLoader")
        if validate:
            validate_dataset(dataset_class, dataset_kwargs, batch_size, collate_fn)
        self._setup_compat(benchmark, benchmark_file, max_nb_batch_on_device)
        self._logger_spec = parse_logger_spec(logger)  # a malformed one fails now, not at start()
        self._swift_args = dict(
            dataset_class=dataset_class, dataset_kwargs=dataset_kwargs, batch_size=batch_size,
            worker_per_consumer=worker_per_consumer, shuffle=shuffle,
            seed=seed if seed is not None else seed_numer, max_queue_size=data_queue_size, collate_fn=collate_fn,
            nearby_shuffle=5 * batch_size if nearby_shuffle is None else nearby_shuffle,
            nb_consumer=nb_consumer, **cached_loader_kwargs)
        self._swift_state = "created"

    def start(self, consumer_index: int, device: Any = None, to_device: Callable | None = None) -> None:
        """Start loading for consumer `consumer_index` (0-based), delivering to `device`.

        Parameters
        ----------
        consumer_index
            Which consumer this process is, ``0 <= consumer_index < nb_consumer``.
        device
            Batches become torch tensors on this device (``"cuda"``: ``cuda:$LOCAL_RANK``).
        to_device
            A callable applied to every batch instead of the default move.

        Raises
        ------
        RuntimeError
            If called twice, or after :meth:`close`.
        """
        if self._swift_state != "created":
            raise RuntimeError("start() has been called already" if self._swift_state == "started"
                               else "this loader is closed")
        # Checked here too: the log file is named after the consumer.
        if isinstance(consumer_index, bool) or not isinstance(consumer_index, int) or consumer_index < 0:
            raise ValueError(f"consumer_index must be an int >= 0, got {consumer_index!r}")
        self._swift_state = "started"
        # Routed first, so the start-up messages (a reused cache, ...) land in the log file too.
        self._route_logs(*log_handlers(self._logger_spec, consumer_index))
        try:
            CachedLoader.__init__(self, consumer_index=consumer_index, device=device, to_device=to_device,
                                  **self._swift_args)
        except BaseException:
            self._swift_state = "failed"
            if self._routing_finalizer is not None:
                self._routing_finalizer()
            raise
        log.info("SwiftLoader started: consumer %d of %d, %d worker(s), %d samples in %d batches",
                 self.consumer_index, self.nb_consumer, self.nb_worker, self.samples_per_epoch, len(self))

    def _require_started(self) -> None:
        if self._swift_state != "started":
            raise RuntimeError("start() has not been called yet: call loader.start(consumer_index) first"
                               if self._swift_state == "created" else "this loader is closed")

    def __len__(self) -> int:
        self._require_started()
        return super().__len__()

    def __iter__(self) -> Iterator[Any]:
        self._require_started()
        return super().__iter__()

    def close(self) -> None:
        """Stop workers, release shared memory, remove log handlers (idempotent; also before start)."""
        state, self._swift_state = self._swift_state, "closed"
        if state == "started":
            super().close()
