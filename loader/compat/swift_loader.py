"""``swift_loader``'s ``SwiftLoader``, as a :class:`~loader.CachedLoader` with a deferred start."""

from __future__ import annotations

import logging
import os
from typing import Any, Callable, Iterator

from cachestore.format.collate import stack_samples

from ..api import CachedLoader
from ..errors import add_note
from .base import CompatLoader, check_pass_through, explain
from .logging import log_handlers

log = logging.getLogger(__name__)


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
        add_note(exc, f"validate=True: failed while {step}, in the training process, before any worker started")
        log.error("validate=True: failed while %s", step)
        raise


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


class SwiftLoader(CompatLoader):
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
        loggers also write while this loader lives (see :func:`loader.compat.logging.log_handlers`).
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
        check_pass_through(type(self).__name__, cached_loader_kwargs, own)
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
        # swift_loader's split: consumer c gets the c-th contiguous run of the data, the last ones shorter.
        cached_loader_kwargs.setdefault("partition", "contiguous")
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
