"""The files of a memmap generation or staging area, and how they are named and read.

Inside a generation directory:

* ``schema.json`` + ``col-K.bin`` - the fixed-record, columnar layout. The
  first shard to write a sample whose leaves are all stackable claims the
  schema (``link(2)`` of a temp file: exactly one process wins). Every sample
  with that same structure goes to row ``index`` of one file per leaf,
  written with ``pwrite`` (an ``ENOSPC`` is an exception there; through a
  shared mapping it would be a SIGBUS). A batch read is then one gather per
  leaf straight into the caller's buffer.
* ``<shard>.seg`` - append-only records (see :mod:`cachestore.codec`) for
  samples of any other structure, and for every sample when compressed.
* ``<shard>.idx`` - one :data:`INDEX_DTYPE` row per sample a shard wrote,
  appended after the data at each flush. A writer killed mid-flush leaves at
  most a partial trailing row, which is ignored.
* ``index.npy`` / ``shards.json`` - written at commit: rows ordered by index.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import numpy.typing as npt

from .. import codec, safefs
from ..codec import TreeDef

#: One row per sample: where its bytes lie (a shard's segment, or the columns) and their checksum.
INDEX_DTYPE = np.dtype([("index", "<i8"), ("shard", "<i4"), ("pad", "<i4"), ("offset", "<i8"),
                        ("length", "<i8"), ("checksum", "<u8"), ("raw", "<i8")])
COLUMN = -1  # shard value of a row stored in the columns
SCHEMA = "schema.json"

#: Rows of :data:`INDEX_DTYPE`.
IndexRows = npt.NDArray[np.void]


def col_name(k: int) -> str:
    """The file of leaf `k`'s column."""
    return f"col-{k}.bin"


def load_schema(directory: Path) -> TreeDef | None:
    """The treedef the columns of `directory` hold, ``None`` when no shard claimed one."""
    try:
        return codec.treedef_from_json(safefs.read_json(directory / SCHEMA, "a generation schema"))
    except FileNotFoundError:
        return None


def read_rows(path: Path) -> IndexRows:
    """The index rows of a shard's ``.idx`` file (a half-written last row left out)."""
    data = safefs.read_bytes(path)
    usable = len(data) - len(data) % INDEX_DTYPE.itemsize  # a killed writer may leave half a row
    return np.frombuffer(data[:usable], dtype=INDEX_DTYPE)


def truncate(path: Path, size: int) -> None:
    """Cut the store-owned file `path` to `size` bytes (never through a symlink)."""
    fd = safefs.open_nofollow(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def reserve(path: Path, size: int) -> None:
    """Make the column `path` `size` bytes long with every block allocated.

    Rows of samples kept in segments (a mixed generation) are holes in the column; readers map it, and
    on tmpfs even a read of a hole through a mapping takes a block: on a full file system, a SIGBUS.
    Allocated at commit, a full disk is an ``ENOSPC`` here instead (the commit's out-of-space path).
    """
    fd = safefs.open_nofollow(path, os.O_RDWR)
    try:
        os.ftruncate(fd, size)
        if size:
            try:
                os.posix_fallocate(fd, 0, size)
            except OSError as exc:
                if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
    finally:
        os.close(fd)
