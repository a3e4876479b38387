"""Datasets for the README snippets of dataset_server and swift_loader (importable under spawn)."""

from __future__ import annotations

import numpy as np


class YourDataset:
    """A dataset built from positional arguments, as in dataset_server's README: `size` samples of `width` floats."""

    def __init__(self, size: int, width: int) -> None:
        self.size = size
        self.width = width

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> tuple:
        return np.full(self.width, i, dtype=np.float32), i


# dataset_server's README: "we could create another dataset class that inherits from YourDataset
# and constructs only from keyword arguments".
class SuitableDataset(YourDataset):
    def __init__(self, **kwargs):
        super().__init__(kwargs['param1'], kwargs['param2'])


class Dataset:
    """Keyword-constructed, like the CIFAR10 wrapper of dataset_server's example: (image, label) pairs."""

    def __init__(self, train: bool = True, n: int = 200) -> None:
        self.n = n if train else n // 4

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple:
        return np.full((4, 4, 3), i % 256, dtype=np.uint8), i


def broken_collate(samples: list) -> None:
    raise ValueError("this collate cannot stack these samples")


def tuple_collate(samples: list) -> tuple:
    """A collate of the kind swift_loader's users wrote: a list of (x, y) into (X, Y)."""
    xs, ys = zip(*samples)
    return np.stack(xs), np.asarray(ys, dtype=np.int64)


class IndexDataset:
    """swift_loader's test dataset: sample i is the int i."""

    def __init__(self, size: int) -> None:
        self.size = size

    def __len__(self) -> int:
        return self.size

    def __getitem__(self, i: int) -> int:
        return i
