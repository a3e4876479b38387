"""The loader's settings: parsed and validated once, then frozen.

:class:`CacheSettings` and :class:`RotationSettings` are what ``cache_setting``
and ``rotation_setting`` become; either may be given as such an object or as
a dict of the same keys. :class:`LoaderSettings` holds every constructor
argument, aliases resolved and defaults filled in (:mod:`loader.arguments`
builds it). None of them changes after the loader is built: what changes
while it runs (a loaded seed, a rotation fallback) is the runner's state.

Every error names the argument or key at fault. Modes and policies are
string enums, so ``stats.mode == "read"`` keeps working for callers.
"""

from __future__ import annotations

import enum
import math
import os
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Callable, Iterable, Sequence, Union

from cachestore.backends import available_backends
from cachestore.guard.trust import Trust
from cachestore.space.disk import parse_size

from .checks import check_choice, check_int, check_keys
from .dataset import BatchFn, CollateFn, DatasetSource, ReadTransform

if TYPE_CHECKING:
    import torch


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
    """What one epoch (or one task) does; see :class:`loader.epochs.plan.EpochPlan`."""

    COMPUTE = "compute"  # samples from the dataset only
    GENERATE = "generate"  # from the dataset, written into a generation
    READ = "read"  # gathered from a committed generation
    ROTATE = "rotate"  # through a rotation window


#: The values each boolean key of ``cache_setting`` accepts: the one place to widen
#: (e.g. ``background_refresh`` taking ``"auto"``). Strings like ``"no"`` or ``"False"``
#: are refused rather than read as true, which is what ``bool()`` would make of them.
BOOL_VALUES: dict[str, tuple[object, ...]] = {"verify": (True, False), "allow_pickle": (True, False),
                                              "background_refresh": ("auto", True, False),
                                              "shared": (True, False), "remote_required": (True, False)}
#: ``cache_setting["scope"]``: one store per node, shared by its ranks, or one per rank.
SCOPES: tuple[object, ...] = ("node", "rank")
#: ``cache_setting["read_order"]``: a full shuffle, blocks of consecutive records, or the one that fits.
READ_ORDERS: tuple[object, ...] = ("auto", "random", "block")
#: Default window of the memory rotation medium, in samples (see RotationSettings).
DEFAULT_MEMORY_WINDOW = 1024


def _set(obj: object, name: str, value: object) -> None:
    object.__setattr__(obj, name, value)  # normalising a frozen dataclass in __post_init__


def _path(value: object, what: str) -> str:
    if not isinstance(value, (str, os.PathLike)) or not os.fspath(value):
        raise ValueError(what)
    # "~/cache" means the home directory, as for every tool that takes a path.
    return os.path.expanduser(os.fspath(value))


@dataclass(frozen=True)
class CacheSettings:
    """``cache_setting``, validated.

    ``prefix`` (required) is the store directory (``~`` expands);
    ``update_frequency`` K is an int >= 2 or ``math.inf`` (default:
    ``math.inf``, computed once and reused); ``backend`` ``"memmap"``
    (default), ``"lmdb"`` or ``"memory"``; ``compression`` ``None`` or
    ``"zstd"``; ``disk_budget`` bytes or ``"20GB"``; ``on_budget_exceeded``
    ``"error"`` (default), ``"stream"`` or ``"rotate"``; ``verify`` checks
    record checksums on read (default ``True``); ``allow_pickle`` stores
    otherwise unsupported sample types with pickle, and loads them from the
    cache (which runs code of whoever wrote it: only for a cache you trust;
    without it such a cached sample is ``PickleRefusedError``); ``background_refresh``
    computes the next generation with idle workers during the cached epochs
    before it: ``"auto"`` (default) whenever the budget has room for a second
    generation (else written during its own epoch, with one log line saying
    why), ``True`` insists (an error when it cannot), ``False`` writes each
    generation during its own epoch (see :mod:`loader.cache.refresh`);
    ``fingerprint`` a string that replaces the computed identity of the
    dataset for datasets whose identity the user knows better; ``on_mismatch``
    ``"error"`` (default) or ``"regenerate"`` (a store written by another
    dataset is emptied and written anew); ``read_order`` the order of cached
    epochs: ``"random"`` (a full shuffle), ``"block"`` (a shuffle of blocks of
    consecutive records, each read whole, mixed within windows of blocks: see
    :func:`loader.epochs.order.block_order`) or ``"auto"`` (default: random when
    the generation fits the memory room, block otherwise); ``shared``
    (default ``True``) has every process that writes a generation of the
    store (the ranks of a node, concurrent jobs with the same fingerprint)
    write it together, each sample computed once (``False``: one writer at a
    time, as a plain :meth:`cachestore.Store.writer`); ``scope`` ``"node"``
    (one store per node, ``prefix`` itself on one node, shared by its ranks,
    which split a new permutation of it every epoch) or ``"rank"`` (a store
    per rank under ``prefix/consumer-<i>-of-<n>``, each rank keeping its own
    part of the data); left out, ``"node"`` where the ranks can write one
    store together (a backend that supports it, ``shared=True``, no Ray
    actors) and their datasets are the same, else ``"rank"``
    (:mod:`loader.cache.scope`). ``remote`` (``"s3://bucket/path"`` or
    ``"file:///shared/path"``) publishes every committed generation there and
    fetches one instead of computing it; with several nodes (``nb_node``,
    ``node_rank``: torchrun's ``WORLD_SIZE // LOCAL_WORLD_SIZE`` and
    ``GROUP_RANK`` by default) node k computes only its part, and every node's
    store (``prefix`` itself) holds the whole generation. ``storage_options``
    (endpoint, credentials; never shown), ``remote_required`` (an unreachable
    remote is an error within ``start_timeout`` seconds, else a warning),
    ``part_timeout`` (seconds before the other nodes compute a part nobody
    published): :mod:`loader.cache.remote`.
    For a stream (an iterable dataset):
    ``stream_buffer`` the shuffle buffer, in samples, its generate epochs serve
    through with ``shuffle=True`` (default 1000, as webdataset's usual
    ``shuffle(1000)``: a few batches mixed for as little memory as a thousand
    samples take; later epochs are global permutations of the cache, and 0
    serves the generate epoch in arrival order); ``stream_samples`` the first N
    samples of the stream make the generation (required for an endless stream). ``trusted_uids``,
    ``trusted_gids``, ``max_sample_bytes``: :func:`cachestore.open_store`'s (README, "Security").

    Examples
    --------
    >>> CacheSettings(prefix="cache/train", update_frequency=5).backend
    'memmap'
    """

    prefix: str
    update_frequency: float = math.inf
    backend: str = "memmap"
    compression: str | None = None
    disk_budget: int | str | None = None
    on_budget_exceeded: BudgetPolicy | str = BudgetPolicy.ERROR
    verify: bool = True
    allow_pickle: bool = False
    background_refresh: bool | str = "auto"
    fingerprint: str | None = None
    on_mismatch: MismatchPolicy | str = MismatchPolicy.ERROR
    read_order: str = "auto"
    shared: bool = True
    scope: str | None = None  # decided at construction (loader.cache.scope): "node" where a node's ranks can share
    remote: str | None = None
    storage_options: dict[str, object] | None = field(default=None, repr=False, compare=False)
    remote_required: bool = False
    start_timeout: float = 10.0
    part_timeout: float = 600.0
    nb_node: int | None = None
    node_rank: int | None = None
    stream_buffer: int = 1000
    stream_samples: int | None = None
    trusted_uids: tuple[int, ...] = ()  # other users (and groups) whose generations are served (cachestore.guard.trust)
    trusted_gids: tuple[int, ...] = ()
    max_sample_bytes: int | str | None = None

    def __post_init__(self) -> None:
        try:
            trust = Trust.of(self.trusted_uids, self.trusted_gids)
            _set(self, "max_sample_bytes", parse_size(self.max_sample_bytes))
        except (TypeError, ValueError) as exc:
            raise ValueError(f"cache_setting: {exc}") from None
        _set(self, "trusted_uids", tuple(sorted(trust.uids)))
        _set(self, "trusted_gids", tuple(sorted(trust.gids)))
        _set(self, "prefix", _path(self.prefix, "cache_setting['prefix'] is required: the directory of the cache, "
                                                "e.g. 'cache/train'"))
        k = self.update_frequency
        if k != math.inf and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise ValueError(f"cache_setting['update_frequency'] must be an int >= 2 or math.inf, got {k!r} "
                             "(1 would rewrite the cache every epoch: use no cache_setting instead)")
        if self.backend not in available_backends():
            raise ValueError(f"cache_setting['backend'] {self.backend!r} is unknown; "
                             f"available: {', '.join(available_backends())}")
        if self.compression not in (None, "zstd"):
            raise ValueError(f"cache_setting['compression'] must be None or 'zstd', got {self.compression!r}")
        try:
            _set(self, "disk_budget", parse_size(self.disk_budget))
        except ValueError as exc:
            raise ValueError(f"cache_setting['disk_budget']: {exc}") from None
        if self.on_budget_exceeded not in tuple(BudgetPolicy):
            raise ValueError(f"cache_setting['on_budget_exceeded'] must be one of "
                             f"{tuple(p.value for p in BudgetPolicy)}, got {self.on_budget_exceeded!r}")
        _set(self, "on_budget_exceeded", BudgetPolicy(self.on_budget_exceeded))
        if self.fingerprint is not None and (not isinstance(self.fingerprint, str) or not self.fingerprint):
            raise ValueError(f"cache_setting['fingerprint'] must be a non-empty string naming the data, "
                             f"got {self.fingerprint!r}")
        if self.on_mismatch not in tuple(MismatchPolicy):
            raise ValueError(f"cache_setting['on_mismatch'] must be 'error' or 'regenerate', got {self.on_mismatch!r}")
        _set(self, "on_mismatch", MismatchPolicy(self.on_mismatch))
        for key, allowed in BOOL_VALUES.items():
            check_choice("cache_setting", key, getattr(self, key), allowed)
        check_choice("cache_setting", "read_order", self.read_order, READ_ORDERS)
        if self.scope is not None:
            check_choice("cache_setting", "scope", self.scope, SCOPES)
        if self.remote is not None or self.nb_node is not None or self.node_rank is not None:
            from .remote_setting import check_remote_settings

            check_remote_settings(self)
        if isinstance(self.stream_buffer, bool) or not isinstance(self.stream_buffer, int) or self.stream_buffer < 0:
            raise ValueError(f"cache_setting['stream_buffer'] must be a number of samples >= 0, "
                             f"got {self.stream_buffer!r}")
        n = self.stream_samples
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"cache_setting['stream_samples'] must be a number of samples >= 1 or None, got {n!r}")

    @classmethod
    def parse(cls, setting: object) -> CacheSettings:
        """`setting` as a :class:`CacheSettings`: the object itself, or one made from a dict of its keys."""
        if isinstance(setting, cls):
            return setting
        given = check_keys("cache_setting", setting, {f.name for f in fields(cls)})
        if "prefix" not in given:
            raise ValueError("cache_setting['prefix'] is required: the directory of the cache, e.g. 'cache/train'")
        return cls(**given)  # type: ignore[arg-type]  # each value is checked in __post_init__

    @property
    def policy(self) -> BudgetPolicy:
        """``on_budget_exceeded`` as the enum."""
        return BudgetPolicy(self.on_budget_exceeded)

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
    """``rotation_setting``, validated.

    ``medium`` ``"memory"`` (default) or ``"disk"``; ``rotation`` R >= 2
    (times each generated sample is served); ``size`` S >= 1 samples in the
    window (required for disk; for memory the default is
    ``max(1024, 4 * batch_size)``, at most N); ``prefix`` the directory of
    the disk window (required for disk); ``allow_pickle`` lets a disk window
    keep samples of types the codec stores only with pickle (``False``: reading a slot
    back never runs code, whoever wrote the file).

    Examples
    --------
    >>> RotationSettings(rotation=4).window(10_000, batch_size=64)
    1024
    """

    medium: str = "memory"
    rotation: int = 0
    size: int | None = None
    prefix: str | None = None
    stream_samples: int | None = None  # a stream's samples per epoch (default: its len())
    allow_pickle: bool = False  # a disk window's slots may hold pickles (read back: runs their code)

    def __post_init__(self) -> None:
        n = self.stream_samples
        if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 1):
            raise ValueError(f"rotation_setting['stream_samples'] must be a number of samples >= 1 or None, got {n!r}")
        if self.allow_pickle not in (True, False):
            raise ValueError(f"rotation_setting['allow_pickle'] must be True or False, got {self.allow_pickle!r}")
        if self.medium not in ("memory", "disk"):
            raise ValueError(f"rotation_setting['medium'] must be 'memory' or 'disk', got {self.medium!r}")
        check_int("rotation_setting['rotation']", self.rotation, 2)
        check_int("rotation_setting['size']", self.size, 1, allow_none=True)
        if self.medium == "disk":
            if self.size is None:
                raise ValueError("rotation_setting['size'] is required for medium 'disk' (samples in the window)")
            _set(self, "prefix", _path(self.prefix, "rotation_setting['prefix'] is required for medium 'disk' "
                                                    "(its directory)"))
        elif self.prefix is not None:
            _set(self, "prefix", os.path.expanduser(os.fspath(self.prefix)))

    @classmethod
    def parse(cls, setting: object) -> RotationSettings:
        """`setting` as a :class:`RotationSettings`: the object itself, or one made from a dict of its keys."""
        if isinstance(setting, cls):
            return setting
        given = check_keys("rotation_setting", setting, {f.name for f in fields(cls)})
        if "rotation" not in given:
            raise ValueError("rotation_setting['rotation'] must be an int >= 2, got None")
        return cls(**given)  # type: ignore[arg-type]  # each value is checked in __post_init__

    def window(self, n: int, batch_size: int) -> int:
        """Samples the window holds for a dataset of `n` samples.

        The memory medium's default is ``max(1024, 4 * batch_size)``: large
        enough that a sample's repeats land batches apart, small enough to stay
        well inside RAM for the sample sizes that need rotation.
        """
        size = self.size if self.size is not None else max(DEFAULT_MEMORY_WINDOW, 4 * batch_size)
        return max(1, min(size, n))


#: Where batches go: a ``torch.device``, or its name (``"cuda"``, ``"cuda:1"``, ``"cpu"``), or ``None`` (stay numpy).
Device = Union[str, "torch.device", None]


@dataclass(frozen=True)
class Sampling:
    """torch's ``sampler`` or ``batch_sampler``: the user's own order, drawn anew every epoch.

    With `keys` (``batch_size=None``), a sampler may yield lists of indices instead of indices: each
    list is then handed to ``dataset[...]`` whole, once, and its result served as it is (torch's
    loading without auto-collation)."""

    sampler: Iterable[int] | None = None
    batch_sampler: Iterable[Sequence[int]] | None = None
    keys: bool = False

    @property
    def source(self) -> object:
        return self.batch_sampler if self.batch_sampler is not None else self.sampler

    @property
    def name(self) -> str:
        return "batch_sampler" if self.batch_sampler is not None else "sampler"


@dataclass(frozen=True)
class RayOptions:
    """``executor_options`` of ``executor="ray"``, defaults filled in (see :mod:`loader.executors.ray_options`)."""

    address: str | None
    num_workers: int
    actor_options: dict[str, object]
    init_options: dict[str, object]
    start_timeout: float


@dataclass(frozen=True)
class LoaderSettings:
    """Every :class:`~loader.CachedLoader` argument, validated, aliases resolved, defaults filled in.

    Built by :func:`loader.arguments.parse_arguments`; frozen. A deferred
    :meth:`CachedLoader.start` builds the loader's final settings from these
    (:func:`dataclasses.replace`), before anything runs.
    """

    dataset: DatasetSource
    batch_size: int
    nb_worker: int
    shuffle: bool
    seed: int
    drop_last: bool
    nearby_shuffle: int
    collate_fn: CollateFn | None
    max_queue_size: int
    prefetch_time: float | None
    use_threading: bool
    device: object  # a Device; checked when the device mover is built
    pin_memory: bool
    gpu_indices: list[int] | None
    max_minibatch_length: int | None
    cache: CacheSettings | None
    rotation: RotationSettings | None
    nb_consumer: int
    consumer_index: int
    partition: str
    deferred_start: bool  # consumer_index comes later, from start()
    to_device: BatchFn | None
    start_method: str
    max_worker_restarts: int
    timeout: float | None = None
    progress: bool | None = None
    seed_given: bool = True  # False: the seed was drawn at random (a resumed run takes the state's)
    executor: str = "process"
    ray_options: RayOptions | None = None
    sampling: Sampling | None = None  # torch's sampler or batch_sampler
    worker_init_fn: Callable[[int], object] | None = None
    read_transform: ReadTransform | None = None
    #: Every rank serves ``n // ranks`` samples, the tail of each epoch's order unserved (a
    #: ``DistributedSampler(drop_last=True)``); else ``ceil(n / ranks)`` at most.
    even_ranks: bool = False
    #: torch's ``in_order``: ``False`` serves a batch computed on workers as soon as it is done.
    in_order: bool = True

    @property
    def deals_in_turn(self) -> bool:
        """Whether batches go to the workers in turn, whole (batch ``i`` of an epoch to worker ``i mod N``), as
        torch deals them: with a ``worker_init_fn``, which makes each worker one of its own (a handle, a
        shard of files, its id in the samples) that code written for torch may count on. Otherwise a batch
        goes to the least loaded worker and an epoch's first and last batches are split between the
        workers (the first comes sooner: ``docs/ARCHITECTURE.md``, "The path of a batch"). Ray actors
        always take the least loaded. A dataset whose draws are seeded per batch (:attr:`seeds_draws`) is
        dealt in turn too: a batch split between workers would draw other numbers."""
        return self.worker_init_fn is not None or self.seeds_draws

    @property
    def seeds_draws(self) -> bool:
        """Whether each batch's random draws are seeded from ``(seed, epoch, indices)``
        (:mod:`loader.executors.seeds`): a map-style dataset whose randomness is part of its state, as
        torchdata's ``Stateful`` says (``state_dict`` and ``load_state_dict``). Its batches then draw the
        same numbers in any worker and after a resume."""
        d = self.dataset
        target = d.instance if d.instance is not None else d.dataset_class
        return not d.stream and all(callable(getattr(target, name, None)) for name in ("state_dict", "load_state_dict"))

    @property
    def allow_pickle(self) -> bool:
        """Whether samples that need pickle may travel and be stored (a cache setting)."""
        return self.cache.allow_pickle if self.cache is not None else False
