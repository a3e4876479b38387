"""Faults a training run does to its own store and disk: bit flips in committed records, a full disk.

The flips target the bytes of the records themselves (not the B-tree pages of LMDB or the
index of memmap, whose damage is a different fault: the whole generation is unreadable), so
the promise under test is the one of ``docs/ARCHITECTURE.md``: a record that fails its
checksum is a miss, recomputed from the dataset, and never served.
"""

from __future__ import annotations

import os
import random
from pathlib import Path

import numpy as np

from cachestore import open_store
from cachestore.errors import CacheStoreError, CorruptSampleError

#: Files of a generation that hold no record bytes.
_NOT_DATA = {"manifest.json", "index.npy", "shards.json", "schema.json", "lock.mdb"}


def _data_files(gen_dir: Path) -> list[Path]:
    return sorted(p for p in gen_dir.iterdir() if p.is_file() and p.name not in _NOT_DATA
                  and not p.name.endswith(".idx") and not p.name.endswith(".json"))


def _flip_at(path: Path, offset: int, bit: int) -> None:
    fd = os.open(path, os.O_RDWR)
    try:
        byte = os.pread(fd, 1, offset)
        os.pwrite(fd, bytes([byte[0] ^ (1 << bit)]), offset)
    finally:
        os.close(fd)


def _is_corrupt(reader, index: int) -> bool:
    try:
        reader.get(index)
    except CorruptSampleError:
        return True
    return False


def flip_records(store_path: str, count: int, seed: int) -> dict:
    """Flip one bit in each of `count` records of the newest committed generation.

    Each record is found by its own bytes (the sample's ``x`` is unique); a copy LMDB left in a
    free page is put back and the next one tried, until a fresh read of the record fails its
    checksum. Returns ``{"generation": g, "indices": [...]}`` (``generation`` ``None`` when
    there is nothing committed to flip).
    """
    rng = random.Random(seed)
    try:
        store = open_store(store_path, readonly=True)
    except CacheStoreError as exc:
        return {"generation": None, "indices": [], "why": str(exc)}
    with store:
        g = store.latest()
        if g is None:
            return {"generation": None, "indices": [], "why": "nothing committed"}
        gen_dir = Path(store_path) / f"gen-{g:06d}"
        flipped: list[int] = []
        with store.reader(g) as reader:
            n = len(reader)
            for index in rng.sample(range(n), min(count, n)):
                try:
                    pattern = np.asarray(reader.get(index)["x"]).tobytes()
                except CorruptSampleError:
                    continue  # flipped before: leave it
                if _flip_one(gen_dir, pattern, rng, lambda: _is_corrupt(reader, index)):
                    flipped.append(index)
    return {"generation": g, "indices": sorted(flipped)}


def _flip_one(gen_dir: Path, pattern: bytes, rng: random.Random, took) -> bool:
    for path in _data_files(gen_dir):
        data = path.read_bytes()
        start = data.find(pattern)
        while start >= 0:
            offset, bit = start + rng.randrange(len(pattern)), rng.randrange(8)
            _flip_at(path, offset, bit)
            if took():
                return True
            _flip_at(path, offset, bit)  # a stale copy: put it back
            start = data.find(pattern, start + 1)
    return False


def fill_disk(directory: str) -> None:
    """Fill the file system of `directory` to the last byte (see :func:`tests.fullfs.fill`)."""
    from tests.fullfs import fill

    fill(directory)


def free_disk(directory: str) -> None:
    from tests.fullfs import free

    free(directory)
