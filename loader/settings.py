"""The loader's settings, validated once: constructor arguments, ``cache_setting``, ``rotation_setting``.

Every error names the argument or key at fault. Modes and policies are
string enums, so ``stats.mode == "read"`` keeps working for callers.
"""

from __future__ import annotations

import enum
import math
import os
import sys
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from cachestore.backends import available_backends
from cachestore.disk import parse_size


class _StrEnum(str, enum.Enum):
    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class BudgetPolicy(_StrEnum):
    """``cache_setting["on_budget_exceeded"]``: what a generation that does not fit does."""

    ERROR = "error"  # raise BudgetExceededError
    STREAM = "stream"  # stop caching, keep serving computed samples
    ROTATE = "rotate"  # switch to a disk rotation window that fits


class MismatchPolicy(_StrEnum):
    """``cache_setting["on_mismatch"]``: what a store written by another dataset does."""

    ERROR = "error"  # raise FingerprintMismatchError, saying what differs
    REGENERATE = "regenerate"  # remove the old generations, write new ones


class EpochMode(_StrEnum):
    """What one epoch (or one task) does; see :class:`loader.epoch.EpochPlan`."""

    COMPUTE = "compute"  # samples from the dataset only
    GENERATE = "generate"  # from the dataset, written into a generation
    READ = "read"  # gathered from a committed generation
    ROTATE = "rotate"  # through a rotation window


BUDGET_POLICIES = tuple(p.value for p in BudgetPolicy)
#: The values each boolean key of ``cache_setting`` accepts: the one place to widen
#: (e.g. ``background_refresh`` taking ``"auto"``). Strings like ``"no"`` or ``"False"``
#: are refused rather than read as true, which is what ``bool()`` would make of them.
BOOL_VALUES: dict[str, tuple] = {"verify": (True, False), "allow_pickle": (True, False),
                                 "background_refresh": ("auto", True, False)}
#: Default window of the memory rotation medium, in samples (see RotationSettings).
DEFAULT_MEMORY_WINDOW = 1024


def _check_choice(name: str, key: str, value: Any, allowed: tuple) -> Any:
    """`value` if it is one of `allowed` (compared by identity for booleans), else a ValueError naming `key`."""
    # Identity for bools and None: 1 == True and 0 == False, and an int is not a boolean setting.
    if any(value is a if isinstance(a, bool) or a is None else (type(value) is type(a) and value == a)
           for a in allowed):
        return value
    raise ValueError(f"{name}[{key!r}] must be one of {', '.join(map(repr, allowed))}, "
                     f"got {value!r} ({type(value).__name__})")


def _check_keys(name: str, given: dict, allowed: set[str]) -> None:
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class CacheSettings:
    """Parsed ``cache_setting``.

    ``prefix`` (required) is the store directory; ``update_frequency`` K is an
    int >= 2 or ``math.inf`` (default: ``math.inf``, computed once and reused);
    ``backend`` ``"memmap"`` (default), ``"lmdb"`` or ``"memory"``;
    ``compression`` ``None`` or ``"zstd"``; ``disk_budget`` bytes or ``"20GB"``;
    ``on_budget_exceeded`` ``"error"`` (default), ``"stream"`` or ``"rotate"``;
    ``verify`` checks record checksums on read (default ``True``);
    ``allow_pickle`` stores otherwise unsupported sample types with pickle;
    ``background_refresh`` computes the next generation with idle workers during
    the cached epochs before it: ``"auto"`` (default) whenever the budget has
    room for a second generation (else written during its own epoch, with one
    log line saying why), ``True`` insists (an error when it cannot), ``False``
    writes each generation during its own epoch (see :mod:`loader.refresh`);
    ``fingerprint`` a string that replaces the computed identity of the
    dataset (class, parameters, source) for datasets whose identity the user
    knows better; ``on_mismatch`` ``"error"`` (default) or ``"regenerate"``
    (a store written by another dataset is emptied and written anew).
    """

    prefix: str
    update_frequency: float
    backend: str = "memmap"
    compression: str | None = None
    disk_budget: int | None = None
    on_budget_exceeded: BudgetPolicy = BudgetPolicy.ERROR
    verify: bool = True
    allow_pickle: bool = False
    background_refresh: bool | str = "auto"
    fingerprint: str | None = None
    on_mismatch: MismatchPolicy = MismatchPolicy.ERROR

    KEYS = frozenset({"prefix", "update_frequency", "backend", "compression", "disk_budget",
                      "on_budget_exceeded", "verify", "allow_pickle", "background_refresh", "fingerprint",
                      "on_mismatch"})

    @classmethod
    def parse(cls, setting: dict) -> "CacheSettings":
        _check_keys("cache_setting", setting, set(cls.KEYS))
        prefix = setting.get("prefix")
        if not isinstance(prefix, (str, os.PathLike)) or not str(prefix):
            raise ValueError("cache_setting['prefix'] is required: the directory of the cache, e.g. 'cache/train'")
        k = setting.get("update_frequency", math.inf)
        if k != math.inf and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise ValueError(f"cache_setting['update_frequency'] must be an int >= 2 or math.inf, got {k!r} "
                             "(1 would rewrite the cache every epoch: use no cache_setting instead)")
        backend = setting.get("backend", "memmap")
        if backend not in available_backends():
            raise ValueError(f"cache_setting['backend'] {backend!r} is unknown; "
                             f"available: {', '.join(available_backends())}")
        compression = setting.get("compression")
        if compression not in (None, "zstd"):
            raise ValueError(f"cache_setting['compression'] must be None or 'zstd', got {compression!r}")
        try:
            budget = parse_size(setting.get("disk_budget"))
        except ValueError as exc:
            raise ValueError(f"cache_setting['disk_budget']: {exc}") from None
        policy = setting.get("on_budget_exceeded", "error")
        if policy not in BUDGET_POLICIES:
            raise ValueError(f"cache_setting['on_budget_exceeded'] must be one of {BUDGET_POLICIES}, got {policy!r}")
        fingerprint = setting.get("fingerprint")
        if fingerprint is not None and (not isinstance(fingerprint, str) or not fingerprint):
            raise ValueError(f"cache_setting['fingerprint'] must be a non-empty string naming the data, "
                             f"got {fingerprint!r}")
        on_mismatch = setting.get("on_mismatch", "error")
        if on_mismatch not in tuple(MismatchPolicy):
            raise ValueError(f"cache_setting['on_mismatch'] must be 'error' or 'regenerate', got {on_mismatch!r}")
        flags = {key: _check_choice("cache_setting", key, setting.get(key, getattr(cls, key)), allowed)
                 for key, allowed in BOOL_VALUES.items()}
        return cls(str(prefix), k, backend, compression, budget, BudgetPolicy(policy), fingerprint=fingerprint,
                   on_mismatch=MismatchPolicy(on_mismatch), **flags)


    @property
    def rewrites(self) -> bool:
        """Whether generations are rewritten every K epochs (``False`` for ``math.inf``)."""
        return self.update_frequency != math.inf

    def generation_offset(self, epoch: int) -> int:
        """Generations after the first that epoch `epoch` of a run uses (``epoch // K``)."""
        return epoch // int(self.update_frequency) if self.rewrites else 0

    @property
    def k_or_none(self) -> int | None:
        """K as recorded in manifests and the producer (``None`` for "never rewrite")."""
        return int(self.update_frequency) if self.rewrites else None


@dataclass(frozen=True)
class RotationSettings:
    """Parsed ``rotation_setting``.

    ``medium`` ``"memory"`` or ``"disk"``; ``rotation`` R >= 2 (times each
    generated sample is served); ``size`` S >= 1 samples in the window
    (required for disk; for memory the default is ``max(1024, 4 * batch_size)``,
    at most N); ``prefix``
    the directory of the disk window (required for disk).
    """

    medium: str
    rotation: int
    size: int | None
    prefix: str | None

    KEYS = frozenset({"medium", "rotation", "size", "prefix"})

    @classmethod
    def parse(cls, setting: dict) -> "RotationSettings":
        _check_keys("rotation_setting", setting, set(cls.KEYS))
        medium = setting.get("medium", "memory")
        if medium not in ("memory", "disk"):
            raise ValueError(f"rotation_setting['medium'] must be 'memory' or 'disk', got {medium!r}")
        rotation = setting.get("rotation")
        if isinstance(rotation, bool) or not isinstance(rotation, int) or rotation < 2:
            raise ValueError(f"rotation_setting['rotation'] must be an int >= 2, got {rotation!r}")
        size = setting.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"rotation_setting['size'] must be an int >= 1, got {size!r}")
        prefix = setting.get("prefix")
        if medium == "disk":
            if size is None:
                raise ValueError("rotation_setting['size'] is required for medium 'disk' (samples in the window)")
            if not isinstance(prefix, (str, os.PathLike)) or not str(prefix):
                raise ValueError("rotation_setting['prefix'] is required for medium 'disk' (its directory)")
        return cls(medium, rotation, size, str(prefix) if prefix is not None else None)

    def window(self, n: int, batch_size: int) -> int:
        """Samples the window holds for a dataset of `n` samples.

        The memory medium's default is ``max(1024, 4 * batch_size)``: large
        enough that a sample's repeats land batches apart, small enough to stay
        well inside RAM for the sample sizes that need rotation.
        """
        size = self.size if self.size is not None else max(DEFAULT_MEMORY_WINDOW, 4 * batch_size)
        return max(1, min(size, n))


#: Where tasks run: ``"process"`` (the worker pool: processes, or threads) or ``"ray"`` (Ray actors).
EXECUTORS = ("process", "ray")
#: Keys of ``executor_options`` (``executor="ray"``); see :func:`parse_executor`.
RAY_OPTION_KEYS = frozenset({"address", "num_workers", "actor_options", "init_options", "start_timeout"})
#: Actor options the Ray executor sets itself: it replaces dead actors (and counts them against
#: ``max_worker_restarts``), runs one task at a time per actor, and no actor may outlive the loader.
RESERVED_ACTOR_OPTIONS = frozenset({"max_restarts", "max_task_retries", "max_concurrency", "lifetime", "name",
                                    "namespace", "get_if_exists"})
#: Seconds a Ray actor may take to be placed and started before the loader says why it is not.
DEFAULT_START_TIMEOUT = 120.0


def parse_executor(executor: Any, options: Any, nb_worker: int | None, default_nb_worker: int, use_threading: bool,
                   gpu_indices: Any) -> tuple[dict, int]:
    """Validate ``executor`` and ``executor_options``; return the filled-in options and the worker count.

    ``executor_options`` (only with ``executor="ray"``): ``address`` (``None``:
    this process's Ray connection, else a Ray instance started for the loader;
    ``"auto"``, ``"HOST:PORT"`` or ``"ray://..."``: that cluster),
    ``num_workers`` (actors; default `nb_worker`), ``actor_options`` (passed to
    ``ActorClass.options``; default ``{"num_cpus": 1}``), ``init_options``
    (keyword arguments of ``ray.init``) and ``start_timeout`` (seconds an actor
    may take to be placed).

    Parameters
    ----------
    executor, options
        The constructor's ``executor`` and ``executor_options``.
    nb_worker
        The constructor's `nb_worker` (alias resolved), ``None`` when not given.
    default_nb_worker
        Workers when neither `nb_worker` nor ``num_workers`` is given.
    use_threading, gpu_indices
        The constructor's; neither applies to Ray actors.

    Returns
    -------
    tuple
        The options with every default filled in (``{}`` for ``"process"``),
        and the number of workers (processes, threads or actors).

    Raises
    ------
    ValueError
        Naming the argument or key at fault.
    """
    if executor not in EXECUTORS:
        raise ValueError(f"executor must be one of {EXECUTORS}, got {executor!r}")
    if executor == "process":
        if options:
            raise ValueError("executor_options apply to executor='ray' only; the process executor is set up by "
                             "nb_worker, use_threading and start_method")
        return {}, default_nb_worker if nb_worker is None else nb_worker
    options = {} if options is None else options
    _check_keys("executor_options", options, set(RAY_OPTION_KEYS))
    if use_threading:
        raise ValueError("use_threading=True means worker threads in this process; it cannot be combined with "
                         "executor='ray'")
    if gpu_indices is not None:
        raise ValueError("gpu_indices applies to worker processes; with executor='ray' ask Ray for GPUs: "
                         "executor_options={'actor_options': {'num_gpus': 1}}")
    address = options.get("address")
    if address is not None and (not isinstance(address, str) or not address):
        raise ValueError(f"executor_options['address'] must be 'auto', 'HOST:PORT' or 'ray://HOST:PORT', "
                         f"got {address!r}")
    num_workers = options.get("num_workers")
    if nb_worker == 0:
        raise ValueError("nb_worker=0 computes samples in this process; executor='ray' needs at least one actor "
                         "(executor_options['num_workers'])")
    if num_workers is None:
        num_workers = default_nb_worker if nb_worker is None else nb_worker
    elif nb_worker is not None and nb_worker != num_workers:
        raise ValueError(f"nb_worker={nb_worker} and executor_options['num_workers']={num_workers} disagree; "
                         "give one of them")
    check_int("executor_options['num_workers']", num_workers, 1)
    actor_options = options.get("actor_options", {})
    if not isinstance(actor_options, dict):
        raise ValueError(f"executor_options['actor_options'] must be a dict, got {type(actor_options).__name__}")
    reserved = sorted(RESERVED_ACTOR_OPTIONS & set(actor_options))
    if reserved:
        raise ValueError(f"executor_options['actor_options'] cannot set {', '.join(map(repr, reserved))}: the "
                         "loader replaces dead actors itself (max_worker_restarts) and terminates its actors "
                         "when it closes")
    resources = actor_options.get("resources", {})
    if not isinstance(resources, dict) or not all(isinstance(k, str) and isinstance(v, (int, float)) and v > 0
                                                  for k, v in resources.items()):
        raise ValueError("executor_options['actor_options']['resources'] must map resource names to positive "
                         f"amounts, e.g. {{'producer': 1}}; got {resources!r}")
    init_options = options.get("init_options", {})
    if not isinstance(init_options, dict):
        raise ValueError(f"executor_options['init_options'] must be a dict, got {type(init_options).__name__}")
    if "address" in init_options:
        raise ValueError("executor_options['init_options'] cannot hold 'address': give executor_options['address']")
    timeout = options.get("start_timeout", DEFAULT_START_TIMEOUT)
    if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or timeout <= 0:
        raise ValueError(f"executor_options['start_timeout'] must be a number of seconds > 0, got {timeout!r}")
    return {"address": address, "num_workers": num_workers, "actor_options": {"num_cpus": 1, **actor_options},
            "init_options": dict(init_options), "start_timeout": float(timeout)}, num_workers


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def refresh_impossible(cache: CacheSettings, nb_worker: int) -> str | None:
    """Why a background refresh can never run with these settings (``None`` when it can)."""
    from cachestore.backends import get_backend

    if not cache.rewrites:
        return "update_frequency is math.inf, so no generation is ever refreshed"
    if not get_backend(cache.backend).persistent:
        return f"the {cache.backend!r} backend lives in this process, where no idle worker can write it"
    if nb_worker == 0:
        return "nb_worker=0 leaves no worker to compute it"
    return None


def distributed_defaults() -> tuple[int, int]:
    """World size and rank when torch.distributed is initialised, else (1, 0)."""
    # Only a process that imported torch.distributed can have initialised it:
    # importing torch here would cost a second for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclass
class LoaderSettings:
    """Every :class:`~loader.CachedLoader` argument, validated, aliases resolved, defaults filled in.

    Mutable only where the deferred :meth:`CachedLoader.start` fills in the
    consumer and device, and where ``on_budget_exceeded="rotate"`` replaces
    the cache by a rotation window.
    """

    dataset_class: type
    dataset_params: dict
    batch_size: int
    nb_worker: int
    shuffle: bool
    seed: int
    drop_last: bool
    nearby_shuffle: int
    collate_fn: Callable | None
    max_queue_size: int
    prefetch_time: float | None
    use_threading: bool
    device: Any
    pin_memory: bool
    gpu_indices: list[int] | None
    max_minibatch_length: int | None
    cache: CacheSettings | None
    rotation: RotationSettings | None
    nb_consumer: int
    consumer_index: int
    deferred_start: bool  # consumer_index comes later, from start()
    to_device: Callable | None
    start_method: str
    max_worker_restarts: int
    timeout: float | None = None
    progress: bool | None = None
    seed_given: bool = True  # False: the seed was drawn at random (a resumed run takes the state's)
    executor: str = "process"
    executor_options: dict | None = None  # filled in by parse_executor

    @classmethod
    def from_arguments(cls, dataset_class: Any, dataset_params: dict | None, batch_size: Any, nb_worker: Any,
                       shuffle: bool, seed: Any, drop_last: bool, nearby_shuffle: Any, collate_fn: Any,
                       max_queue_size: Any, prefetch_time: Any, use_threading: bool, device: Any,
                       pin_memory: bool, gpu_indices: Any, max_minibatch_length: Any, cache_setting: Any,
                       rotation_setting: Any, *, dataset_kwargs: dict | None, worker_per_consumer: Any,
                       nb_consumer: Any, consumer_index: Any, to_device: Any, start_method: str,
                       max_worker_restarts: Any, timeout: Any = None, progress: Any = None,
                       executor: Any = "process", executor_options: Any = None) -> "LoaderSettings":
        """Validate the constructor's arguments (same names and meaning as there)."""
        if not isinstance(dataset_class, type):
            raise ValueError(f"dataset_class must be a class, got {dataset_class!r}")
        if dataset_params is not None and dataset_kwargs is not None:
            raise ValueError("give dataset_params or its alias dataset_kwargs, not both")
        params = dict(dataset_params if dataset_params is not None else (dataset_kwargs or {}))
        if nb_worker is not None and worker_per_consumer is not None:
            raise ValueError("give nb_worker or its alias worker_per_consumer, not both")
        nb_worker = worker_per_consumer if nb_worker is None else nb_worker
        executor_options, nb_worker = parse_executor(executor, executor_options, nb_worker,
                                                     min(4, os.cpu_count() or 1), use_threading, gpu_indices)
        check_int("batch_size", batch_size, 1)
        check_int("nb_worker", nb_worker, 0)
        check_int("nearby_shuffle", nearby_shuffle, 0)
        check_int("max_queue_size", max_queue_size, 1)
        check_int("max_minibatch_length", max_minibatch_length, 1, allow_none=True)
        check_int("max_worker_restarts", max_worker_restarts, 0)
        check_int("seed", seed, 0, allow_none=True)
        if prefetch_time is not None and (not isinstance(prefetch_time, (int, float)) or prefetch_time < 0):
            raise ValueError(f"prefetch_time must be a number of seconds >= 0, got {prefetch_time!r}")
        if timeout is not None and (isinstance(timeout, bool) or not isinstance(timeout, (int, float))
                                    or not timeout > 0):
            raise ValueError(f"timeout must be None (wait as long as it takes) or seconds > 0, got {timeout!r}")
        if progress is not None and not isinstance(progress, bool):
            raise ValueError(f"progress must be True, False or None (on when stderr is a terminal), got {progress!r}")
        if gpu_indices is not None:
            if not isinstance(gpu_indices, (list, tuple)) or len(gpu_indices) != max(nb_worker, 1):
                raise ValueError(f"gpu_indices must give one GPU index per worker ({max(nb_worker, 1)}), "
                                 f"got {gpu_indices!r}")
        if collate_fn is not None and not callable(collate_fn):
            raise ValueError("collate_fn must be callable")
        if start_method not in ("spawn", "fork"):
            # A forkserver's children are the server's, not the training process's: the parent-death
            # signal that takes workers down with a killed training process would watch the wrong one.
            raise ValueError(f"start_method must be 'spawn' (the default) or 'fork', got {start_method!r}")
        if to_device is not None and not callable(to_device):
            raise ValueError("to_device must be callable")
        cache = CacheSettings.parse(cache_setting) if cache_setting is not None else None
        if cache is not None and cache.background_refresh is True:
            why = refresh_impossible(cache, nb_worker)
            if why is not None:
                raise ValueError(f"cache_setting['background_refresh']=True cannot work here: {why}; "
                                 "use 'auto' (on when it can be) or False")
        rotation = RotationSettings.parse(rotation_setting) if rotation_setting is not None else None
        if cache is not None and rotation is not None:
            raise ValueError("cache_setting and rotation_setting cannot be combined: a cache keeps every sample, "
                             "rotation a window of them. Use cache_setting={..., 'on_budget_exceeded': 'rotate'} "
                             "to rotate only when the cache does not fit")
        default_nb, default_idx = distributed_defaults()
        consumers = default_nb if nb_consumer is None else nb_consumer
        check_int("nb_consumer", consumers, 1)
        deferred = consumer_index is None and nb_consumer is not None and consumers > 1
        index = default_idx if consumer_index is None else consumer_index
        check_int("consumer_index", index, 0)
        if index >= consumers:
            raise ValueError(f"consumer_index {index} must be < nb_consumer {consumers}")
        seed_given = seed is not None
        if seed is None:
            # Every rank must draw the same permutation: a random seed only for a single consumer.
            seed = int(np.random.SeedSequence().entropy % (2**63)) if consumers == 1 else 0
        return cls(dataset_class, params, batch_size, nb_worker, shuffle, seed, drop_last, nearby_shuffle,
                   collate_fn, max_queue_size, prefetch_time, use_threading, device, pin_memory,
                   list(gpu_indices) if gpu_indices is not None else None, max_minibatch_length, cache, rotation,
                   consumers, index, deferred, to_device, start_method, max_worker_restarts,
                   float(timeout) if timeout is not None else None, progress, seed_given, executor,
                   executor_options)

    @property
    def allow_pickle(self) -> bool:
        """Whether samples that need pickle may travel and be stored (a cache setting)."""
        return self.cache.allow_pickle if self.cache is not None else False
