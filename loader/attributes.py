"""The constructor's arguments, readable as loader attributes (``loader.batch_size``), as parsed:
aliases merged, defaults filled in, and fixed for the loader's life; and the attributes torch's
``DataLoader`` has (``sampler``, ``batch_sampler``, ``num_workers``, ``generator`` ...), with torch's
values and types where they mean the same here."""

from __future__ import annotations

import dataclasses
import multiprocessing
import weakref
from typing import Any, Callable, Generic, Iterator, TypeVar, overload

from .arguments import Arguments
from .epochs.order import epoch_order
from .errors import SettingFixedError
from .settings import LoaderSettings
from .state import EpochCursor

T = TypeVar("T")
#: What torch's DataLoader refuses to have set once built (its own list): a ValueError there too.
TORCH_FIXED = ("batch_size", "batch_sampler", "sampler", "drop_last", "dataset", "persistent_workers")


def _fixed(loader: object, name: str) -> SettingFixedError:
    return SettingFixedError(f"{name} attribute should not be set after {type(loader).__name__} is initialized: "
                             f"{name} is a setting of this loader, fixed when it was built; build another loader "
                             "to change it")


class _Setting(Generic[T]):
    """A constructor argument readable as a loader attribute (``loader.batch_size``), as parsed."""

    def __init__(self, read: Callable[[LoaderSettings], T]) -> None:
        self.read = read

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, loader: None, owner: type | None = None) -> _Setting[T]: ...

    @overload
    def __get__(self, loader: LoaderAttributes, owner: type | None = None) -> T: ...

    def __get__(self, loader: LoaderAttributes | None, owner: type | None = None) -> T | _Setting[T]:
        if loader is None:
            return self  # on the class: the descriptor itself, as for a property
        return self.read(loader.settings)

    def __set__(self, loader: LoaderAttributes, value: object) -> None:
        raise _fixed(loader, self.name)


@dataclasses.dataclass(frozen=True)
class TorchArguments:
    """torch's ``DataLoader`` arguments as the caller gave them, for the attributes torch users read
    (the settings keep what the loader makes of them: a seed, a start method, a queue depth)."""

    sampler: object = None
    batch_sampler: object = None
    generator: object = None
    prefetch_factor: object = None
    multiprocessing_context: object = None
    unbatched: bool = False  # batch_size=None: samples one by one

    @classmethod
    def of(cls, arguments: Arguments) -> TorchArguments:
        """Those of the constructor's `arguments` (aliases resolved, already validated)."""
        context = arguments.multiprocessing_context
        if isinstance(context, str):  # torch keeps the context, whichever way it was given
            context = multiprocessing.get_context(context)
        return cls(arguments.sampler, arguments.batch_sampler, arguments.generator, arguments.prefetch_factor,
                   context, arguments.batch_size is None)


class LoaderAttributes:
    """The settings of a loader as attributes; the loader sets ``settings``, ``_given`` and ``dataset`` once,
    in its constructor, and keeps where it is between epochs in ``_cursor`` (which its sampler reads)."""

    settings: LoaderSettings
    _given: TorchArguments
    _cursor: EpochCursor
    dataset: Any

    dataset_class = _Setting(lambda s: s.dataset.dataset_class)
    dataset_params = _Setting(lambda s: s.dataset.params if s.dataset.instance is None else None)
    nb_worker = _Setting(lambda s: s.nb_worker)
    shuffle = _Setting(lambda s: s.shuffle)
    drop_last = _Setting(lambda s: s.drop_last)
    nearby_shuffle = _Setting(lambda s: s.nearby_shuffle)
    collate_fn = _Setting(lambda s: s.collate_fn)
    max_queue_size = _Setting(lambda s: s.max_queue_size)
    prefetch_time = _Setting(lambda s: s.prefetch_time)
    use_threading = _Setting(lambda s: s.use_threading)
    device = _Setting(lambda s: s.device)
    pin_memory = _Setting(lambda s: s.pin_memory)
    gpu_indices = _Setting(lambda s: s.gpu_indices)
    max_minibatch_length = _Setting(lambda s: s.max_minibatch_length)
    nb_consumer = _Setting(lambda s: s.nb_consumer)
    consumer_index = _Setting(lambda s: s.consumer_index)
    to_device = _Setting(lambda s: s.to_device)
    start_method = _Setting(lambda s: s.start_method)
    max_worker_restarts = _Setting(lambda s: s.max_worker_restarts)
    timeout = _Setting(lambda s: s.timeout)
    progress = _Setting(lambda s: s.progress)
    executor = _Setting(lambda s: s.executor)
    executor_options = _Setting(lambda s: dataclasses.asdict(s.ray_options) if s.ray_options is not None else {})
    cache = _Setting(lambda s: s.cache)
    partition = _Setting(lambda s: s.partition)
    worker_init_fn = _Setting(lambda s: s.worker_init_fn)
    read_transform = _Setting(lambda s: s.read_transform)

    num_workers = _Setting(lambda s: s.nb_worker)  # torch's name

    def __setattr__(self, name: str, value: object) -> None:
        # torch refuses these once built (with a ValueError); `dataset` is the one set as a plain attribute.
        if name == "dataset" and "dataset" in self.__dict__:
            raise _fixed(self, name)
        super().__setattr__(name, value)

    # -------------------------------------------------------------- torch's DataLoader attributes
    @property
    def batch_size(self) -> int | None:
        """Samples per batch; ``None``: samples are served one by one (``batch_size=None``, as in torch)."""
        return None if self._given.unbatched else self.settings.batch_size

    @batch_size.setter
    def batch_size(self, value: object) -> None:
        raise _fixed(self, "batch_size")

    @property
    def sampler(self) -> Any:
        """The sampler in use, as torch has it: the one given (a ``DistributedSampler`` too), else a
        :class:`RandomSampler` (shuffling) or :class:`SequentialSampler` over the dataset."""
        return self._samplers()[0]

    @sampler.setter
    def sampler(self, value: object) -> None:
        raise _fixed(self, "sampler")

    @property
    def batch_sampler(self) -> Any:
        """The batch sampler given, else a :class:`BatchSampler` over :attr:`sampler` (``None`` with
        ``batch_size=None``), as torch has it."""
        return self._samplers()[1]

    @batch_sampler.setter
    def batch_sampler(self, value: object) -> None:
        raise _fixed(self, "batch_sampler")

    @property
    def _auto_collation(self) -> bool:
        """torch's: whether samples are collated into batches (not with ``batch_size=None``)."""
        return not self._given.unbatched

    @property
    def _iterator(self) -> None:
        """torch's iterator kept by a loader with ``persistent_workers`` (code written for torch stops
        its workers through it): always ``None``, the workers belong to the loader (``close()``)."""
        return None

    @_iterator.setter
    def _iterator(self, value: object) -> None:
        # Lightning resets it (``loader._iterator = None``) as it would torch's: there is nothing to drop.
        pass

    def _samplers(self) -> tuple[Any, Any]:
        pair = self.__dict__.get("_sampler_pair")
        if pair is None:
            s, given = self.settings, self._given
            sampler = given.sampler
            if sampler is None:
                sampler = RandomSampler(self) if s.shuffle else SequentialSampler(self.dataset)
            batch_sampler = given.batch_sampler
            if batch_sampler is None and not given.unbatched:
                batch_sampler = BatchSampler(sampler, s.batch_size, s.drop_last)
            pair = self.__dict__["_sampler_pair"] = (sampler, batch_sampler)
        return pair

    @property
    def generator(self) -> object:
        """The ``torch.Generator`` given (its seed is the loader's :attr:`seed`), else ``None``."""
        return self._given.generator

    @property
    def prefetch_factor(self) -> int | None:
        """Batches in flight per worker: the given value, else ``None`` without workers (as torch) and
        ``max_queue_size // num_workers`` with them (torch's default is 2)."""
        if self._given.prefetch_factor is not None or self.settings.nb_worker == 0:
            return self._given.prefetch_factor  # type: ignore[return-value]  # an int, validated
        return max(1, self.settings.max_queue_size // self.settings.nb_worker)

    @property
    def persistent_workers(self) -> bool:
        """Workers persist between epochs whenever there are workers (``persistent_workers=False`` too)."""
        return self.settings.nb_worker > 0

    @persistent_workers.setter
    def persistent_workers(self, value: object) -> None:
        raise _fixed(self, "persistent_workers")

    @property
    def multiprocessing_context(self) -> object:
        """The context given (a start method's name becomes its context, as in torch), else ``None``:
        :attr:`start_method` says which one the workers use."""
        return self._given.multiprocessing_context


# ------------------------------------------------------------------ torch-like samplers
class SequentialSampler:
    """``loader.sampler`` of a loader that does not shuffle: indices ``0..len(dataset)-1`` in order,
    as torch's ``SequentialSampler`` (with several consumers, each serves its part of it)."""

    def __init__(self, data_source: Any) -> None:
        self.data_source = data_source

    def __iter__(self) -> Iterator[int]:
        return iter(range(len(self.data_source)))

    def __len__(self) -> int:
        return len(self.data_source)


class RandomSampler:
    """``loader.sampler`` of a loader that shuffles, as torch's ``RandomSampler`` (no replacement, one
    permutation of ``len(dataset)`` indices per epoch): iterating it gives the permutation the loader's
    next ``iter()`` serves (set by ``set_epoch`` too), drawn from its seed and the epoch (with several
    consumers, each serves its part of it). It keeps the loader by a weak reference."""

    replacement = False

    def __init__(self, loader: LoaderAttributes) -> None:
        self._loader = weakref.ref(loader)
        self.data_source = loader.dataset
        self.generator = loader._given.generator

    @property
    def num_samples(self) -> int:
        return len(self.data_source)

    def __iter__(self) -> Iterator[int]:
        loader = self._loader()
        if loader is None:
            raise RuntimeError("the loader of this sampler was closed and collected")
        epoch = loader._cursor.next_epoch  # the next iter()'s, set_epoch's
        order = epoch_order(len(self.data_source), epoch, loader.seed, True,  # type: ignore[attr-defined]
                            loader.settings.nearby_shuffle)
        return iter(order.tolist())

    def __len__(self) -> int:
        return self.num_samples


class BatchSampler:
    """``loader.batch_sampler`` unless one was given, as torch's ``BatchSampler``: lists of
    `batch_size` indices of `sampler`, the last one shorter unless `drop_last`."""

    def __init__(self, sampler: Any, batch_size: int, drop_last: bool) -> None:
        self.sampler = sampler
        self.batch_size = batch_size
        self.drop_last = drop_last

    def __iter__(self) -> Iterator[list[int]]:
        batch: list[int] = []
        for index in self.sampler:
            batch.append(int(index))
            if len(batch) == self.batch_size:
                yield batch
                batch = []
        if batch and not self.drop_last:
            yield batch

    def __len__(self) -> int:
        n = len(self.sampler)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)
