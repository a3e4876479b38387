"""What fingerprinting a dataset costs at the first ``iter()`` (``loader/cache/fingerprint.py``, ``reach.py``).

A loader with a cache fingerprints its dataset once, at its first ``iter()``: by value over the instance's
attributes, and with what the code of its functions and class reaches (module-level values, helper
functions, classes). Cases, each the best of `repeats` runs in milliseconds:

- ``transforms``: a 1000 x 10 float32 table and a torchvision-style chain of five transforms (a
  transform object, a function reading a module-level array and constant, a ufunc, a partial, a lambda);
- ``large table``: a 100,000 x 64 float32 table (25 MB) and two transforms: the time is sha256 over
  the bytes (the ``hash only`` line: ``hashlib.sha256`` of the same bytes, measured beside it);
- ``large code``: a transform that reaches this project's whole ``loader`` package (an editable
  install, so user code: about 900 functions and classes), the cost of a large user code base;
- ``TensorDataset``: torch's, installed code (by name and version);
- ``image folder``: an ImageFolder-style list of `--files` (path, label) pairs naming real files
  (1,000 directories, made in a temporary directory and removed after): the whole fingerprint,
  of which ``stat only`` is the data files' part (``loader/cache/files.py``: one ``os.stat`` per
  file, in one thread per core without the GIL), beside ``os.stat loop``, a plain loop over the same paths, and ``no files``,
  the same list whose paths name nothing (the hashing alone). Each once: the page cache is warm
  after the files are made, as it is on a machine that just wrote or read its data.

``python -m benchmarks.fingerprint_time`` (not part of ``python -m benchmarks``: making a million
files takes about a minute).
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import numpy as np

import loader
from loader.cache import files
from loader.cache.fingerprint import dataset_fingerprint
from loader.dataset import DatasetSource

SCALE = 2.0
MEAN = np.linspace(0.0, 1.0, 10, dtype=np.float32)


class Table:
    """A dataset object as torch users build them: a table and a transform."""

    def __init__(self, table: np.ndarray, transform: Callable[[Any], Any]) -> None:
        self.table = table
        self.transform = transform

    def __len__(self) -> int:
        return len(self.table)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.table[index])


class Compose:
    def __init__(self, transforms: list) -> None:
        self.transforms = transforms

    def __call__(self, x: Any) -> Any:
        for t in self.transforms:
            x = t(x)
        return x


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x: Any) -> Any:
        return x * self.factor


def normalize(x: Any) -> Any:
    return (x - MEAN) * SCALE


def uses_the_loader_package(x: Any) -> Any:
    return loader.CachedLoader, x


def best_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def fingerprint_ms(dataset: Any, repeats: int) -> float:
    # A new source each time: a loader's fingerprint is memoised on its own.
    return best_ms(lambda: dataset_fingerprint(DatasetSource.of(dataset, None), len(dataset), (0, 1)), repeats)


class Folder:
    """An image folder as torchvision keeps it: (path, class) pairs."""

    def __init__(self, samples: list[tuple[str, int]]) -> None:
        self.samples = samples

    def __len__(self) -> int:
        return len(self.samples)

    def __getitem__(self, index: int) -> Any:
        return self.samples[index]


def image_folder_rows(count: int) -> dict[str, float]:
    """The ``image folder`` rows (see the module docstring), in milliseconds."""
    root = tempfile.mkdtemp(prefix="fingerprint-files-")
    try:
        per_dir = max(1, count // 1000)
        paths = []
        for k in range(count):
            if k % per_dir == 0:
                folder = os.path.join(root, f"{k // per_dir:04d}")
                os.mkdir(folder)
            path = os.path.join(folder, f"{k:07d}.jpg")
            with open(path, "wb"):
                pass
            paths.append(path)
        samples = [(p, k % 1000) for k, p in enumerate(paths)]
        elsewhere = [(p.replace(root, root + "-gone"), k % 1000) for k, p in enumerate(paths)]
        return {
            f"image folder, {count:,} files": fingerprint_ms(Folder(samples), 1),
            "  stat only": best_ms(lambda: files.files_identity(paths), 1),
            "  os.stat loop": best_ms(lambda: [os.stat(p) for p in paths], 1),
            "  no files (hashing only)": fingerprint_ms(Folder(elsewhere), 1),
        }
    finally:
        shutil.rmtree(root, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--files", type=int, default=1_000_000, help="files of the image folder (0: none)")
    args = parser.parse_args(argv)
    import torch

    rng = np.random.default_rng(0)
    small = rng.random((1000, 10), dtype=np.float32)
    large = rng.random((100_000, 64), dtype=np.float32)
    chain = Compose([Scale(2.0), normalize, np.log1p, functools.partial(np.multiply, 2.0), lambda x: x + 1])
    rows = {
        "transforms": fingerprint_ms(Table(small, chain), args.repeats),
        "large table": fingerprint_ms(Table(large, Compose([Scale(2.0), normalize])), args.repeats),
        "large table, hash only": best_ms(lambda: hashlib.sha256(large.data), args.repeats),
        "large code": fingerprint_ms(Table(small, uses_the_loader_package), args.repeats),
        "TensorDataset": fingerprint_ms(torch.utils.data.TensorDataset(torch.zeros(1000, 10)), args.repeats),
    }
    if args.files:
        rows.update(image_folder_rows(args.files))
    for name, ms in rows.items():
        print(f"{name:32s} {ms:10.2f} ms")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
