"""The files of a memmap generation or staging area, and how they are named and read.

Inside a generation directory:

* ``schema.json`` + ``col-K.bin`` - the fixed-record, columnar layout. The
  first shard to write a sample whose leaves are all stackable claims the
  schema (``link(2)`` of a temp file: exactly one process wins). Every sample
  with that same structure goes to row ``index`` of one file per leaf,
  written with ``pwrite`` (an ``ENOSPC`` is an exception there; through a
  shared mapping it would be a SIGBUS). A batch read is then one gather per
  leaf straight into the caller's buffer.
* ``<shard>.seg`` - append-only records (see :mod:`cachestore.format.codec`) for
  samples of any other structure, and for every sample when compressed.
* ``<shard>.idx`` - one :data:`INDEX_DTYPE` row per sample a shard wrote,
  appended after the data at each flush. A writer killed mid-flush leaves at
  most a partial trailing row, which is ignored.
* ``index.npy`` / ``shards.json`` - written at commit: rows ordered by index.

Reading a committed generation opens each of them without following a symlink and only as
a regular file, and checks what it holds before it is used (:mod:`cachestore.guard.untrusted`):
a store is untrusted input (docs/ARCHITECTURE.md, "Untrusted stores"). The parsing of the
index and the schema and the decoding of a row work on bytes (:func:`index_start`,
:func:`index_rows`, :func:`schema_of`, :func:`record_leaves`), so the same code reads a
generation by byte ranges of objects on a remote (:mod:`.memmap_ranges`).
"""

from __future__ import annotations

import errno
import mmap
import os
import stat
import threading
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Generator

import numpy as np
import numpy.typing as npt

from ..errors import CorruptSampleError, MalformedFileError
from ..format import codec, records
from ..format.checksums import checksum
from ..format.codec import Leaf, TreeDef
from ..format.structure import parse_treedef
from ..guard import safefs, untrusted
from .manifest import MANIFEST_NAME, Manifest
from .reading import GenerationData

#: One row per sample: where its bytes lie (a shard's segment, or the columns) and their checksum.
INDEX_DTYPE = np.dtype([("index", "<i8"), ("shard", "<i4"), ("pad", "<i4"), ("offset", "<i8"),
                        ("length", "<i8"), ("checksum", "<u8"), ("raw", "<i8")])
COLUMN = -1  # shard value of a row stored in the columns
SCHEMA = "schema.json"
#: The bytes a ``schema.json`` may take (a sample's structure).
SCHEMA_BYTES = 4 << 20

#: Rows of :data:`INDEX_DTYPE`.
IndexRows = npt.NDArray[np.void]

if TYPE_CHECKING:
    from ..format.native import Bytes


def col_name(k: int) -> str:
    """The file of leaf `k`'s column."""
    return f"col-{k}.bin"


def load_schema(directory: Path) -> TreeDef | None:
    """The treedef the columns of `directory` hold, ``None`` when no shard claimed one.

    Raises
    ------
    MalformedFileError
        ``schema.json`` is no structure a shard writes (not JSON, a bad node, leaves that are
        not stacked in columns), naming it.
    """
    path = directory / SCHEMA
    try:
        return schema_of(untrusted.read_document(path, "a generation schema", SCHEMA_BYTES), str(path))
    except FileNotFoundError:
        return None


def schema_of(obj: object, where: str) -> TreeDef:
    """The structure a ``schema.json`` (`obj`, as parsed, read from `where`) gives the columns.

    Raises
    ------
    MalformedFileError
        It is no structure a shard writes: a bad node, or leaves that are not stacked in columns.
    """
    schema = parse_treedef(obj, where)
    if not codec.is_stackable(schema):
        raise MalformedFileError(f"{where} names leaves that are not stacked in columns (str, bytes or None)")
    return schema


def generation_schema(directory: Path, manifest: Manifest) -> TreeDef | None:
    """The structure of the samples in the columns of the committed generation `directory`.

    It is the one its manifest recorded at commit, under the manifest's checksum, and
    ``schema.json`` must say the same: a schema changed alone (``<f4`` made ``<i4``, a shape
    halved for ``>f8``) would serve the same checked bytes as other values. A generation
    committed before manifests recorded it has only ``schema.json``.

    Raises
    ------
    MalformedFileError
        ``schema.json`` is malformed, or differs from the manifest's.
    """
    on_disk = load_schema(directory)
    if manifest.get("schema") is None:
        return on_disk
    recorded = parse_treedef(manifest["schema"], f"{directory / MANIFEST_NAME} ('schema')")
    if on_disk != recorded:
        raise MalformedFileError(f"{directory / SCHEMA} does not match the schema the manifest recorded "
                                 "at commit: it was changed since (its values would be read as another type)")
    return recorded


def read_rows(path: Path) -> IndexRows:
    """The index rows of a shard's ``.idx`` file (a half-written last row left out)."""
    data = safefs.read_bytes(path)
    usable = len(data) - len(data) % INDEX_DTYPE.itemsize  # a killed writer may leave half a row
    return np.frombuffer(data[:usable], dtype=INDEX_DTYPE)


def iter_rows(path: Path, rows: int) -> Generator[IndexRows, None, None]:
    """The index rows of a shard's ``.idx`` file, at most `rows` at a time, as :func:`read_rows` reads them
    (a half-written last row left out) but never the whole file in memory at once: a commit merges the
    shards' indexes a range of samples at a time (``MemmapBackend._finalize``)."""
    fd = safefs.open_nofollow(path, os.O_RDONLY)
    try:
        rest = b""
        while chunk := os.read(fd, rows * INDEX_DTYPE.itemsize):
            data = rest + chunk
            usable = len(data) - len(data) % INDEX_DTYPE.itemsize
            rest = data[usable:]
            if usable:
                yield np.frombuffer(data, dtype=INDEX_DTYPE, count=usable // INDEX_DTYPE.itemsize)
    finally:
        os.close(fd)


def truncate(path: Path, size: int) -> None:
    """Cut the store-owned file `path` to `size` bytes (never through a symlink)."""
    fd = safefs.open_nofollow(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def open_data(path: Path) -> int:
    """A read-only fd of the generation's file `path`: never through a symlink, only a regular file.

    Raises
    ------
    FileNotFoundError
        Nothing is there.
    SymlinkError
        `path` is a symlink.
    MalformedFileError
        It is something else than a regular file (a fifo would block a reader forever).
    """
    fd = safefs.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise MalformedFileError(f"{path} is not a regular file")
    return fd


#: numpy parses a header with ``ast.literal_eval``, and CPython 3.11's parser fails when two threads
#: parse at once ("SystemError: AST constructor recursion depth mismatch": a publishing thread listing
#: generations beside the loop): one header at a time.
_HEADERS = threading.Lock()


def index_start(f: BinaryIO, size: int, path: Path | str, num_samples: int) -> int:
    """Where the rows of the index file `f` (of `size` bytes, read from `path`: a file, or the bytes
    of one) begin, once its header and size are checked against the `num_samples` rows its
    manifest promises (:class:`MalformedFileError` else)."""
    try:
        version = np.lib.format.read_magic(f)
        read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                       else np.lib.format.read_array_header_2_0)
        with _HEADERS:
            shape, _, dtype = read_header(f)
    except (ValueError, OSError, SyntaxError, TypeError, KeyError) as exc:
        raise MalformedFileError(f"{path} is unreadable ({exc})") from None
    start = f.tell()
    if dtype != INDEX_DTYPE or len(shape) != 1:
        raise MalformedFileError(f"{path} is not an index of this format (dtype {dtype}, shape {shape})")
    if shape[0] != num_samples:
        raise MalformedFileError(f"{path} holds {shape[0]} rows but the manifest says {num_samples} samples")
    if size < start + num_samples * INDEX_DTYPE.itemsize:
        raise MalformedFileError(f"{path} is truncated: {size} bytes, {num_samples} rows need "
                                 f"{start + num_samples * INDEX_DTYPE.itemsize}")
    return start


def check_index(path: Path, num_samples: int) -> None:
    """Check the header and size of the index file `path` (no rows read: listing runs this)."""
    fd = open_data(path)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            index_start(f, os.fstat(fd).st_size, path, num_samples)
    finally:
        os.close(fd)


def read_index(path: Path, num_samples: int, num_shards: int) -> IndexRows:
    """The `num_samples` rows of the index file `path`, each checked
    (:func:`cachestore.guard.untrusted.check_index_rows`) against the `num_shards` shards listed."""
    fd = open_data(path)
    nbytes = num_samples * INDEX_DTYPE.itemsize
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            start = index_start(f, os.fstat(fd).st_size, path, num_samples)
        data = _read_mapped(fd, nbytes, start)
    finally:
        os.close(fd)
    return index_rows(data, num_samples, num_shards, path)


def index_rows(data: bytes | memoryview | mmap.mmap, num_samples: int, num_shards: int, path: Path | str,
               first: int = 0) -> IndexRows:
    """The rows of samples ``first..first + num_samples - 1`` that `data` (read from `path`) holds,
    read-only, each checked (:func:`cachestore.guard.untrusted.check_index_rows`) against the
    `num_shards` shards listed."""
    rows: IndexRows = np.frombuffer(data, dtype=INDEX_DTYPE, count=len(data) // INDEX_DTYPE.itemsize)
    rows.flags.writeable = False
    if len(rows) != num_samples:
        raise MalformedFileError(f"{path} is truncated: it ended while its rows were read")
    untrusted.check_index_rows(rows, num_samples, num_shards, str(path), first)
    return rows


def _read_mapped(fd: int, nbytes: int, offset: int) -> mmap.mmap | bytes:
    """`nbytes` of `fd` from `offset` (fewer where the file ends first), into an anonymous mapping.

    Not a bytes object: a reader that keeps a part of the index frees the rest, and memory the C heap
    held would stay with the process, and with every worker forked from it, each writing its own copy
    of those pages as it allocates (docs/ARCHITECTURE.md, "Memory with many workers"); a mapping goes
    back to the system when it is freed."""
    if not nbytes:
        return b""
    buf = mmap.mmap(-1, nbytes)
    view = memoryview(buf)
    got = 0
    try:
        while got < nbytes:
            n = os.preadv(fd, [view[got:]], offset + got)
            if n <= 0:
                break
            got += n
    finally:
        view.release()
    if got < nbytes:
        return buf[:got]
    return buf


def read_shard_ids(directory: Path) -> list[str]:
    """The shards of a committed generation (``shards.json``), each a file name of the store."""
    path = directory / "shards.json"
    return untrusted.parse_shard_ids(untrusted.read_document(path, "a generation's shard list"), str(path))


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


def record_leaves(data: GenerationData, i: int, rec: Bytes, row: np.void, verify: bool,
                  copy: bool) -> tuple[TreeDef, list[Leaf]]:
    """Sample `i` of `data` as ``(treedef, leaves)`` from its record `rec` (its index row: `row`),
    its checksum checked when `verify`; decompressed no further than the row's raw size and the
    generation's bound (never unpickled)."""
    if verify and checksum([rec]) != row["checksum"]:
        raise data.corrupt(i, "checksum mismatch")
    try:
        return records.decode_record(rec, copy=copy, raw=int(row["raw"]), limit=data.max_sample_bytes)
    except CorruptSampleError as exc:
        if exc.index is not None or exc.generation is not None:
            raise
        raise data.corrupt(i, str(exc)) from None


def check_row(data: GenerationData, i: int, leaves: list[Leaf], expected: int) -> None:
    """Raise unless the leaves of sample `i` of `data` (a row of its columns) have its checksum."""
    if checksum(leaves) != expected:
        raise data.corrupt(i, "checksum mismatch")

