"""The constructor's arguments: one table of aliases, one parser into frozen settings.

:class:`~loader.CachedLoader`'s signature is the one list of argument names;
the constructor hands each one by name to :class:`Arguments`, :data:`ALIASES`
adds the other names each argument goes by (the replaced loaders' and torch's),
and :func:`parse_arguments` validates them all once, naming the argument at
fault, into the frozen settings. ``loader.compat`` uses the same table.
"""

from __future__ import annotations

import dataclasses
import multiprocessing
import multiprocessing.context
import os
import secrets
import sys
import warnings
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from .cache.refresh import decide_refresh
from .datapipes import apply_shuffle, is_datapipe
from .dataset import DatasetSource, endless, is_stream
from .distributed import PARTITIONS, distributed_defaults
from .executors.ray_options import parse_executor
from .checks import check_int, int_at_least
from .settings import CacheSettings, LoaderSettings, RotationSettings, Sampling

#: Another name of an argument -> the argument (``dataset_server``'s and ``swift_loader``'s names).
ALIASES: dict[str, str] = {
    "dataset_class": "dataset",
    "dataset_kwargs": "dataset_params",
    "worker_per_consumer": "nb_worker",
    "num_workers": "nb_worker",  # torch.utils.data.DataLoader's
}
#: Start methods of worker processes (``multiprocessing_context`` takes those of ``multiprocessing``).
#: ``"auto"`` (the default): fork where it is safe, else spawn (:mod:`loader.executors.process.start`).
START_METHODS = ("auto", "fork", "spawn", "forkserver")
#: Batches in flight unless max_queue_size (or prefetch_factor) says otherwise.
DEFAULT_QUEUE = 20


class Unbatched:
    """The collate of ``batch_size=None``: each batch holds one sample, served as the sample itself, or as
    what `collate_fn` makes of it (torch applies ``collate_fn`` to each sample without auto-batching).
    A ``device`` turns its arrays into tensors, as torch's ``default_convert`` does."""

    def __init__(self, collate_fn: Callable[[Any], Any] | None = None) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: Sequence[Any]) -> Any:
        (sample,) = samples
        return sample if self.collate_fn is None else self.collate_fn(sample)


@dataclasses.dataclass(frozen=True)
class Arguments:
    """Every argument of :class:`~loader.CachedLoader`'s constructor, by its own name, as the caller gave
    it (unchecked: :func:`parse_arguments` checks each one). The fields are the constructor's
    parameters, in their order; the constructor hands each one on by name."""

    dataset: object
    dataset_params: object
    batch_size: object
    nb_worker: object
    shuffle: object
    sampler: object
    batch_sampler: object
    worker_init_fn: object
    generator: object
    persistent_workers: object
    prefetch_factor: object
    multiprocessing_context: object
    in_order: object
    seed: object
    drop_last: object
    nearby_shuffle: object
    collate_fn: object
    max_queue_size: object
    prefetch_time: object
    use_threading: object
    device: object
    pin_memory: object
    gpu_indices: object
    max_minibatch_length: object
    cache_setting: object
    rotation_setting: object
    nb_consumer: object
    consumer_index: object
    partition: object
    to_device: object
    start_method: object
    max_worker_restarts: object
    timeout: object
    progress: object
    executor: object
    executor_options: object
    read_transform: object


@dataclasses.dataclass(frozen=True)
class TorchChoices:
    """What torch's ``DataLoader`` arguments decide of the settings (checked as torch checks them);
    ``None``: they leave it to the loader's own argument."""

    shuffle: bool
    sampling: Sampling | None
    worker_init_fn: Callable[[int], object] | None = None
    nb_consumer: int | None = None  # a DistributedSampler's ranks, seed and shuffle are the loader's
    consumer_index: int | None = None
    seed: int | None = None  # a DistributedSampler's, or a generator's
    max_queue_size: int | None = None  # prefetch_factor x workers
    start_method: str | None = None  # multiprocessing_context's
    even_ranks: bool = False  # a DistributedSampler's drop_last


def resolve_aliases(arguments: Arguments, aliases: Mapping[str, object], owner: str) -> Arguments:
    """`arguments` with the values given under an alias (:data:`ALIASES`) moved to the argument's name.

    Raises
    ------
    TypeError
        A name that is neither an argument nor an alias, as Python says it for any function.
    ValueError
        An argument given under two names.
    """
    moved: dict[str, object] = {}
    for alias, value in aliases.items():
        name = ALIASES.get(alias)
        if name is None:
            raise TypeError(f"{owner}() got an unexpected keyword argument {alias!r}")
        if moved.get(name, getattr(arguments, name)) is not None:
            raise ValueError(f"give {name} or its alias {alias}, not both")
        moved[name] = value
    return dataclasses.replace(arguments, **moved)


def _seconds(name: str, value: object, what: str, zero: bool) -> float | None:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (value == 0 and not zero):
        raise ValueError(f"{name} must be {what}, got {value!r}")
    return float(value)


def _flag(name: str, value: object) -> bool:
    """`value` as a bool: ``True``, ``False`` (a numpy bool too); anything else is a ``ValueError``, in
    torch's words for ``drop_last``, since ``bool("False")`` is true."""
    if isinstance(value, (bool, np.bool_)):
        return bool(value)
    hint = ("; a string is true whatever it says: convert it first (e.g. value.lower() == 'true')"
            if isinstance(value, str) else "")
    raise ValueError(f"{name} should be a boolean value, but got {name}={value!r}{hint}")


def _drawn_seed() -> int:
    """A seed drawn from torch's global generator, as torch's ``RandomSampler`` draws one (so that
    ``torch.manual_seed`` decides the order); from the OS where torch is not imported."""
    torch = sys.modules.get("torch")
    if torch is None:
        return secrets.randbits(63)
    return int(torch.empty((), dtype=torch.int64).random_().item()) % 2**63


def _choice(name: str, value: object, allowed: tuple[str, ...]) -> str:
    if not isinstance(value, str) or value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(map(repr, allowed))}, got {value!r}")
    return value


def _callable(name: str, value: object) -> Callable[..., Any] | None:
    if value is not None and not callable(value):
        raise ValueError(f"{name} must be callable")
    return value


def _distributed_sampler(sampler: object) -> bool:
    """Whether `sampler` is torch's ``DistributedSampler`` (or a subclass), without importing torch."""
    return sampler is not None and any(klass.__name__ == "DistributedSampler" and klass.__module__.startswith(
        "torch.utils.data") for klass in type(sampler).__mro__)


def _start_method_of(context: object) -> str:
    """The start method of torch's `multiprocessing_context` (a name or a context), refused as torch refuses it."""
    if isinstance(context, str):
        valid = multiprocessing.get_all_start_methods()
        if context not in valid:
            raise ValueError(f"multiprocessing_context option should specify a valid start method in {valid!r}, "
                             f"but got multiprocessing_context={context!r}")
        return context
    if not isinstance(context, multiprocessing.context.BaseContext):
        raise TypeError("multiprocessing_context option should be a valid context object or a string specifying "
                        f"the start method, but got multiprocessing_context={context}")
    return context.get_start_method()


def _dataset_source(a: Arguments) -> DatasetSource:
    params = a.dataset_params
    if params is not None and not isinstance(params, dict):
        raise ValueError(f"dataset_params must be a dict of keyword arguments, got {type(params).__name__}")
    if a.dataset is None:
        raise TypeError("CachedLoader() needs a dataset: a map-style dataset instance, or its class (with "
                        "dataset_params)")
    dataset = a.dataset
    if a.shuffle is not None and is_datapipe(dataset) and not isinstance(dataset, type):
        # As torch's DataLoader: shuffle turns the datapipe's own shufflers on or off (loader.datapipes).
        dataset = apply_shuffle(dataset, _flag("shuffle", a.shuffle))
    return DatasetSource.of(dataset, params)


def _batching(a: Arguments) -> tuple[int, bool, Callable[..., Any] | None]:
    """``(batch_size, drop_last, collate_fn)``; ``batch_size=None`` (torch's: no auto-batching) makes
    batches of one sample, served as the sample (:class:`Unbatched`)."""
    drop_last, collate_fn = _flag("drop_last", a.drop_last), _callable("collate_fn", a.collate_fn)
    if a.batch_size is not None:
        return int_at_least("batch_size", a.batch_size, 1), drop_last, collate_fn
    if drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually exclusive with drop_last")
    return 1, drop_last, Unbatched(collate_fn)


def _refused_as_torch(a: Arguments) -> None:
    """torch's own ``ValueError`` s for what it refuses first: a negative ``num_workers`` or ``timeout``, and
    the arguments an iterable-style dataset cannot take (before the dataset itself is refused or
    taken), without importing torch."""
    for name, value in (("num_workers", a.nb_worker), ("timeout", a.timeout)):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value < 0:
            raise ValueError(f"{name} option should be non-negative" + (
                f"; use num_workers=0 to disable multiprocessing. (nb_worker={value})" if name == "num_workers"
                else f" (timeout={value})"))
    if not is_stream(a.dataset) or a.cache_setting is not None or a.rotation_setting is not None:
        return  # a stream with a cache or rotation is random-access from its second epoch: shuffle, samplers
    if a.shuffle not in (False, None) and not is_datapipe(a.dataset):  # torch's DataLoader drives its shufflers
        raise ValueError(f"DataLoader with IterableDataset: expected unspecified shuffle option, but got "
                         f"shuffle={a.shuffle}")
    for name, value in (("sampler", a.sampler), ("batch_sampler", a.batch_sampler)):
        if value is not None:
            raise ValueError(f"DataLoader with IterableDataset: expected unspecified {name} option, but got "
                             f"{name}={value}")


def _stream_checks(a: Arguments, cache: CacheSettings | None, rotation: RotationSettings | None) -> None:
    """What a stream (an iterable dataset) cannot take, refused before anything starts."""
    dataset = a.dataset
    if not is_stream(dataset):
        return
    unknown = endless(dataset) or not hasattr(dataset, "__len__")
    if rotation is not None and rotation.stream_samples is None and unknown:
        raise ValueError("rotation over a stream serves a number of its samples each epoch: give the stream a "
                         "__len__, or rotation_setting={..., 'stream_samples': N} (required for an endless stream)")
    consumers = a.nb_consumer if a.nb_consumer is not None else distributed_defaults()[0]
    if cache is not None and isinstance(consumers, int) and consumers > 1:
        # Each node's ranks write one generation of its store, meeting under torchrun's run id (stream_ranks).
        if not os.environ.get("TORCHELASTIC_RUN_ID"):
            raise ValueError(f"a cache of an iterable dataset with several consumers (nb_consumer={consumers}) is "
                             "written by the ranks of each node together, started by torchrun (they meet under its "
                             "run id): consumers given by hand are not supported. Without a cache each rank "
                             "iterates its own stream, as with torch's DataLoader")
    if cache is not None and cache.stream_samples is None and endless(dataset):
        raise ValueError("this stream never ends (webdataset's resampled=True, or a pipeline repeated for ever): "
                         "a cache needs to know where its generation ends. Give cache_setting={..., "
                         "'stream_samples': N}: the first N samples of the stream make the generation")


def _torch_arguments(a: Arguments, workers: int) -> TorchChoices:
    """torch's DataLoader arguments, checked as torch checks them (the same ``ValueError`` s for
    conflicting pairs, counting only what the caller passed), as our settings."""
    sampler, batch_sampler, shuffle = a.sampler, a.batch_sampler, a.shuffle
    if sampler is not None and shuffle:  # torch's order: this one first
        raise ValueError("sampler option is mutually exclusive with shuffle")
    if batch_sampler is not None and (a.batch_size != 1 or shuffle or sampler is not None or a.drop_last):
        raise ValueError("batch_sampler option is mutually exclusive with batch_size, shuffle, sampler, and drop_last")
    if shuffle is not None:  # after the conflicts: torch says those first, whatever shuffle's type
        shuffle = _flag("shuffle", shuffle)
    for name, given in (("sampler", sampler), ("batch_sampler", batch_sampler)):
        if given is None:
            continue
        if not hasattr(given, "__iter__"):
            raise ValueError(f"{name} must be an iterable of indices{'' if name == 'sampler' else ' lists'}, "
                             f"got {given!r}")
        if name == "batch_sampler" and _distributed_sampler(given):
            raise ValueError("batch_sampler is a DistributedSampler, which draws indices, not batches: pass it "
                             "as sampler=")
    if a.prefetch_factor is not None:
        if workers == 0:
            raise ValueError("prefetch_factor option could only be specified in multiprocessing.let num_workers "
                             "> 0 to enable multiprocessing, otherwise set prefetch_factor to None.")
        int_at_least("prefetch_factor", a.prefetch_factor, 1)
    # Its truth value, as torch takes it (workers persist anyway: it only says that there are workers).
    if a.persistent_workers and workers == 0:
        raise ValueError("persistent_workers option needs num_workers > 0")
    if a.multiprocessing_context is not None and workers == 0:
        raise ValueError("multiprocessing_context can only be used with multi-process loading (num_workers > 0), "
                         "but got num_workers=0")
    if a.prefetch_factor is not None and a.max_queue_size != DEFAULT_QUEUE:
        raise ValueError(f"give max_queue_size or prefetch_factor, not both (prefetch_factor={a.prefetch_factor} "
                         f"keeps prefetch_factor x num_workers batches in flight)")
    if _distributed_sampler(sampler):
        sampler_seed = int(getattr(sampler, "seed", 0))
        if a.seed is not None and a.seed != sampler_seed:
            raise ValueError(f"seed={a.seed} and the DistributedSampler's seed {sampler_seed} disagree: the "
                             "sampler's seed is the loader's; give one of them")
        if a.generator is not None:
            raise ValueError("a DistributedSampler's seed is the loader's: give no generator with it")
        # Its ranks, its seed, its shuffle become the loader's own: the node's ranks split a new
        # permutation of the data every epoch, as the sampler would (loader.distributed).
        out = TorchChoices(shuffle=bool(getattr(sampler, "shuffle", True)), sampling=None,
                           nb_consumer=int(getattr(sampler, "num_replicas")),
                           consumer_index=int(getattr(sampler, "rank")), seed=sampler_seed,
                           even_ranks=bool(getattr(sampler, "drop_last", False)))
    else:
        # A stream comes in its own order unless asked (as torch); shuffle=True shuffles its cached epochs.
        default = sampler is None and batch_sampler is None and not is_stream(a.dataset)
        out = TorchChoices(
            shuffle=shuffle if shuffle is not None else default,
            sampling=(Sampling(sampler, batch_sampler,  # type: ignore[arg-type]  # iterables, checked above
                               keys=a.batch_size is None and sampler is not None)
                      if sampler is not None or batch_sampler is not None else None))
    out = dataclasses.replace(out, worker_init_fn=_callable("worker_init_fn", a.worker_init_fn))
    if isinstance(a.prefetch_factor, int):
        out = dataclasses.replace(out, max_queue_size=a.prefetch_factor * max(workers, 1))
    generator = a.generator
    if generator is not None:
        if a.seed is not None:
            raise ValueError("give seed or generator, not both: the generator's seed is the loader's")
        initial_seed = getattr(generator, "initial_seed", None)
        if not callable(initial_seed):
            raise ValueError(f"generator must be a torch.Generator, got {generator!r}")
        out = dataclasses.replace(out, seed=int(initial_seed()) % 2**63)
    context = a.multiprocessing_context
    if context is not None:
        method = _start_method_of(context)
        if method not in START_METHODS[1:]:
            raise ValueError(f"multiprocessing_context must be one of {', '.join(map(repr, START_METHODS[1:]))} (or "
                             f"their multiprocessing contexts), got {context!r}")
        if a.start_method is not None and a.start_method != method:
            raise ValueError(f"start_method={a.start_method!r} and multiprocessing_context ({method!r}) "
                             "disagree; give one of them")
        out = dataclasses.replace(out, start_method=method)
    return out


def _consumers(a: Arguments, torch: TorchChoices) -> tuple[int, int, bool]:
    """``(nb_consumer, consumer_index, deferred)``: as given, as a ``DistributedSampler`` says, or
    ``torch.distributed``'s; `deferred` when several consumers were given without an index (it
    comes later, from ``CachedLoader.start``)."""
    default_nb, default_idx = distributed_defaults()
    nb_consumer = check_int("nb_consumer", a.nb_consumer, 1, allow_none=True)
    consumer_index = check_int("consumer_index", a.consumer_index, 0, allow_none=True)
    for name, given, theirs in (("nb_consumer", nb_consumer, torch.nb_consumer),
                                ("consumer_index", consumer_index, torch.consumer_index)):
        if theirs is not None and given is not None and given != theirs:
            raise ValueError(f"{name}={given} disagrees with the DistributedSampler's ({theirs}); give one")
    if torch.nb_consumer is not None:
        nb_consumer, consumer_index = torch.nb_consumer, torch.consumer_index
    consumers = default_nb if nb_consumer is None else nb_consumer
    deferred = consumer_index is None and nb_consumer is not None and consumers > 1
    index = default_idx if consumer_index is None else consumer_index
    if index >= consumers:
        raise ValueError(f"consumer_index {index} must be < nb_consumer {consumers}")
    return consumers, index, deferred


def parse_arguments(a: Arguments) -> LoaderSettings:
    """Validate the constructor's arguments (`a`: every argument by its own name, aliases resolved).

    Raises
    ------
    ValueError
        Naming the argument (or setting key) at fault.
    """
    _refused_as_torch(a)
    source = _dataset_source(a)
    use_threading, gpu_indices = _flag("use_threading", a.use_threading), a.gpu_indices
    nb_worker = check_int("nb_worker", a.nb_worker, 0, allow_none=True)
    ray_options, workers = parse_executor(a.executor, a.executor_options, nb_worker,
                                          min(4, os.cpu_count() or 1), use_threading, gpu_indices)
    if gpu_indices is not None and (not isinstance(gpu_indices, (list, tuple)) or len(gpu_indices) != max(workers, 1)):
        raise ValueError(f"gpu_indices must give one GPU index per worker ({max(workers, 1)}), got {gpu_indices!r}")
    progress = a.progress
    if progress is not None and not isinstance(progress, bool):
        raise ValueError(f"progress must be True, False or None (on when stderr is a terminal), got {progress!r}")
    torch = _torch_arguments(a, workers)
    start_method = torch.start_method or (a.start_method if a.start_method is not None else "auto")
    if start_method not in START_METHODS:
        raise ValueError(f"start_method must be 'auto' (the default), 'fork', 'spawn' or 'forkserver', "
                         f"got {start_method!r}")
    cache = CacheSettings.parse(a.cache_setting) if a.cache_setting is not None else None
    if cache is not None:
        cache = decide_refresh(cache, workers, stream=is_stream(a.dataset))
    rotation = RotationSettings.parse(a.rotation_setting) if a.rotation_setting is not None else None
    _stream_checks(a, cache, rotation)
    if cache is not None and rotation is not None:
        raise ValueError("cache_setting and rotation_setting cannot be combined: a cache keeps every sample, "
                         "rotation a window of them. Use cache_setting={..., 'on_budget_exceeded': 'rotate'} "
                         "to rotate only when the cache does not fit")
    consumers, index, deferred = _consumers(a, torch)
    seed = check_int("seed", torch.seed if torch.seed is not None else a.seed, 0, allow_none=True)
    seed_given = seed is not None
    sampling = torch.sampling
    if sampling is not None and consumers > 1:
        raise ValueError("a sampler chooses the indices this process serves: with several consumers "
                         f"(nb_consumer={consumers}) leave the split to the loader and drop the sampler")
    if seed is None:
        # Every rank must draw the same permutation: a random seed only for a single consumer.
        seed = _drawn_seed() if consumers == 1 else 0
    batch_size, drop_last, collate_fn = _batching(a)
    return LoaderSettings(
        dataset=source,
        batch_size=batch_size, nb_worker=workers, shuffle=torch.shuffle,
        seed=seed, drop_last=drop_last,
        nearby_shuffle=int_at_least("nearby_shuffle", a.nearby_shuffle, 0),
        collate_fn=collate_fn,
        max_queue_size=int_at_least("max_queue_size", torch.max_queue_size or a.max_queue_size, 1),
        prefetch_time=_seconds("prefetch_time", a.prefetch_time, "a number of seconds >= 0", zero=True),
        use_threading=use_threading, device=a.device, pin_memory=_flag("pin_memory", a.pin_memory),
        gpu_indices=list(gpu_indices) if gpu_indices is not None else None,
        max_minibatch_length=check_int("max_minibatch_length", a.max_minibatch_length, 1, allow_none=True),
        cache=cache, rotation=rotation, nb_consumer=consumers, consumer_index=index, deferred_start=deferred,
        even_ranks=torch.even_ranks, in_order=_flag("in_order", a.in_order),
        partition=_choice("partition", a.partition, PARTITIONS),
        to_device=_callable("to_device", a.to_device), start_method=str(start_method),
        max_worker_restarts=int_at_least("max_worker_restarts", a.max_worker_restarts, 0),
        # 0 is torch's default and means what None means here: no limit.
        timeout=_seconds("timeout", None if a.timeout == 0 and a.timeout is not False else a.timeout,
                         "None or 0 (wait as long as it takes) or seconds > 0", zero=False),
        progress=progress, seed_given=seed_given, executor=str(a.executor), ray_options=ray_options,
        sampling=sampling, worker_init_fn=torch.worker_init_fn,
        read_transform=_callable("read_transform", a.read_transform))


def warn_excessive_workers(settings: LoaderSettings) -> None:
    """torch's warning, in torch's words, when more worker processes are asked for than this process may
    run on (its CPU affinity): they would only slow each other down, or exhaust memory."""
    if settings.executor != "process" or settings.use_threading or settings.nb_worker == 0:
        return
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    if cores is not None and settings.nb_worker <= cores:
        return
    suggested = (f"Our suggested max number of worker in current system is {cores}, which is smaller than what "
                 "this DataLoader is going to create." if cores is not None else
                 "DataLoader is not able to compute a suggested max number of worker in current system.")
    warnings.warn(f"This DataLoader will create {settings.nb_worker} worker processes in total. {suggested} Please "
                  "be aware that excessive worker creation might get DataLoader running slow or even freeze, lower "
                  "the worker number to avoid potential slowness/freeze if necessary.", UserWarning, stacklevel=3)
