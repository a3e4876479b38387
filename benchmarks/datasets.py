"""Datasets of the benchmarks (importable by module path, as loader workers need)."""

from __future__ import annotations

import functools
import time

import numpy as np


def burn_cpu(seconds: float) -> None:
    """Spend `seconds` of this thread's CPU time (not wall time: sleeping costs nothing)."""
    end = time.thread_time() + seconds
    x = 1.0
    while time.thread_time() < end:
        for _ in range(200):
            x = x * 1.0000001 + 1e-9


class ExpensiveDataset:
    """Each sample costs `cost` seconds of CPU, like decoding plus augmentation.

    Sample ``i``: ``(float32 array of shape `shape`, int label)``, with random
    augmentation noise so refreshed epochs differ.
    """

    def __init__(self, n: int = 1000, cost: float = 0.005, shape: tuple = (3, 64, 64)) -> None:
        self.n = n
        self.cost = cost
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        burn_cpu(self.cost)
        rng = np.random.default_rng()
        x = np.full(self.shape, index % 251, dtype=np.float32) + rng.random(self.shape, dtype=np.float32)
        return x, index


class StoredSamples:
    """A cheap dataset of fixed samples, to fill a store fast for throughput runs.

    Sample ``i``: ``(float32 array of shape `shape`, int label)``.
    """

    def __init__(self, n: int, shape: tuple) -> None:
        self.n = n
        self.base = np.random.default_rng(0).random(tuple(shape), dtype=np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        return self.base + np.float32(index % 7), index


class SleepyDataset:
    """Each sample takes `delay` seconds of wall time and no CPU (a slow network read).

    Lets a benchmark see the CPU the training process burns while it waits:
    the workers use none, so whatever the training process uses is its own.
    """

    def __init__(self, n: int = 48, delay: float = 0.1, shape: tuple = (16,)) -> None:
        self.n = n
        self.delay = delay
        self.shape = tuple(shape)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        time.sleep(self.delay)
        return np.full(self.shape, index, dtype=np.float32), index


#: Side of the "decoded" images, and of the random crop taken from them each epoch.
IMAGE_SIDE, CROP_SIDE = 256, 224


@functools.lru_cache(maxsize=1)
def _pattern() -> np.ndarray:
    """A fixed 256x256x3 uint8 gradient (read-only), computed once per process."""
    rows = np.arange(IMAGE_SIDE, dtype=np.uint8)[:, None, None] * np.uint8(3)
    cols = np.arange(IMAGE_SIDE, dtype=np.uint8)[None, :, None]
    channels = np.arange(3, dtype=np.uint8)[None, None, :] * np.uint8(85)
    pattern = rows + cols + channels
    pattern.setflags(write=False)
    return pattern


def decoded_image(index: int) -> np.ndarray:
    """The image of sample `index`: 256x256x3 uint8, the same on every call (a decoded file)."""
    return _pattern() + np.uint8(index % 251)


def random_crop_flip(sample: dict, rng: np.random.Generator) -> dict:
    """A random 224x224 crop and a random horizontal flip of ``sample["image"]``: a read transform.

    Returns a new dict: the crop (contiguous), the sample's index, and ``"crop"``,
    ``[top, left, flip]``, which identifies the augmentation drawn.
    """
    top, left = (int(v) for v in rng.integers(0, IMAGE_SIDE - CROP_SIDE + 1, size=2))
    flip = int(rng.integers(0, 2))
    image = sample["image"][top:top + CROP_SIDE, left:left + CROP_SIDE]
    if flip:
        # Copying a reversed view moves 3 bytes at a time, most of this transform's time; written
        # as a user would write it, since the transform's limit is measured with this same code.
        image = image[:, ::-1]
    return {"image": np.ascontiguousarray(image), "index": sample["index"],
            "crop": np.array([top, left, flip], dtype=np.int64)}


class DecodedImages:
    """Each sample costs `cost` seconds of CPU (decoding a file) and is the same on every call.

    Sample ``i``: ``{"image": 256x256x3 uint8, "index": i}``; the random crop is left to a read
    transform (:func:`random_crop_flip`).
    """

    def __init__(self, n: int = 1000, cost: float = 0.005) -> None:
        self.n = n
        self.cost = cost

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        burn_cpu(self.cost)
        return {"image": decoded_image(index), "index": index}


class DecodedCroppedImages(DecodedImages):
    """:class:`DecodedImages` plus the random crop and flip in ``__getitem__``, as a dataset must do
    it for torch's DataLoader (which has no read transform): drawn afresh on every call.

    Sample ``i``: ``{"image": 224x224x3 uint8, "index": i, "crop": [top, left, flip]}``.
    """

    def __getitem__(self, index: int) -> dict:
        return random_crop_flip(super().__getitem__(index), np.random.default_rng())


class IndexedObjects:
    """A dataset that indexes its samples with Python objects: a list of `n` dicts of a path, a label
    and a box, as an annotation file loaded into memory (the case of torch's "copy-on-read" issue).

    Sample ``i``: ``(float32 box of 4, int label)``: cheap, so the memory of the index dominates.
    """

    def __init__(self, n: int) -> None:
        self.items = [{"path": f"images/{i // 1000:05d}/{i:09d}.jpg", "label": i % 1000,
                       "box": [float(i % 640), float(i % 480), 32.0 + i % 97, 32.0 + i % 89]} for i in range(n)]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, index: int) -> tuple:
        item = self.items[index]
        return np.asarray(item["box"], dtype=np.float32), item["label"]
