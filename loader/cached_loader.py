"""CachedLoader: a multiprocess loader that caches expensive samples in a store.

Epoch plan (see DESIGN.md, Loader semantics): with ``update_frequency=K``,
epoch ``e`` of this run uses generation ``base + e // K``, where ``base`` is
the newest generation committed by an earlier run with the same fingerprint
(0 when there is none). A committed generation is read; a missing one is
generated - every sample computed by the workers, written into the store and
served at once - and committed at the end of the epoch. A broken-off epoch
commits nothing. After a commit, older generations are pruned. With
``background_refresh`` the next generation is computed by idle workers during
the cached epochs before it (:mod:`loader.refresh`).
"""

from __future__ import annotations

import logging
import math
import os
import sys
import time
import weakref
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np

from cachestore import Store, open_store
from cachestore.collate import stack_samples
from cachestore.errors import StoreLockedError

from . import sampler
from .device import DeviceMover
from .epoch import EpochPlan, EpochStats, GenerationSink, run_inline, run_pool
from .fingerprint import class_path, dataset_fingerprint, describe_params
from .pool import WorkerPool
from .refresh import BackgroundRefresh
from .resources import ConfigFactory, Resources
from .rotation import DiskWindow, MemoryWindow, batch_sizes, rotation_schedule, run_rotation
from .settings import CacheSettings, RotationSettings, check_int
from .shm import SlotPool, sweep_dead_segments
from .worker import BatchProducer

log = logging.getLogger(__name__)

#: Batches read ahead per worker in cached epochs (like torch's prefetch_factor=2).
READ_AHEAD_PER_WORKER = 2


def _distributed_defaults() -> tuple[int, int]:
    """World size and rank when torch.distributed is initialised, else (1, 0)."""
    # Only a process that imported torch.distributed can have initialised it:
    # importing torch here would cost a second for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


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
        Multiprocessing start method of the workers (default ``"spawn"``).
    max_worker_restarts
        Worker deaths tolerated per epoch before the epoch fails.
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
    ) -> None:
        self._res = Resources()
        self._finalizer = weakref.finalize(self, Resources.release, self._res)
        self._closed = False
        if not isinstance(dataset_class, type):
            raise ValueError(f"dataset_class must be a class, got {dataset_class!r}")
        if dataset_params is not None and dataset_kwargs is not None:
            raise ValueError("give dataset_params or its alias dataset_kwargs, not both")
        params = dict(dataset_params if dataset_params is not None else (dataset_kwargs or {}))
        if nb_worker is not None and worker_per_consumer is not None:
            raise ValueError("give nb_worker or its alias worker_per_consumer, not both")
        nb_worker = worker_per_consumer if nb_worker is None else nb_worker
        nb_worker = min(4, os.cpu_count() or 1) if nb_worker is None else nb_worker
        check_int("batch_size", batch_size, 1)
        check_int("nb_worker", nb_worker, 0)
        check_int("nearby_shuffle", nearby_shuffle, 0)
        check_int("max_queue_size", max_queue_size, 1)
        check_int("max_minibatch_length", max_minibatch_length, 1, allow_none=True)
        check_int("max_worker_restarts", max_worker_restarts, 0)
        check_int("seed", seed, 0, allow_none=True)
        if prefetch_time is not None and (not isinstance(prefetch_time, (int, float)) or prefetch_time < 0):
            raise ValueError(f"prefetch_time must be a number of seconds >= 0, got {prefetch_time!r}")
        if gpu_indices is not None:
            if not isinstance(gpu_indices, (list, tuple)) or len(gpu_indices) != max(nb_worker, 1):
                raise ValueError(f"gpu_indices must give one GPU index per worker ({max(nb_worker, 1)}), "
                                 f"got {gpu_indices!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError("collate_fn must be callable")
        if to_device is not None and not callable(to_device):
            raise ValueError("to_device must be callable")
        self.cache = CacheSettings.parse(cache_setting) if cache_setting is not None else None
        self.rotation = RotationSettings.parse(rotation_setting) if rotation_setting is not None else None
        if self.cache is not None and self.rotation is not None:
            raise ValueError("cache_setting and rotation_setting cannot be combined: a cache keeps every sample, "
                             "rotation a window of them. Use cache_setting={..., 'on_budget_exceeded': 'rotate'} "
                             "to rotate only when the cache does not fit")
        default_nb, default_idx = _distributed_defaults()
        self.nb_consumer = default_nb if nb_consumer is None else nb_consumer
        check_int("nb_consumer", self.nb_consumer, 1)
        self._deferred_start = consumer_index is None and nb_consumer is not None and self.nb_consumer > 1
        self.consumer_index = default_idx if consumer_index is None else consumer_index
        check_int("consumer_index", self.consumer_index, 0)
        if self.consumer_index >= self.nb_consumer:
            raise ValueError(f"consumer_index {self.consumer_index} must be < nb_consumer {self.nb_consumer}")

        self.dataset_class = dataset_class
        self.dataset_params = params
        self.batch_size = batch_size
        self.nb_worker = nb_worker
        self.shuffle = shuffle
        if seed is None:
            # Every rank must draw the same permutation: a random seed only for a single consumer.
            seed = int(np.random.SeedSequence().entropy % (2**63)) if self.nb_consumer == 1 else 0
        self.seed = seed
        self.drop_last = drop_last
        self.nearby_shuffle = nearby_shuffle
        self.collate_fn = collate_fn
        self.max_queue_size = max_queue_size
        self.prefetch_time = prefetch_time
        self.use_threading = use_threading
        self.gpu_indices = list(gpu_indices) if gpu_indices is not None else None
        self.max_minibatch_length = max_minibatch_length
        self.start_method = start_method
        self.max_worker_restarts = max_worker_restarts
        self.device = device
        self.pin_memory = pin_memory
        self.to_device = to_device
        self.epoch_stats: list[EpochStats] = []
        self._epoch = 0
        self._active: Any = None
        self._cache_off = False
        self._refresh: BackgroundRefresh | None = None
        self._refresh_off = False
        self._base: int | None = None

        # Built here too: its length and fingerprint are needed, and a constructor
        # that fails should fail now, not in a worker.
        self.dataset = dataset_class(**params)
        self.num_samples = len(self.dataset)
        self._producer = BatchProducer(self.dataset, collate_fn, "main", self.cache.allow_pickle if self.cache else False)
        self._mover = self._make_mover()
        sweep_dead_segments()
        self._started = False
        if not self._deferred_start:
            self._start()

    # ------------------------------------------------------------------ set-up
    def _make_mover(self) -> Callable | None:
        if self.to_device is not None:
            return self.to_device
        if self.device is None and not self.pin_memory:
            return None
        device = self.device
        if isinstance(device, str) and device == "cuda":
            device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"
        return DeviceMover(device, self.pin_memory)

    def start(self, consumer_index: int, device: Any = None, to_device: Callable | None = None) -> None:
        """Deferred start (``swift_loader`` style) when `consumer_index` was not given.

        Raises
        ------
        RuntimeError
            If the loader was already started (or got `consumer_index` at construction).
        """
        if self._started:
            raise RuntimeError("this loader is already started; start() is called once, and only when "
                               "consumer_index was not given to the constructor")
        check_int("consumer_index", consumer_index, 0)
        if consumer_index >= self.nb_consumer:
            raise ValueError(f"consumer_index {consumer_index} must be < nb_consumer {self.nb_consumer}")
        self.consumer_index = consumer_index
        if device is not None:
            self.device = device
        if to_device is not None:
            self.to_device = to_device
        self._mover = self._make_mover()
        self._start()

    def _start(self) -> None:
        self._started = True
        self._indices = self._partition(0)
        if self.cache is not None:
            self._open_store()
        if self.rotation is not None:
            self._open_window()
        if self.nb_worker > 0:
            self._ensure_pool()

    def _store_path(self) -> str:
        prefix = Path(self.cache.prefix)
        if self.nb_consumer > 1:
            return str(prefix / f"consumer-{self.consumer_index}-of-{self.nb_consumer}")
        return str(prefix)

    def _open_store(self) -> None:
        fingerprint = dataset_fingerprint(self.dataset_class, self.dataset_params, self.num_samples,
                                          (self.consumer_index, self.nb_consumer))
        producer = {"dataset": class_path(self.dataset_class), "params": describe_params(self.dataset_params),
                    "update_frequency": None if self.cache.update_frequency == math.inf else self.cache.update_frequency,
                    "batch_size": self.batch_size, "consumer": [self.consumer_index, self.nb_consumer]}
        self._res.store = open_store(self._store_path(), self.cache.backend, compression=self.cache.compression,
                                     disk_budget=self.cache.disk_budget, allow_pickle=self.cache.allow_pickle,
                                     fingerprint=fingerprint, producer=producer, verify=self.cache.verify)
        latest = self._res.store.latest()
        self._base = latest if latest is not None else 0
        if latest is not None:
            log.info("reusing generation %d of %s", latest, self._store_path())

    def _open_window(self) -> None:
        slots = self.rotation.window(len(self._indices), self.batch_size)
        if self.rotation.medium == "disk":
            self._res.window = DiskWindow(self.rotation.prefix, slots)
        else:
            self._res.window = MemoryWindow(slots)

    def _switch_to_rotation(self, fits: int | None) -> None:
        """``on_budget_exceeded="rotate"``: the cache does not fit; rotate through a disk window that does."""
        k = self.cache.update_frequency
        rotation = int(k) if k != math.inf else 4
        available = self._res.store._budget().available
        if fits and available:
            # One file per slot: allocated in whole blocks, plus the record header.
            per_slot = -(-(available / fits + 512) // 4096) * 4096
            fits = int(available // per_slot)
        size = max(1, min(fits if fits is not None else self.batch_size, len(self._indices)))
        self.rotation = RotationSettings("disk", rotation, size, self._store_path())
        self._open_window()
        log.warning("the cache of %d samples does not fit the disk budget of %s: switching to disk rotation "
                    "(rotation=%d, size=%d samples, window under %s); an epoch now serves %d batches",
                    len(self._indices), self._store_path(), rotation, size, self._store_path(), len(self))

    def _ensure_pool(self) -> WorkerPool:
        if self._res.pool is None:
            # The pool must not reference the loader: the finalizer that releases the
            # pool would then keep the loader alive forever.
            make_config = ConfigFactory(self.dataset_class, self.dataset_params, self.collate_fn, self.gpu_indices,
                                         self.cache.allow_pickle if self.cache else False)
            self._res.pool = WorkerPool(make_config, self.nb_worker, self.use_threading,
                                        self.start_method, self.max_worker_restarts)
            self._res.pool.on_death = self._res.discard_dead_shard
        if self._res.slots is None:
            self._res.slots = SlotPool(min(self.max_queue_size, 4))
        return self._res.pool

    # ------------------------------------------------------------------ plan
    def _partition(self, epoch: int) -> np.ndarray:
        """Dataset indices this consumer serves in `epoch` (padded so every consumer gets as many)."""
        n, k, i = self.num_samples, self.nb_consumer, self.consumer_index
        if k == 1:
            return np.arange(n, dtype=np.int64)
        per = -(-n // k)
        pinned = self.cache is not None or not self.shuffle
        base = np.arange(n, dtype=np.int64) if pinned else np.random.default_rng([self.seed, epoch, 1]).permutation(n)
        return np.resize(base, per * k)[i::k]

    @property
    def samples_per_epoch(self) -> int:
        return len(self._indices) if self._started else -(-self.num_samples // self.nb_consumer)

    def __len__(self) -> int:
        if self.rotation is not None:
            return len(batch_sizes(self.samples_per_epoch, self.rotation.rotation, self.batch_size, self.drop_last))
        return sampler.num_batches(self.samples_per_epoch, self.batch_size, self.drop_last)

    def _plan(self, epoch: int) -> EpochPlan:
        if self.cache is None and self.nb_consumer > 1:
            self._indices = self._partition(epoch)
        order = sampler.epoch_order(len(self._indices), epoch, self.seed, self.shuffle, self.nearby_shuffle)
        if self.rotation is not None:
            # Generation order: the i-th generated sample is dataset index indices[order[i]].
            return EpochPlan(epoch, "rotate", None, [], self._indices[order])
        batches = sampler.split_batches(order, self.batch_size, self.drop_last)
        store = self._res.store
        if store is None or self._cache_off:
            return EpochPlan(epoch, "compute", None, batches, self._indices)
        k = self.cache.update_frequency
        generation = self._base + (0 if k == math.inf else epoch // int(k))
        committed = {g.id for g in store.generations() if g.committed}
        if generation not in committed and self._refresh is not None and self._refresh.generation == generation:
            if self._complete_refresh(epoch):
                committed.add(generation)
        return EpochPlan(epoch, "read" if generation in committed else "generate", generation, batches, self._indices)

    # ------------------------------------------------------------------ iteration
    def __iter__(self) -> Iterator[Any]:
        if self._closed:
            raise RuntimeError("this loader is closed")
        if not self._started:
            raise RuntimeError("call loader.start(consumer_index) before iterating: consumer_index was not given")
        self._close_active()
        epoch = self._epoch
        self._epoch += 1
        it = self._run_epoch(epoch)
        self._active = weakref.ref(it)
        return it

    def _close_active(self) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.close()
        self._active = None

    def _begin_generation(self, generation: int) -> GenerationSink | None:
        store = self._res.store
        committed = [g for g in store.generations() if g.committed]
        if committed:
            newest = committed[-1]
            estimate = newest.nbytes if store.backend.persistent else newest.stored_bytes
            budget = store._budget()
            if budget.available is not None and estimate > budget.available:
                removed = store.prune(keep=0)
                log.info("budget has no room for two generations: removed %d old one(s) before writing %d",
                         len(removed), generation)
        try:
            writer = store.writer(generation, num_samples=len(self._indices))
        except StoreLockedError as exc:
            raise StoreLockedError(f"{exc}. Another loader with the same cache prefix is writing it; "
                                   "give each run its own prefix or wait for it") from None
        self._res.writer = writer
        if self._res.pool is not None:
            self._res.pool.reset_generation()
        in_workers = store.backend.supports_multiprocess_write and not self.use_threading
        in_workers = in_workers or (self.use_threading and store.backend.persistent)
        return GenerationSink(writer, self.cache.on_budget_exceeded, in_workers)

    def _run_epoch(self, epoch: int) -> Iterator[Any]:
        start = time.perf_counter()
        plan = self._plan(epoch)
        stats = EpochStats(epoch, plan.mode, plan.generation)
        stats.wait_seconds = time.perf_counter() - start  # finishing a background refresh, if any
        self.epoch_stats.append(stats)
        if self._res.pool is not None:
            self._res.pool.restarts = 0  # max_worker_restarts counts per epoch
        sink = self._begin_generation(plan.generation) if plan.mode == "generate" else None
        store = self._res.store
        finished = False
        t0 = start
        try:
            if plan.mode == "rotate":
                batches = self._rotation_batches(plan, stats)
            elif self.nb_worker == 0 or (plan.mode == "read" and not store.backend.persistent):
                reader = store.reader(plan.generation) if plan.mode == "read" else None
                batches = run_inline(plan, self._producer, reader, sink, stats)
            else:
                reader_key = (store._args(), plan.generation) if plan.mode == "read" else None
                if plan.mode == "read":
                    self._maybe_start_refresh(plan)
                # Reading a batch takes milliseconds: a deep queue would only hold memory.
                depth = self.max_queue_size if plan.mode != "read" else min(self.max_queue_size,
                                                                           READ_AHEAD_PER_WORKER * self.nb_worker + 2)
                batches = run_pool(plan, self._ensure_pool(), self._res.slots, sink, reader_key,
                                   depth, self.max_minibatch_length, stats,
                                   self.prefetch_time if epoch == 0 else None, self._kill_pool,
                                   background=self._refresh)
            for batch in batches:
                wait = time.perf_counter()
                yield self._mover(batch) if self._mover is not None else batch
                t0 += time.perf_counter() - wait  # time spent in the training loop is not ours
            if sink is not None:
                self._finish_generation(plan, sink, stats)
            finished = True
        finally:
            stats.seconds = time.perf_counter() - t0
            if not finished and self._res.writer is not None:
                writer, self._res.writer = self._res.writer, None
                writer.abort()  # a broken-off or failed epoch commits nothing

    def _rotation_batches(self, plan: EpochPlan, stats: EpochStats) -> Iterator[Any]:
        rng = np.random.default_rng([self.seed, plan.epoch, 2])
        schedule = rotation_schedule(len(plan.indices), self.rotation.rotation, self._res.window.slots,
                                     self.batch_size, self.drop_last, rng)
        self._res.window.reset()
        if self.nb_worker == 0:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                for indices in arrays:
                    yield [self.dataset[int(i)] for i in indices]
        else:
            def fresh(arrays: Iterator[np.ndarray]) -> Iterator[list]:
                compute = EpochPlan(plan.epoch, "compute", None, arrays, np.arange(self.num_samples))
                return run_pool(compute, self._ensure_pool(), self._res.slots, None, None, self.max_queue_size,
                                self.max_minibatch_length, stats, None, self._kill_pool, collate=False)
        return run_rotation(schedule, plan.indices, self._res.window, fresh, self.collate_fn or stack_samples,
                            stats, rng)

    def _finish_generation(self, plan: EpochPlan, sink: GenerationSink, stats: EpochStats) -> None:
        writer, self._res.writer = self._res.writer, None
        pool = self._res.pool
        errors = pool.flush_shards() if pool is not None and sink.in_workers and self.nb_worker > 0 else []
        sink.close_main()
        if sink.failed is not None or errors:
            writer.abort()
            if errors and sink.failed is None:
                raise RuntimeError(f"workers could not finish generation {plan.generation}: {'; '.join(errors)}")
            self._cache_off = True
            if self.cache.on_budget_exceeded == "rotate":
                self._switch_to_rotation(sink.fits)
            return
        info = writer.commit(extra={"epochs": [plan.epoch], "update_frequency": self.cache.update_frequency
                                    if self.cache.update_frequency != math.inf else None})
        stats.committed = True
        removed = self._res.store.prune(keep=1)
        log.info("committed generation %d (%d samples, %d bytes); pruned %d old item(s)",
                 info.id, info.num_samples, info.nbytes, len(removed))

    def _kill_pool(self) -> None:
        """After a worker error: stop the workers now; the next epoch starts new ones."""
        pool, self._res.pool = self._res.pool, None
        if pool is not None:
            pool.kill()
        for writer in (self._res.writer, self._res.background):
            if writer is not None:
                writer.abort()
        self._res.writer = self._res.background = None
        self._refresh = None

    # ------------------------------------------------------------------ background refresh
    def _maybe_start_refresh(self, plan: EpochPlan) -> None:
        """At a read epoch of generation g, start computing g + 1 in the background (opt-in)."""
        cache, store = self.cache, self._res.store
        if (not cache.background_refresh or self._refresh is not None or self._refresh_off
                or cache.update_frequency == math.inf or not store.backend.persistent):
            return
        generations = {g.id: g for g in store.generations() if g.committed}
        nxt = plan.generation + 1
        if nxt in generations:
            return
        budget = store._budget()
        current = generations.get(plan.generation)
        if budget.available is not None and current is not None and current.nbytes > budget.available:
            log.info("background refresh needs room for a second generation (about %d bytes, %d available): "
                     "generation %d will be written during its own epoch instead", current.nbytes,
                     budget.available, nxt)
            self._refresh_off = True
            return
        writer = store.writer(nxt, num_samples=len(self._indices))
        self._res.background = writer
        self._ensure_pool().reset_generation()
        sink = GenerationSink(writer, "stream", not self.use_threading)
        self._refresh = BackgroundRefresh(nxt, sink, self._indices, max(1, self.batch_size // 8), self.nb_worker)

    def _complete_refresh(self, epoch: int) -> bool:
        """The first epoch of the refreshed generation: finish, commit; ``False`` to write it the usual way."""
        refresh, self._refresh = self._refresh, None
        writer, self._res.background = self._res.background, None
        pool = self._ensure_pool()
        try:
            refresh.finish(pool)
            errors = pool.flush_shards() if refresh.sink.in_workers else []
            refresh.sink.close_main()
            if refresh.sink.failed is not None or errors:
                writer.abort()
                self._refresh_off = True
                log.warning("background refresh of generation %d gave up (%s); writing it during epoch %d "
                            "instead", refresh.generation, refresh.sink.failed or "; ".join(errors), epoch)
                return False
            writer.commit(extra={"epochs": [epoch], "background": True,
                                 "update_frequency": self.cache.update_frequency})
        except BaseException:
            writer.abort()
            self._kill_pool()
            raise
        self._res.store.prune(keep=1)
        log.info("committed generation %d, computed in the background", refresh.generation)
        return True

    # ------------------------------------------------------------------ info & shutdown
    @property
    def store(self) -> Store | None:
        """The cache store (``None`` without ``cache_setting``)."""
        return self._res.store

    def worker_pids(self) -> list[int]:
        """Pids of the worker processes (empty for ``nb_worker=0`` or threads)."""
        pool = self._res.pool
        return [] if pool is None or self.use_threading else pool.pids()

    def close(self) -> None:
        """Stop workers, release shared memory, abort an unfinished generation (idempotent)."""
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
