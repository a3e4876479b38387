"""Writing one shard of a memmap staging area (the files are described in :mod:`.memmap_files`).

Every process (a loader worker, the owner) writes its own shard: rows of the shared
columns with ``pwrite`` for samples of the claimed schema, records appended to its own
segment for the others, and an index row per sample, appended after the data at each flush.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable, cast

import numpy as np

from ..errors import BudgetExceededError, MalformedFileError
from ..format import codec, records
from ..format.checksums import checksum
from ..format.codec import Leaf, TreeDef
from ..format.structure import parse_treedef
from ..guard import safefs, untrusted
from ..space.disk import allocated_bytes, is_out_of_space, out_of_space
from ..space.room import fits
from .base import ShardWriter, StagingToken
from .memmap_files import COLUMN, INDEX_DTYPE, SCHEMA, SCHEMA_BYTES, col_name

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from ..format.native import Bytes

#: A shard of a generation larger than the memory room writes its pages back after this many bytes.
WRITEBACK_BYTES = 64 << 20
_SYNC_FILE_RANGE_WAIT_BEFORE, _SYNC_FILE_RANGE_WRITE, _SYNC_FILE_RANGE_WAIT_AFTER = 1, 2, 4


def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's ``sync_file_range`` (Linux), or ``None``."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        function = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    return cast(Callable[[int, int, int, int], int], function)


_SYNC = _sync_file_range()


def write_back(fd: int) -> None:
    """Write the dirty pages of `fd` to disk now and drop them from the page cache.

    Why: a generation larger than memory filled the page cache with dirty pages faster than the
    kernel wrote them back, and writing became a crawl of reclaim and writeback stalls (worse in
    a memory-limited container). Written back in chunks as it goes, its pages stay few.
    """
    if _SYNC is not None:
        _SYNC(fd, 0, 0, _SYNC_FILE_RANGE_WAIT_BEFORE | _SYNC_FILE_RANGE_WRITE | _SYNC_FILE_RANGE_WAIT_AFTER)
    else:
        os.fdatasync(fd)
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)


def _write_all(fd: int, data: Bytes, offset: int | None = None, close: bool = False) -> None:
    """Write all of `data` (and close `fd` after, with `close`): a regular file takes a short write when the
    disk fills, and only the next call reports ``ENOSPC``; ignoring the count loses bytes silently."""
    try:
        view = memoryview(cast("ReadableBuffer", data)).cast("B")
        while view:
            n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
            view = view[n:]
            if offset is not None:
                offset += n
    finally:
        if close:
            os.close(fd)


class MemmapShard(ShardWriter):
    """Writes one shard of a memmap staging area: rows of the columns, or records of its segment."""

    def __init__(self, token: StagingToken, shard_id: str) -> None:
        super().__init__(token.generation, token.write_budget(), token.num_samples, token.compress,
                         token.allow_pickle)
        self.dir = Path(token.path)
        self.shard_id = shard_id
        self._schema: TreeDef | None = None
        self._schema_checked = False
        self._cols: list[tuple[int, int]] = []  # (fd, row bytes)
        self._seg_fd: int | None = None
        self._seg_end = 0
        # Every file is opened relative to the staging area as it was when the shard opened: a shard whose
        # area was removed under it (a commit that failed half way) and made again by other processes
        # writes nothing into the new one (its columns are opened at the first sample, by name).
        self._dir_fd = safefs.open_nofollow(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            self._idx_fd = self._open(f"{shard_id}.idx", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        except BaseException as exc:
            os.close(self._dir_fd)
            if is_out_of_space(exc):
                raise out_of_space(exc, f"opening shard {shard_id}", self.dir) from exc
            raise
        # Whether the generation outgrows the memory room (decided at the first sample), and the
        # bytes written since the last write-back.
        self._streaming: bool | None = None
        self._unsynced = 0
        self._rows: list[tuple[int, int, int, int, int, int, int]] = []

    def _open(self, name: str, flags: int) -> int:
        """Open `name` of this shard's staging area (never through a symlink, only a regular file)."""
        return safefs.open_at(self._dir_fd, name, flags, self.dir, mode=0o644)

    def _load_schema(self) -> TreeDef | None:
        """The treedef the columns of this shard's area hold, ``None`` when no shard claimed one (checked as
        :func:`.memmap_files.load_schema` checks it: another process wrote it)."""
        try:
            fd = self._open(SCHEMA, os.O_RDONLY)
        except FileNotFoundError:
            return None
        try:
            data = os.pread(fd, SCHEMA_BYTES + 1, 0)
        finally:
            os.close(fd)
        where = str(self.dir / SCHEMA)
        schema = parse_treedef(untrusted.parse_json(data, where, SCHEMA_BYTES), where)
        if not codec.is_stackable(schema):
            raise MalformedFileError(f"{where} names leaves that are not stacked in columns (str, bytes or None)")
        return schema

    def _claim_schema(self, treedef: TreeDef) -> None:
        self._schema_checked = True
        schema = self._load_schema()
        if schema is None and not self.compress and codec.is_stackable(treedef) and codec.leaf_specs(treedef):
            tmp = f".schema-{self.shard_id}.tmp"
            with contextlib.suppress(FileNotFoundError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            try:
                _write_all(self._open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL),
                           json.dumps(codec.treedef_to_json(treedef)).encode(), close=True)
                with contextlib.suppress(FileExistsError):  # another shard claimed it first
                    os.link(tmp, SCHEMA, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd, follow_symlinks=False)
            finally:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(tmp, dir_fd=self._dir_fd)
            schema = self._load_schema()
        if schema is None or self.compress:
            return
        self._schema = schema
        for k, rowbytes in enumerate(codec.row_bytes(codec.leaf_specs(schema))):
            fd = self._open(col_name(k), os.O_RDWR | os.O_CREAT)
            self._cols.append((fd, rowbytes))

    def _write(self, index: int, treedef: TreeDef, leaves: list[Leaf]) -> int:
        try:
            if not self._schema_checked:
                self._claim_schema(treedef)
            if treedef == self._schema:
                for (fd, rowbytes), leaf in zip(self._cols, leaves):
                    if rowbytes:
                        _write_all(fd, codec.leaf_bytes(leaf), index * rowbytes)
                nbytes = sum(r for _, r in self._cols)
                self._rows.append((index, COLUMN, 0, 0, nbytes, checksum(leaves), nbytes))
                self._written(nbytes)
                return nbytes
            record = records.encode_record(treedef, leaves, self.compress)
            if self._seg_fd is None:
                self._seg_fd = self._open(f"{self.shard_id}.seg", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                self._seg_end = os.fstat(self._seg_fd).st_size  # a shard reopened after a close appends
            _write_all(self._seg_fd, record)
            self._rows.append((index, 0, 0, self._seg_end, len(record), checksum([record]),
                               sum(leaf.nbytes for leaf in leaves)))
            self._seg_end += len(record)
            self._written(len(record))
            return len(record)
        except OSError as exc:
            if is_out_of_space(exc):
                raise BudgetExceededError(f"disk full while writing generation {self.generation} "
                                          f"into {self.dir}: {exc}") from exc
            raise

    def _written(self, nbytes: int) -> None:
        """Count `nbytes` written; past :data:`WRITEBACK_BYTES`, a generation that outgrows the memory
        room has its pages written back and dropped (:func:`write_back`)."""
        if self._streaming is None:
            self._streaming = self.num_samples is not None and not fits(nbytes * self.num_samples)
        if not self._streaming:
            return
        self._unsynced += nbytes
        if self._unsynced >= WRITEBACK_BYTES:
            self._unsynced = 0
            for fd in [fd for fd, _ in self._cols] + ([self._seg_fd] if self._seg_fd is not None else []):
                write_back(fd)

    def _flush(self) -> None:
        if not self._rows:
            return
        rows = np.array(self._rows, dtype=INDEX_DTYPE)
        self._rows = []
        try:
            _write_all(self._idx_fd, rows.tobytes())
        except OSError as exc:
            if is_out_of_space(exc):
                raise BudgetExceededError(f"disk full while writing {self.dir}: {exc}") from exc
            raise

    def _close(self) -> None:
        fds = [fd for fd, _ in self._cols] + [fd for fd in (self._seg_fd, self._idx_fd) if fd is not None]
        for fd in fds:
            # Written to disk by the process that wrote them (a worker, or a background refresh's
            # spare time), so the commit's own fsync in the training process finds little left to
            # do: otherwise it was most of a refresh commit, which the training loop waits for.
            # Durability is the commit's job: an error here is reported by its fsync.
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
        self._cols = []
        self._seg_fd = None
        os.close(self._dir_fd)

    def usage(self) -> int:
        return allocated_bytes(self.dir)
