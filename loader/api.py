"""CachedLoader: a multiprocess loader that caches expensive samples in a store.

The facade: it validates the arguments (:mod:`loader.settings`), builds the
dataset once here, and hands each epoch to the :class:`~loader.runner.EpochRunner`,
which asks the :class:`~loader.cache.CacheController` what the epoch does.
``docs/ARCHITECTURE.md`` has the layers, the path of a batch and the shutdown rules.
"""

from __future__ import annotations

import os
import weakref
from typing import Any, Callable, Iterator

from cachestore import Store

from .checks import check_importable_by_workers
from .device import DeviceMover
from .epochs import order as sampler
from .epochs.layout import ConsumerLayout
from .epochs.plan import EpochStats
from .epochs.rotation import batch_sizes
from .epochs.runner import EpochRunner
from .executors.process.shm import sweep_dead_segments
from .executors.producer import BatchProducer
from .resources import Resources
from .settings import CacheSettings, LoaderSettings, RotationSettings, check_int
from .state import EpochIterator, EpochProgress, check_state, make_state

#: Settings readable as loader attributes (see CachedLoader.__getattr__).
_ARGUMENTS = frozenset({
    "dataset_class", "dataset_params", "batch_size", "nb_worker", "shuffle", "seed", "drop_last", "nearby_shuffle",
    "collate_fn", "max_queue_size", "prefetch_time", "use_threading", "device", "pin_memory", "gpu_indices",
    "max_minibatch_length", "nb_consumer", "consumer_index", "to_device", "start_method", "max_worker_restarts",
    "timeout", "progress", "executor", "executor_options",
})


class CachedLoader:
    """Batches of an expensive dataset, computed by workers and cached between epochs.

    Parameters
    ----------
    dataset_class
        The dataset class; each worker builds its own instance as
        ``dataset_class(**dataset_params)``. It must be importable by module
        path (workers start with ``spawn``) and define ``__len__`` and
        ``__getitem__(int)``. The training process builds one instance too,
        for the length and the cache fingerprint (so a failing constructor
        raises here).
    dataset_params
        Keyword arguments of `dataset_class` (alias: ``dataset_kwargs``).
    batch_size
        Samples per batch.
    nb_worker
        Worker processes; 0 runs everything in the calling process
        (debugging). Default ``min(4, os.cpu_count())``. Alias:
        ``worker_per_consumer``.
    shuffle, seed, drop_last
        A fresh permutation every epoch (cached epochs included),
        deterministic from `seed` and the epoch.
    nearby_shuffle
        If > 0, each sample stays within this many positions of its index.
    collate_fn
        Turns a list of samples into a batch; default: stack arrays, tensors
        and scalars recursively through dicts, lists and tuples.
    max_queue_size
        Batches in flight in epochs that compute samples (ahead of the
        training loop); cached epochs read at most two per worker ahead.
    prefetch_time
        Seconds to let the workers fill the queue before the first batch.
    use_threading
        Workers are threads instead of processes.
    device, pin_memory
        Deliver batches as torch tensors on `device`, through pinned memory.
    gpu_indices
        One GPU index per worker, exposed to it as ``CUDA_VISIBLE_DEVICES``.
    max_minibatch_length
        Split each batch into tasks of at most this many samples, computed in
        parallel by several workers.
    cache_setting
        ``{"prefix": ..., "update_frequency": K, "backend": ..., "compression": ...,
        "disk_budget": ..., "on_budget_exceeded": "error" | "stream" | "rotate"}``;
        see :class:`loader.settings.CacheSettings`. ``None``: no cache.
    rotation_setting
        Sample rotation; see :class:`loader.settings.RotationSettings`.
    nb_consumer, consumer_index
        Split the data between consumers (ranks); default from
        ``torch.distributed`` when initialised, else 1 and 0.
    to_device
        A callable applied to every batch instead of the default device move.
    start_method
        Multiprocessing start method of the workers: ``"spawn"`` (the default) or ``"fork"``.
    max_worker_restarts
        Worker deaths tolerated per epoch before the epoch fails.
    timeout
        Seconds the training loop may wait for one batch from the workers (as
        in torch's ``DataLoader``); past it, :class:`~loader.errors.WorkerTimeoutError`
        names the indices being computed, the worker's pid and its Python
        stack. ``None`` (default) waits, but a wait of over a minute is logged
        with the same details. No effect with ``nb_worker=0``.
    progress
        Show samples computed, samples/s and ETA on stderr during epochs that
        compute samples (generate, refresh, rotation) once they take more than
        a few seconds. ``None`` (default): only when stderr is a terminal.
    executor
        Where samples are computed: ``"process"`` (default: `nb_worker`
        processes, or threads with `use_threading`) or ``"ray"``: Ray actors
        anywhere in a Ray cluster, each building the dataset from
        `dataset_class` and `dataset_params`. With Ray, batches and records
        return through Ray's object store, this process writes the cache (or
        the rotation window), and cached epochs are read here. Needs
        ``pip install "cachestore[ray]"``.
    executor_options
        With ``executor="ray"``: ``{"address": None | "auto" | "HOST:PORT" |
        "ray://HOST:PORT", "num_workers": N, "actor_options": {"num_cpus": 1,
        "resources": {...}, ...}, "init_options": {...}, "start_timeout": 120}``.
        Without an address, a process already connected to Ray uses that
        connection, else a local Ray is started for the loader and shut down
        when it closes; a loader that connected to a cluster leaves it running.
        Its actors are always terminated on close. See
        :func:`loader.settings.parse_executor`.
    """

    def __init__(
        self,
        dataset_class: type,
        dataset_params: dict | None = None,
        batch_size: int = 1,
        nb_worker: int | None = None,
        shuffle: bool = True,
        seed: int | None = None,
        drop_last: bool = False,
        nearby_shuffle: int = 0,
        collate_fn: Callable | None = None,
        max_queue_size: int = 20,
        prefetch_time: float | None = None,
        use_threading: bool = False,
        device: Any = None,
        pin_memory: bool = False,
        gpu_indices: list[int] | None = None,
        max_minibatch_length: int | None = None,
        cache_setting: dict | None = None,
        rotation_setting: dict | None = None,
        *,
        dataset_kwargs: dict | None = None,
        worker_per_consumer: int | None = None,
        nb_consumer: int | None = None,
        consumer_index: int | None = None,
        to_device: Callable | None = None,
        start_method: str = "spawn",
        max_worker_restarts: int = 3,
        timeout: float | None = None,
        progress: bool | None = None,
        executor: str = "process",
        executor_options: dict | None = None,
    ) -> None:
        self._res = Resources()
        self._finalizer = weakref.finalize(self, Resources.release, self._res)
        self._closed = False
        self.settings = LoaderSettings.from_arguments(
            dataset_class, dataset_params, batch_size, nb_worker, shuffle, seed, drop_last, nearby_shuffle,
            collate_fn, max_queue_size, prefetch_time, use_threading, device, pin_memory, gpu_indices,
            max_minibatch_length, cache_setting, rotation_setting, dataset_kwargs=dataset_kwargs,
            worker_per_consumer=worker_per_consumer, nb_consumer=nb_consumer, consumer_index=consumer_index,
            to_device=to_device, start_method=start_method, max_worker_restarts=max_worker_restarts,
            timeout=timeout, progress=progress, executor=executor, executor_options=executor_options)
        s = self.settings
        check_importable_by_workers(s.dataset_class, nb_worker=s.nb_worker, use_threading=s.use_threading,
                                    start_method=s.start_method, collate_fn=s.collate_fn)
        self.epoch_stats: list[EpochStats] = []
        self._next_epoch = 0  # the epoch the next iter() serves
        self._current: int | None = None  # the epoch of the latest iter(), until set_epoch()
        self._skip = 0  # batches of the next epoch served before a resume
        self._restore: dict | None = None  # a loaded state's cache plan, applied when the runner exists
        self._progress: EpochProgress | None = None  # the latest epoch's, kept after its iterator is gone
        self._active: Any = None
        self._runner: EpochRunner | None = None
        # Built here too: its length and fingerprint are needed, and a constructor
        # that fails should fail now, not in a worker.
        self.dataset = s.dataset_class(**s.dataset_params)
        self.num_samples = len(self.dataset)
        self._producer = BatchProducer(self.dataset, s.collate_fn, "main", s.allow_pickle)
        sweep_dead_segments()
        if not s.deferred_start:
            self._start()

    # ------------------------------------------------------------------ set-up
    def _make_mover(self) -> Callable | None:
        s = self.settings
        if s.to_device is not None:
            return s.to_device
        if s.device is None and not s.pin_memory:
            return None
        device = s.device
        if isinstance(device, str) and device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return DeviceMover(device, s.pin_memory)

    def start(self, consumer_index: int, device: Any = None, to_device: Callable | None = None) -> None:
        """Deferred start (``swift_loader`` style) when `consumer_index` was not given.

        Raises
        ------
        RuntimeError
            If the loader was already started (or got `consumer_index` at construction).
        """
        if self._runner is not None:
            raise RuntimeError("this loader is already started; start() is called once, and only when "
                               "consumer_index was not given to the constructor")
        check_int("consumer_index", consumer_index, 0)
        if consumer_index >= self.nb_consumer:
            raise ValueError(f"consumer_index {consumer_index} must be < nb_consumer {self.nb_consumer}")
        self.settings.consumer_index = consumer_index
        if device is not None:
            self.settings.device = device
        if to_device is not None:
            self.settings.to_device = to_device
        self._start()

    def _start(self) -> None:
        s = self.settings
        layout = ConsumerLayout(self.num_samples, s.nb_consumer, s.consumer_index, s.seed,
                                pinned=s.cache is not None or not s.shuffle)
        self._runner = EpochRunner(s, layout, self._producer, self._res, self._make_mover(), self.epoch_stats)

    # ------------------------------------------------------------------ what it serves
    @property
    def cache(self) -> CacheSettings | None:
        """The parsed ``cache_setting`` (``None`` without a cache)."""
        return self.settings.cache

    @property
    def rotation(self) -> RotationSettings | None:
        """The parsed ``rotation_setting`` (set by ``on_budget_exceeded="rotate"`` when it switches)."""
        return self.settings.rotation

    def __getattr__(self, name: str) -> Any:
        # The constructor's arguments stay readable as attributes (loader.batch_size, loader.seed, ...),
        # resolved: aliases merged, defaults filled in. Only reached for names not found otherwise.
        if name in _ARGUMENTS and "settings" in self.__dict__:
            return getattr(self.__dict__["settings"], name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    @property
    def samples_per_epoch(self) -> int:
        """Samples this consumer serves per epoch (before rotation repeats them)."""
        return -(-self.num_samples // self.nb_consumer)

    def __len__(self) -> int:
        s = self.settings
        if s.rotation is not None:
            return len(batch_sizes(self.samples_per_epoch, s.rotation.rotation, s.batch_size, s.drop_last))
        return sampler.num_batches(self.samples_per_epoch, s.batch_size, s.drop_last)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        """The batches of the next epoch.

        A loader runs one epoch at a time: a new ``iter(loader)`` ends the epoch
        of the previous iterator, whose next ``next()`` then raises
        ``RuntimeError`` (so ``zip(loader, loader)`` fails instead of silently
        yielding nothing).
        """
        if self._closed:
            raise RuntimeError("this loader is closed")
        if self._runner is None:
            raise RuntimeError("call loader.start(consumer_index) before iterating: consumer_index was not given")
        epoch, skip = self._next_epoch, self._skip
        self._close_active(superseded_by=epoch)
        if self._restore is not None:
            self._runner.restore(self._restore["cache"], self._restore["rotation_fallback"])
            self._runner.adopt_window(self._restore["rotation_window"], epoch, skip)
            self._restore = None
        self._next_epoch, self._current, self._skip = epoch + 1, epoch, 0
        self._progress = EpochProgress(epoch, skip)
        it = EpochIterator(self._runner.run(epoch, skip), self._progress)
        self._active = weakref.ref(it)
        return it

    # ------------------------------------------------------------------ resuming
    @property
    def epoch(self) -> int:
        """The epoch being served (or, before its ``iter()``, the one the next ``iter()`` serves)."""
        return self._current if self._current is not None else self._next_epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` serve `epoch` (as ``DistributedSampler.set_epoch``).

        The order, the generation read or written and the partition all
        follow from the epoch number, so calling this with the loop's own
        counter keeps every rank, and a resumed run, in step.
        """
        check_int("epoch", epoch, 0)
        if epoch != self._next_epoch:
            self._skip = 0
        self._next_epoch, self._current, self._progress = epoch, None, None

    def state_dict(self) -> dict:
        """Where the run is, as a small dict of plain values (picklable, JSON-able).

        Taken between epochs or in the middle of one: a new loader built with
        the same arguments continues after :meth:`load_state_dict` exactly
        where this one was, batch for batch, generation for generation.
        Samples are not in it: a generation being written survives in the
        store's staging area.
        """
        progress = self._progress
        if progress is not None and not progress.exhausted:
            # Also after a `break`: the rest of that epoch is what a resumed run serves first.
            epoch, served = progress.epoch, progress.served
        else:
            epoch, served = self._next_epoch, self._skip
        window = self._runner.window_path() if self._runner is not None else None
        if self._restore is not None:  # loaded, not iterated yet: still the loaded plan
            cache, fallback = self._restore["cache"], self._restore["rotation_fallback"]
            window = self._restore["rotation_window"]
        elif self._runner is not None:
            cache, fallback = self._runner.snapshot()
        else:
            cache, fallback = None, None
        return make_state(self.settings, self.num_samples, epoch, served, cache, fallback, window)

    def load_state_dict(self, state: dict) -> None:
        """Continue the run `state` was taken from (call before iterating).

        Raises
        ------
        ValueError
            The state comes from a loader with other arguments (it says which).
        RuntimeError
            This loader has already started an epoch.
        """
        if self._current is not None or self._active is not None:
            raise RuntimeError("load_state_dict() is called on a new loader, before iterating it")
        check_state(state, self.settings, self.num_samples, self.settings.seed_given)
        self.settings.seed = state["seed"]
        if self._runner is not None:
            self._runner.layout.seed = state["seed"]
        self._next_epoch, self._skip = state["epoch"], state["batches_served"]
        self._restore = {"cache": state.get("cache"), "rotation_fallback": state.get("rotation_fallback"),
                         "rotation_window": state.get("rotation_window")}

    def _close_active(self, superseded_by: int | None = None) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.end(superseded_by)
        self._active = None

    # ------------------------------------------------------------------ info & shutdown
    @property
    def store(self) -> Store | None:
        """The cache store (``None`` without ``cache_setting``)."""
        return self._res.store

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes (empty for ``nb_worker=0``, threads or Ray actors)."""
        executor = self._res.executor
        return [] if executor is None else executor.pids()

    def close(self) -> None:
        """Stop workers, release shared memory, keep an unfinished generation as a partial one (idempotent).

        The partial generation (the staging area of the generation being
        written) is adopted and completed by the next run with the same
        fingerprint; ``cachestore prune --partial`` removes it.
        """
        if self._closed:
            return
        self._closed = True
        self._close_active()
        self._producer.close()
        self._finalizer()

    def __enter__(self) -> "CachedLoader":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
