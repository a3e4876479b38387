"""What the loader takes from its user: a map-style dataset, its samples, a collate function.

Samples and batches are the user's data: their structure is whatever the
dataset and ``collate_fn`` make of them (nested dicts, lists and tuples of
arrays, tensors, scalars, str, bytes, None), so the loader passes them
through as :data:`Sample` and :data:`Batch`, the two places its types stay
open (as torch's ``DataLoader`` does). Everything else is typed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence, TypeAlias, runtime_checkable

#: One sample: what ``dataset[i]`` returns.
Sample: TypeAlias = Any
#: One batch: what ``collate_fn`` returns for a list of samples (default: :func:`loader.default_collate`).
Batch: TypeAlias = Any
#: Turns the samples of one batch into the batch.
CollateFn: TypeAlias = Callable[[Sequence[Sample]], Batch]
#: Applied to every batch on its way out instead of the default device move.
BatchFn: TypeAlias = Callable[[Batch], Batch]


@runtime_checkable
class Dataset(Protocol):
    """A map-style dataset: ``len(dataset)`` samples, ``dataset[i]`` for ``0 <= i < len(dataset)``.

    Any ``torch.utils.data.Dataset`` with ``__len__`` qualifies; nothing needs
    to inherit from this.
    """

    def __len__(self) -> int: ...

    def __getitem__(self, index: int) -> Sample: ...


@dataclass(frozen=True)
class DatasetSource:
    """How every process gets its own dataset: ``dataset_class(**params)``, built where it is used.

    The training process builds one too (for the length and the cache
    fingerprint); each worker builds its own.
    """

    dataset_class: type[Dataset]
    params: dict[str, object] = field(default_factory=dict)

    def build(self) -> Dataset:
        """A new dataset object."""
        return self.dataset_class(**self.params)
