"""CachedLoader: a multiprocess loader that caches expensive samples in a store.

The facade: it parses the arguments once (:mod:`loader.arguments`), builds
the dataset here, and hands each epoch to the :class:`~loader.epochs.runner.EpochRunner`.
``docs/ARCHITECTURE.md`` has the layers, the path of a batch and the shutdown rules.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Iterable, Iterator, NoReturn, Sequence

from cachestore import Store

from .arguments import DEFAULT_QUEUE, Arguments, parse_arguments, resolve_aliases, warn_excessive_workers
from .attributes import LoaderAttributes, TorchArguments
from .cache.scope import consumer_layout, decide_scope
from .checks import int_at_least
from .dataset import Batch, BatchFn, CollateFn, Dataset, ReadTransform, WorkerInitFn
from .device import make_mover
from .distributed import ConsumerLayout
from .errors import NotPicklableError
from .epochs.plan import EpochStats
from .epochs.runner import EpochRunner
from .executors.process.shm import sweep_dead_segments
from .executors.producer import BatchProducer
from .resources import Resources, interrupts_deferred
from .resuming import ResumableLoader
from .settings import CacheSettings, Device, RotationSettings
from .state import EpochCursor, known_length, take_identity

log = logging.getLogger(__name__)


class CachedLoader(ResumableLoader, LoaderAttributes):
    """Batches of an expensive dataset, computed by workers and cached between epochs.

    Parameters
    ----------
    dataset
        A map-style dataset (``__len__`` and ``__getitem__``, e.g. a
        ``torch.utils.data.Dataset``): each worker gets a copy. Or its class
        (alias ``dataset_class``), with `dataset_params`: each process builds its
        own, this one first (so a failing constructor raises here). Objects
        pickle cannot name (notebook classes, lambdas) go by value.
    dataset_params
        Keyword arguments of a dataset class (alias ``dataset_kwargs``).
    batch_size
        Samples per batch; ``None``: samples one by one, not collated (as torch:
        ``collate_fn``, if given, is applied to each sample; ``device`` turns
        arrays into tensors as torch's ``default_convert`` does).
    nb_worker
        Worker processes (aliases ``num_workers``, ``worker_per_consumer``); 0
        runs everything in this process. Default ``min(4, os.cpu_count())``.
    shuffle, seed, drop_last, nearby_shuffle
        A fresh permutation every epoch (default: on, off with a sampler),
        cached epochs included, deterministic from `seed` (or torch's
        `generator`) and the epoch; with ``nearby_shuffle=W`` each sample stays
        within W positions of its index.
    sampler, batch_sampler
        As in torch: any iterable of indices, or of lists of indices, drawn anew
        each epoch (``set_epoch(e)`` is called first when they have it). The
        cache still holds every index: what a generate epoch's sampler does not
        draw is computed by idle workers.
    worker_init_fn, persistent_workers, prefetch_factor, multiprocessing_context
        torch's: ``worker_init_fn(worker_id)`` runs once in each worker before
        its first task, on the worker's own copy of the dataset, which
        ``torch.utils.data.get_worker_info()`` returns there (with the worker's
        id, the number of workers and its seed); workers always persist; ``prefetch_factor`` batches per
        worker in flight; the context's start method.
    in_order
        torch's: with ``False``, an epoch that computes samples on workers serves each batch as soon as
        it is done, before an earlier one that is slower; a state records which were served.
    collate_fn
        Turns a list of samples into a batch (default :func:`loader.default_collate`).
    max_queue_size, prefetch_time
        Batches in flight in epochs that compute samples; seconds to let the
        workers fill that queue before the first batch.
    use_threading
        Workers are threads instead of processes.
    device, pin_memory, to_device
        Deliver torch tensors on `device` (through pinned memory), or apply
        `to_device` to every batch instead.
    gpu_indices
        One GPU index per worker, exposed to it as ``CUDA_VISIBLE_DEVICES``.
    max_minibatch_length
        Split each batch into tasks of at most this many samples.
    cache_setting, rotation_setting
        A :class:`~loader.settings.CacheSettings` or :class:`~loader.settings.RotationSettings`,
        or a dict of their keys; ``None``: no cache, no rotation.
    nb_consumer, consumer_index, partition
        Split the data between consumers (ranks); default from
        ``torch.distributed`` when initialised, else 1 and 0. ``partition``:
        ``"equal"`` (every consumer as many batches) or ``"contiguous"``
        (``swift_loader``'s runs); see :class:`loader.distributed.ConsumerLayout`.
    start_method
        ``"auto"`` (default: fork while nothing unsafe runs in this process, else
        spawn; see :mod:`loader.executors.process.start`), ``"fork"``, ``"spawn"``
        or ``"forkserver"``.
    max_worker_restarts
        Worker deaths tolerated per epoch before the epoch fails.
    timeout
        Seconds the loop may wait for one batch; past it, :class:`~loader.errors.WorkerTimeoutError`
        names the indices, the worker's pid and its Python stack. ``None``: a
        wait of over a minute is logged with the same details.
    progress
        Show progress on stderr during epochs that compute samples (``None``: when stderr is a terminal).
    executor, executor_options
        ``"process"`` (default) or ``"ray"``: Ray actors anywhere in a Ray
        cluster, with ``executor_options`` (:mod:`loader.executors.ray_options`).
    read_transform
        ``fn(sample, rng) -> sample``, applied to every sample served, after the
        store (which keeps untransformed samples; not part of the cache
        fingerprint): the cheap random augmentation on top of the cached
        expensive part. `rng` is a ``numpy.random.Generator`` seeded from
        ``(seed, epoch, index)``; torch's and Python's global generators are
        seeded from it too before each call.
    **aliases
        The other names of these arguments (:data:`loader.arguments.ALIASES`).
    """

    def __init__(self, dataset: Dataset | type[Dataset] | None = None, dataset_params: dict[str, object] | None = None,
                 batch_size: int | None = 1, *, nb_worker: int | None = None, shuffle: bool | None = None,
                 sampler: Iterable[int] | None = None, batch_sampler: Iterable[Sequence[int]] | None = None,
                 worker_init_fn: WorkerInitFn | None = None, generator: object = None,
                 persistent_workers: bool = False, prefetch_factor: int | None = None,
                 multiprocessing_context: object = None, in_order: bool = True,
                 seed: int | None = None, drop_last: bool = False, nearby_shuffle: int = 0,
                 collate_fn: CollateFn | None = None, max_queue_size: int = DEFAULT_QUEUE, prefetch_time: float | None = None,
                 use_threading: bool = False, device: Device = None, pin_memory: bool = False,
                 gpu_indices: list[int] | None = None, max_minibatch_length: int | None = None,
                 cache_setting: CacheSettings | dict[str, object] | None = None,
                 rotation_setting: RotationSettings | dict[str, object] | None = None,
                 nb_consumer: int | None = None, consumer_index: int | None = None, partition: str = "equal",
                 to_device: BatchFn | None = None,
                 start_method: str | None = None, max_worker_restarts: int = 3, timeout: float | None = None,
                 progress: bool | None = None, executor: str = "process",
                 executor_options: dict[str, object] | None = None, read_transform: ReadTransform | None = None,
                 **aliases: object) -> None:
        given = Arguments(
            dataset=dataset, dataset_params=dataset_params, batch_size=batch_size, nb_worker=nb_worker,
            shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler, worker_init_fn=worker_init_fn,
            generator=generator, persistent_workers=persistent_workers, prefetch_factor=prefetch_factor,
            multiprocessing_context=multiprocessing_context, in_order=in_order, seed=seed, drop_last=drop_last,
            nearby_shuffle=nearby_shuffle, collate_fn=collate_fn, max_queue_size=max_queue_size,
            prefetch_time=prefetch_time, use_threading=use_threading, device=device, pin_memory=pin_memory,
            gpu_indices=gpu_indices, max_minibatch_length=max_minibatch_length, cache_setting=cache_setting,
            rotation_setting=rotation_setting, nb_consumer=nb_consumer, consumer_index=consumer_index,
            partition=partition, to_device=to_device, start_method=start_method,
            max_worker_restarts=max_worker_restarts, timeout=timeout, progress=progress, executor=executor,
            executor_options=executor_options, read_transform=read_transform)
        self._res = Resources()
        self._finalizer = weakref.finalize(self, Resources.release, self._res)
        self._closed = False
        arguments = resolve_aliases(given, aliases, type(self).__name__)
        self.settings = parse_arguments(arguments)
        self._given = TorchArguments.of(arguments)
        s = self.settings
        self.epoch_stats: list[EpochStats] = []
        self._cursor = EpochCursor()
        self._runner: EpochRunner | None = None
        self._len_told: int | None = None  # what len(loader) said of a stream not written yet
        self._pinned_plan: dict[str, object] | None = None  # the cache plan a state before the start holds
        # Built here too: its length and fingerprint are needed, and a constructor
        # that fails should fail now, not in a worker.
        self.dataset = s.dataset.build()
        self.num_samples = self._data_length()
        self.settings = s = decide_scope(s, self.num_samples)  # before anything is written
        self._producer = BatchProducer(self.dataset, s.collate_fn, "main", s.allow_pickle, hands_out=True,
                                       read_transform=s.read_transform)
        warn_excessive_workers(s)
        # Nothing starts here: workers, the store and the fingerprint wait for the first iter() (or start()),
        # and take the dataset as it is then, as torch's DataLoader does.

    def start(self, consumer_index: int, device: Device = None, to_device: BatchFn | None = None) -> None:
        """Deferred start (``swift_loader`` style) when `consumer_index` was not given.

        Raises
        ------
        RuntimeError
            If the loader was already started (or got `consumer_index` at construction), or is closed.
        """
        if self._closed:
            raise RuntimeError("this loader is closed")
        if self._runner is not None or not self.settings.deferred_start:
            raise RuntimeError("this loader is already started; start() is called once, and only when "
                               "consumer_index was not given to the constructor")
        if int_at_least("consumer_index", consumer_index, 0) >= self.nb_consumer:
            raise ValueError(f"consumer_index {consumer_index} must be < nb_consumer {self.nb_consumer}")
        self.settings = dataclasses.replace(
            self.settings, consumer_index=consumer_index, deferred_start=False,
            device=device if device is not None else self.settings.device,
            to_device=to_device if to_device is not None else self.settings.to_device)
        self._start()

    def _layout(self, num_samples: int | None = None) -> ConsumerLayout:
        """This consumer's layout (the runner's, once started), or the one of a dataset of `num_samples`."""
        n = self.num_samples if num_samples is None else num_samples
        if self._runner is not None and n == self.num_samples:
            return self._runner.layout
        s = self.settings
        return consumer_layout(s, n)

    def _start(self) -> None:
        """Open the store and start the workers, with the dataset as it is now; at the first start its
        identity is taken (:func:`loader.state.take_identity`): an attribute set since the constructor is
        in it, what the loader's own iteration changes later is not."""
        s = self.settings
        take_identity(s.dataset)
        sweep_dead_segments()
        self._runner = EpochRunner(s, self._layout(), self._producer, self._res, make_mover(s), self.epoch_stats)
        self._runner.ctx.stream_len_called = self._len_told
        if self._pinned_plan is not None and self._runner.ctx.cache is not None:
            self._runner.ctx.cache.restore(self._pinned_plan)  # what a state taken before now says
        self._pinned_plan = None  # once: a runner built again later (a stream grew) plans on from its own
        if s.worker_init_fn is not None and s.nb_worker > 0 and not s.dataset.stream:
            self._runner.ctx.host.start_ready()

    # ------------------------------------------------------------------ what it serves
    @property
    def seed(self) -> int:
        """The seed of every epoch's order: the given one, a drawn one, or a loaded state's."""
        if self._cursor.loaded is not None:
            return self._cursor.loaded.seed
        return self._runner.state.seed if self._runner is not None else self.settings.seed

    @property
    def rotation(self) -> RotationSettings | None:
        """The rotation window epochs go through (``on_budget_exceeded="rotate"`` may switch to one)."""
        return self._runner.state.rotation if self._runner is not None else self.settings.rotation

    def __iter__(self) -> Iterator[Batch]:
        """The batches of the next epoch.

        A loader runs one epoch at a time: a new ``iter(loader)`` ends the epoch
        of the previous iterator, whose next ``next()`` then raises
        ``RuntimeError`` (so ``zip(loader, loader)`` fails instead of silently
        yielding nothing).
        """
        if self._closed:
            raise RuntimeError("this loader is closed")
        self._follow_length()
        if self._runner is None:
            if self.settings.deferred_start:
                raise RuntimeError("call loader.start(consumer_index) before iterating: consumer_index was not given")
            self._start()
            assert self._runner is not None
        epoch, skip, ahead = self._cursor.begin()
        if self._cursor.loaded is not None:
            r, self._cursor.loaded = self._cursor.loaded, None
            self._runner.restore(r.seed, r.cache, r.rotation_fallback, r.rotation_window, epoch, skip, r.ranks,
                                 r.stream, r.generating, r.history, r.blocks)
        self._runner.prime(epoch, skip)
        return self._cursor.iterate(epoch, skip, self._runner.run(epoch, skip, ahead), known_length(self._batches),
                                    owner=self, ahead=ahead)

    # ------------------------------------------------------------------ info & shutdown
    @property
    def store(self) -> Store | None:
        """The cache store (``None`` without ``cache_setting``)."""
        return self._res.store

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes (a stream's too; empty for ``nb_worker=0``, threads or Ray actors)."""
        executor, streams = self._res.executor, self._res.streams
        return ([] if executor is None else executor.pids()) + ([] if streams is None else streams.pids())

    def close(self) -> None:
        """Stop workers, release shared memory, keep an unfinished generation as a partial one, which the
        next run with the same fingerprint completes (``cachestore prune --partial`` removes it); idempotent."""
        if self._closed:
            return
        self._closed = True
        with interrupts_deferred():  # a second Ctrl-C must not cut the clean-up short
            self._cursor.close_active()
            self._producer.close()
            self._finalizer()

    def __reduce_ex__(self, protocol: object) -> NoReturn:
        """Refused, saying what to send instead (pickle would fail on a queue deep inside)."""
        store = self._res.store
        where = (f"; this loader's committed cache is readable anywhere with cachestore.open_store({store.path!r})"
                 ".reader()" if store is not None else
                 "; a cache a loader committed is readable anywhere with cachestore.open_store(<its path>).reader()")
        raise NotPicklableError(
            f"a {type(self).__name__} cannot be pickled or copied: it holds worker processes, shared memory and an "
            "open store. Send what builds it instead (the dataset, or its class and parameters, and the loader's "
            f"arguments) and build a {type(self).__name__} where it is needed{where}")

    def __enter__(self) -> CachedLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
