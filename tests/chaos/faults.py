"""Faults a training run does to its own store and disk: bit flips in committed records, a full disk,
the prefix removed (``rm -rf``), a file system remounted read-only, a prune beside a reading epoch.

The flips target the bytes of the records themselves (not the B-tree pages of LMDB or the
index of memmap, whose damage is a different fault: the whole generation is unreadable), so
the promise under test is the one of ``docs/ARCHITECTURE.md``: a record that fails its
checksum is a miss, recomputed from the dataset, and never served.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
from pathlib import Path

import numpy as np

from cachestore import open_store
from cachestore.errors import CacheStoreError, CorruptSampleError
from cachestore.space.disk import read_only

#: Files of a generation that hold no record bytes.
_NOT_DATA = {"manifest.json", "index.npy", "shards.json", "schema.json", "lock.mdb"}


def _data_files(gen_dir: Path) -> list[Path]:
    return sorted(p for p in gen_dir.iterdir() if p.is_file() and p.name not in _NOT_DATA
                  and not p.name.endswith(".idx") and not p.name.endswith(".json"))


def _flip_at(path: Path, offset: int, bit: int) -> None:
    fd = os.open(path, os.O_RDWR)  # OSError on a file system remounted read-only: see flip_records
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
    if read_only(store_path):
        return {"generation": None, "indices": [], "why": "the file system is read-only: no bit can flip"}
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


def remount(mount: str, read_only: bool) -> dict:
    """Remount the tmpfs at `mount` read-only (or writable again): ``{"ok": True}``, or why it was refused
    (``mount`` says "busy" while a file there is open for writing)."""
    done = subprocess.run(["mount", "-o", "remount," + ("ro" if read_only else "rw"), mount], capture_output=True,
                          text=True, timeout=30)
    if done.returncode == 0:
        return {"ok": True}
    return {"ok": False, "refused": (done.stderr or done.stdout).strip()[:300]}


def rm_prefix(prefix: str) -> dict:
    """``rm -rf`` the prefix, as a user would; again while writers still recreate what it removed (a user
    runs it again too), at most 5 times. ``existed``: whether there was anything to remove."""
    existed = os.path.lexists(prefix)
    tries = 0
    for tries in range(1, 6):
        done = subprocess.run(["rm", "-rf", prefix], capture_output=True, text=True, timeout=60)
        if not os.path.lexists(prefix):
            break
    return {"existed": existed, "tries": tries, "gone": not os.path.lexists(prefix),
            "stderr": done.stderr.strip()[-300:]}


def prune_all(prefix: str, how: str) -> dict:
    """Every committed generation removed while a run may be reading one: ``cachestore prune PREFIX --keep 0``
    in a process of its own (``how="cli"``), or ``Store.prune(keep=0)`` here (``"library"``).
    ``removed``: the generations it removed."""
    if how == "cli":
        script = Path(sys.executable).with_name("cachestore")  # the console script pip installed
        command = [str(script)] if script.exists() else [
            sys.executable, "-c", "import sys; from cachestore.cli import main; sys.exit(main(sys.argv[1:]))"]
        done = subprocess.run(command + ["prune", prefix, "--keep", "0"], capture_output=True, text=True, timeout=60)
        removed = sorted({int(w[4:]) for w in done.stdout.split() if w.startswith("gen-") and w[4:].isdigit()})
        return {"status": done.returncode, "removed": removed, "output": (done.stdout + done.stderr)[-600:]}
    if not os.path.exists(os.path.join(prefix, "store.json")):
        # Removed (rm -rf) and not written again yet: open_store would make a new (memmap) store there.
        return {"status": 0, "removed": [], "output": "no store at the prefix"}
    try:
        with open_store(prefix) as store:
            gone = store.prune(keep=0)
    except (CacheStoreError, OSError) as exc:
        return {"status": 1, "removed": [], "output": f"{type(exc).__name__}: {exc}"[:600]}
    return {"status": 0, "removed": sorted(r.generation for r in gone if r.kind == "generation"), "output": ""}
