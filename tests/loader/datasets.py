"""Datasets the loader tests build in worker processes (importable under spawn)."""

from __future__ import annotations

import collections
import os
import threading
import time

import numpy as np


def _count(counter_dir: str | None, index: int) -> None:
    # One tiny file append per call: a count of dataset calls across processes.
    if counter_dir:
        with open(os.path.join(counter_dir, f"calls-{os.getpid()}.txt"), "a") as f:
            f.write(f"{index}\n")


def read_calls(counter_dir: str) -> list[int]:
    calls: list[int] = []
    for name in os.listdir(counter_dir):
        if name.startswith("calls-"):
            with open(os.path.join(counter_dir, name)) as f:
                calls += [int(line) for line in f if line.strip()]
    return calls


class ArangeDataset:
    """Sample i is {"x": float32 array filled with i (+ noise if augment), "y": i}."""

    def __init__(self, n: int = 100, shape: tuple = (4,), counter_dir: str | None = None,
                 augment: bool = False, fail_at: int | None = None, delay: float = 0.0) -> None:
        self.n = n
        self.shape = tuple(shape)
        self.counter_dir = counter_dir
        self.augment = augment
        self.fail_at = fail_at
        self.delay = delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        _count(self.counter_dir, index)
        if index == self.fail_at:
            raise KeyError(f"sample {index} is broken")
        if self.delay:
            time.sleep(self.delay)
        x = np.full(self.shape, index, dtype=np.float32)
        if self.augment:
            x = x + np.random.default_rng().random(self.shape, dtype=np.float32)
        return {"x": x, "y": index}


class FailingInit:
    def __init__(self, n: int = 10) -> None:
        raise RuntimeError("cannot open the dataset files")

    def __len__(self) -> int:  # pragma: no cover
        return 0

    def __getitem__(self, index: int) -> int:  # pragma: no cover
        return index


class KillSelfDataset(ArangeDataset):
    """Dies with SIGKILL whenever it computes `kill_at` (a crash in native code, say)."""

    def __init__(self, kill_at: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.kill_at = kill_at

    def __getitem__(self, index: int) -> dict:
        if index == self.kill_at:
            import signal

            os.kill(os.getpid(), signal.SIGKILL)
        return super().__getitem__(index)


class BigSampleDataset(ArangeDataset):
    """Samples of `mib` MiB each: a batch larger than any initial shared-memory slot."""

    def __init__(self, n: int = 8, mib: float = 2.0, **kwargs) -> None:
        side = int((mib * (1 << 20) / 4) ** 0.5)
        super().__init__(n=n, shape=(side, side), **kwargs)


class MixedDataset:
    """Samples with numpy, torch, nested containers and scalars."""

    def __init__(self, n: int = 10) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        import torch

        return {"img": np.full((2, 3), index, np.uint8), "t": torch.full((3,), float(index)),
                "pair": (index, float(index) / 2), "flag": index % 2 == 0, "name": f"s{index}"}


class AlwaysFails(ArangeDataset):
    """Every sample raises: a rank whose data is broken."""

    def __getitem__(self, index: int) -> dict:
        raise ValueError(f"sample {index} cannot be decoded")


class HangDataset(ArangeDataset):
    """Blocks forever in ``__getitem__(hang_at)``, in a function whose name the stack must show."""

    def __init__(self, hang_at: int = 0, **kwargs) -> None:
        super().__init__(**kwargs)
        self.hang_at = hang_at

    def __getitem__(self, index: int) -> dict:
        if index == self.hang_at:
            stuck_reading_the_labels()
        return super().__getitem__(index)


#: Set to let stuck thread workers go (a test ends); process workers are killed instead.
RELEASE_STUCK = threading.Event()


def stuck_reading_the_labels() -> None:
    RELEASE_STUCK.wait()


class SizeFromFileDataset:
    """Samples of as many float32 as `size_file` says when they are computed: the test changes the
    size between epochs (the workers built their dataset once)."""

    def __init__(self, n: int = 8, size_file: str = "") -> None:
        self.n = n
        self.size_file = size_file

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        with open(self.size_file) as f:
            count = int(f.read())
        return {"x": np.full(count, index, dtype=np.float32), "y": index}


class TransformDataset:
    """Sample i is ``transform(i)``: the transform is whatever the user passed (a lambda, say)."""

    def __init__(self, n: int, transform) -> None:
        self.n = n
        self.transform = transform

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return self.transform(index)


class Compose:
    """A torchvision-style chain of transforms (objects and functions alike)."""

    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x):
        for t in self.transforms:
            x = t(x)
        return x


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x):
        return x * self.factor


class TableDataset:
    """A dataset object as torch users build them: a table of data and a transform."""

    def __init__(self, table, transform=None) -> None:
        self.table = table
        self.transform = transform

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int):
        x = self.table[index]
        return self.transform(x) if self.transform is not None else x


class PlantedDataset(ArangeDataset):
    """Sample i also holds an object whose unpickling writes the file `marker`
    (``tests.cachestore.helpers.Planted``): cached, it is a pickled leaf."""

    def __init__(self, marker: str, n: int = 8) -> None:
        super().__init__(n=n)
        self.marker = marker

    def __getitem__(self, index: int) -> dict:
        from tests.cachestore.helpers import Planted

        return {**super().__getitem__(index), "planted": Planted(self.marker)}


#: The sample of :class:`NamedTupleDataset` (importable: workers send batches of it back by name).
Pair = collections.namedtuple("Pair", ["x", "y"])


class NamedTupleDataset:
    """Sample i is ``Pair(x=float32 array of i, y=i)``: a namedtuple, as torch users return them."""

    def __init__(self, n: int = 6) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Pair:
        return Pair(np.full(2, index, dtype=np.float32), index)


class OffsetDataset(ArangeDataset):
    """:class:`ArangeDataset` whose ``x`` is shifted by ``offset``, an attribute a user may set after building
    the loader."""

    offset = 0.0

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        sample["x"] = sample["x"] + np.float32(self.offset)
        return sample


class ObjectIndex:
    """Samples indexed by Python objects: `n` dicts of a path (`width` characters) and a label, as an
    annotation file loaded into memory. A sample reads its dict and its path (their reference counts:
    a forked worker writes the pages they lie in, and so holds its own copy of them)."""

    def __init__(self, n: int, width: int = 4000) -> None:
        self.items = [{"path": f"{i:08d}/" + "p" * width, "label": i} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> dict:
        item = self.items[index]
        return {"x": np.array([len(item["path"]), item["label"]], dtype=np.int64)}
