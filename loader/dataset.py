"""What the loader takes from its user: a map-style dataset, its samples, a collate function.

Samples and batches are the user's data: their structure is whatever the
dataset and ``collate_fn`` make of them (nested dicts, lists and tuples of
arrays, tensors, scalars, str, bytes, None), so the loader passes them
through as :data:`Sample` and :data:`Batch`, the two places its types stay
open (as torch's ``DataLoader`` does). Everything else is typed.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeAlias, runtime_checkable

import numpy as np

#: One sample: what ``dataset[i]`` returns.
Sample: TypeAlias = Any
#: One batch: what ``collate_fn`` returns for a list of samples (default: :func:`loader.default_collate`).
Batch: TypeAlias = Any
#: Turns the samples of one batch into the batch.
CollateFn: TypeAlias = Callable[[Sequence[Sample]], Batch]
#: Applied to every batch on its way out instead of the default device move.
BatchFn: TypeAlias = Callable[[Batch], Batch]
#: torch's ``worker_init_fn(worker_id)``, run once in each worker before its first task.
WorkerInitFn: TypeAlias = Callable[[int], object]
#: ``read_transform(sample, rng) -> sample``: the cheap random part, applied to every sample served.
ReadTransform: TypeAlias = Callable[[Sample, np.random.Generator], Sample]


@runtime_checkable
class Dataset(Protocol):
    """A map-style dataset: ``len(dataset)`` samples, ``dataset[i]`` for ``0 <= i < len(dataset)``.

    Any ``torch.utils.data.Dataset`` with ``__len__`` qualifies; nothing needs
    to inherit from this.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


def is_stream(dataset: object) -> bool:
    """Whether `dataset` (an instance or a class) is a stream: a ``torch.utils.data.IterableDataset``, or
    anything iterable without ``__getitem__`` (its samples come in order, never by index)."""
    klass = dataset if isinstance(dataset, type) else type(dataset)
    if any(k.__name__ == "IterableDataset" and k.__module__.startswith("torch.utils.data") for k in klass.__mro__):
        return True
    return hasattr(klass, "__iter__") and not hasattr(klass, "__getitem__")


def endless(dataset: object) -> bool:
    """Whether stream `dataset` says it never ends: an attribute ``endless = True``, webdataset's
    ``resampled=True`` (shards drawn with replacement for ever) without ``with_epoch``, or a pipeline
    repeated for ever."""
    if getattr(dataset, "endless", False) is True:  # a stream may say so itself
        return True
    stages = getattr(dataset, "pipeline", None)
    if not isinstance(stages, list) or getattr(dataset, "nsamples", -1) > 0:
        return False
    resampled = any(type(stage).__name__ == "ResampledShards" for stage in stages)
    return resampled or getattr(dataset, "repetitions", 1) == sys.maxsize


@dataclass(frozen=True)
class DatasetSource:
    """How every process gets its own dataset.

    Either a class and its keyword arguments (``dataset_class(**params)``, built
    where it is used: the training process builds one for the length and the
    cache fingerprint, each worker its own), or an ``instance``: the training
    process uses it as it is, each worker gets a copy (by pickle, by value where
    pickle cannot name it: :mod:`loader.executors.transport`).
    """

    dataset_class: type[Dataset]
    params: dict[str, object] = field(default_factory=dict)
    instance: Dataset | None = None
    # What was computed of it once (its fingerprint, at construction): an instance may change later.
    memo: dict[str, object] = field(default_factory=dict, compare=False, repr=False)

    @classmethod
    def of(cls, dataset: object, params: dict[str, object] | None) -> DatasetSource:
        """The source the constructor's `dataset` and `dataset_params` describe.

        Raises
        ------
        TypeError
            `dataset_params` given with an instance, or `dataset` neither a class nor a map-style dataset.
        """
        if isinstance(dataset, type):
            return cls(dataset, dict(params or {}))
        if params is not None:
            raise TypeError("dataset_params are the keyword arguments of a dataset class; this dataset is an "
                            f"instance ({type(dataset).__qualname__}) already built: pass it alone, or pass its "
                            "class with dataset_params")
        if not (hasattr(dataset, "__len__") and hasattr(dataset, "__getitem__")) and not is_stream(dataset):
            raise TypeError(f"dataset must be a map-style dataset (with __len__ and __getitem__), a stream (an "
                            f"IterableDataset, or an iterable without __getitem__), or its class; got {dataset!r}")
        return cls(type(dataset), {}, dataset)  # type: ignore[arg-type]

    @property
    def stream(self) -> bool:
        """Whether the dataset is a stream (:func:`is_stream`): iterated, never indexed."""
        return is_stream(self.dataset_class)

    def build(self) -> Dataset:
        """The dataset: the instance, or a new one built from the class."""
        return self.instance if self.instance is not None else self.dataset_class(**self.params)
