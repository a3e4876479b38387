"""The constructor's arguments, readable as loader attributes (``loader.batch_size``), as parsed:
aliases merged, defaults filled in, and fixed for the loader's life."""

from __future__ import annotations

import dataclasses
from typing import Callable, Generic, TypeVar, overload

from .settings import LoaderSettings

T = TypeVar("T")


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
        raise AttributeError(f"{self.name} is a setting of this loader, fixed when it was built: build another "
                             "loader to change it")


class LoaderAttributes:
    """The settings of a loader as attributes; the loader sets ``settings`` once, in its constructor."""

    settings: LoaderSettings

    dataset_class = _Setting(lambda s: s.dataset.dataset_class)
    dataset_params = _Setting(lambda s: s.dataset.params if s.dataset.instance is None else None)
    batch_size = _Setting(lambda s: s.batch_size)
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

