"""Reading a committed memmap generation: the columns and segments mapped, batches gathered verified.

Every file is opened once, without following a symlink, and held open: a reader maps what it
opened, and before it reads through a mapping it checks (``fstat``) that the file still has the
bytes the read needs. A file truncated under an open generation (by anyone: a store is untrusted
input, docs/ARCHITECTURE.md, "Untrusted stores") would otherwise be a SIGBUS on the first page
beyond its new end, which kills the process. The compiled gather needs no such check: it catches
the SIGBUS itself (``cachestore/format/_gather.c``, "guard"), so a batch costs no system call; a file
cut in the middle of a read of the pure-Python paths is the one case left to the kernel. Views
handed out with ``copy=False`` are the caller's to read, and fault as any mapping does.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
from contextlib import contextmanager
from pathlib import Path
from typing import Callable, Iterator

import numpy as np
import numpy.typing as npt

from ..errors import CacheStoreError, CorruptSampleError, exhausted
from ..format import codec
from ..format.checksums import first_mismatch, flat_rows, row_checksums
from ..format.codec import Batch, Leaf, LeafSpec, Sample, TreeDef
from ..format.collate import stack_samples
from ..format.native import native_gather
from ..space.room import fits
from .batch import Indices, batch_indices, gather_columns
from .manifest import Manifest
from .memmap_files import (COLUMN, IndexRows, check_row, col_name, generation_schema, open_data, read_index,
                           read_shard_ids, record_leaves)
from .reading import BatchLayout, GenerationData

#: Rows gathered, then hashed, per block of a verified batch read: small enough to stay in this
#: core's L2 between the two, so the data crosses the memory bus once (gather), not twice.
VERIFY_BLOCK_BYTES = 1 << 20


def _map(fd: int, nbytes: int) -> mmap.mmap | None:
    """The first `nbytes` of the file `fd` mapped read-only (``None`` for none)."""
    return mmap.mmap(fd, nbytes, access=mmap.ACCESS_READ) if nbytes else None


def _random_access(mapped: mmap.mmap) -> None:
    """Tell the kernel that `mapped` is read at random (``MADV_RANDOM``: no read-ahead)."""
    if hasattr(mmap, "MADV_RANDOM"):
        mapped.madvise(mmap.MADV_RANDOM)


#: A column of at most this many bytes is gathered from its mapping even when the generation is read
#: explicitly: it stays in memory (a label, a few floats per sample), and a pread per row would cost more.
SMALL_COLUMN_BYTES = 64 << 20
IOV_MAX = 1024


def _pread_into(fd: int, dest: memoryview, offset: int, path: Path, drop: bool = True) -> None:
    """Fill `dest` from `offset` of `fd` (``pread`` releases the GIL), then drop those pages from the cache."""
    done = 0
    while done < len(dest):
        got = os.preadv(fd, [dest[done:]], offset + done)
        if got == 0:
            raise CorruptSampleError(f"data file {path} is truncated: no bytes at offset {offset + done}")
        done += got
    if drop and hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, offset, len(dest), os.POSIX_FADV_DONTNEED)


def _read_error(status: int, path: Path) -> Exception:
    """The error of a failed explicit read (`status`: an errno, or -1 for a file that ends too soon)."""
    if status < 0:
        return CorruptSampleError(f"data file {path} is truncated: it ends before a row it holds")
    return OSError(status, os.strerror(status), str(path))


def _preadv_all(fd: int, buffers: list[memoryview], offset: int, path: Path) -> None:
    """Fill `buffers`, one after the other, from `offset` of `fd` (``preadv``, at most ``IOV_MAX`` at a time)."""
    for lo in range(0, len(buffers), IOV_MAX):
        chunk = buffers[lo:lo + IOV_MAX]
        want = sum(len(b) for b in chunk)
        got = os.preadv(fd, chunk, offset)
        if got < want:  # a short read: finish each buffer it did not fill
            done = 0
            for buf in chunk:
                filled = min(max(got - done, 0), len(buf))
                if filled < len(buf):
                    _pread_into(fd, buf[filled:], offset + done + filled, path, drop=False)
                done += len(buf)
        offset += want


class MemmapGeneration(GenerationData):
    """A committed memmap generation: its index loaded, its columns and segments mapped."""

    # Read-only maps and arrays: a batch read touches no shared state.
    threadsafe_batches = True

    def __init__(self, gen_dir: Path, manifest: Manifest, verify: bool, allow_pickle: bool = False) -> None:
        super().__init__(int(manifest["generation"]), int(manifest["num_samples"]), str(gen_dir), verify,
                         allow_pickle)
        self.layout: str | None = manifest.get("layout")
        # Every file this reader holds open, and (fd, path, bytes reads need) of the columns and the
        # segments: what a read checks before it goes through a mapping (see the module docstring).
        self._held: list[int] = []
        self._col_files: list[tuple[int, Path, int]] = []
        self._seg_files: list[tuple[int, Path, int] | None] = []
        self._maps: list[mmap.mmap] = []
        # Explicit reads (read_range, read_rows) run in several threads at once (threadsafe_batches):
        # the count of reads in flight keeps close() from closing an fd under a read (a number the
        # next open reuses, read in its place).
        self._fds_lock = threading.Lock()
        self._reading = 0
        self._closed = False
        try:
            self._open_files(gen_dir, manifest)
        except (OSError, ValueError) as exc:  # a malformed, missing or symlinked file among them
            self._close_fds()
            if isinstance(exc, CorruptSampleError) or exhausted(exc):
                raise
            raise CorruptSampleError(f"generation {self.generation} in {gen_dir} cannot be read: {exc}") from None
        self._explicit: bool | None = None  # see reads_explicitly
        # The columns as rows of bytes, for the compiled gather.
        self._byte_rows = tuple(flat_rows(self.columns, self.num_samples))
        self._widths = tuple(r.shape[1] for r in self._byte_rows)
        self._mapped_in = False
        if not fits(self.data_bytes()):
            # Larger than the memory room: what is read through the mapping (records, compressed ones,
            # a torch DataLoader over reader()) faults one page in at a time. The kernel's read-ahead
            # around each fault (megabytes on some disks) is evicted before it is used, and read again.
            for mapped in self._maps:
                _random_access(mapped)

    def _open_files(self, gen_dir: Path, manifest: Manifest) -> None:
        """Open, check and map the generation's files (each a regular file, never through a symlink)."""
        shard_ids = read_shard_ids(gen_dir)
        rows = read_index(gen_dir / "index.npy", self.num_samples, len(shard_ids))
        self.schema: TreeDef | None = generation_schema(gen_dir, manifest)
        self.specs: list[LeafSpec] = codec.leaf_specs(self.schema) if self.schema is not None else []
        # Opening checked that a fixed generation has its schema (else it is damaged).
        self._fixed: BatchLayout | None = (
            (self.schema, self.specs) if self.layout == "fixed" and self.schema is not None else None)
        if self._fixed is not None:
            self.uniform_bytes = sum(codec.row_bytes(self.specs))
        # Every process that reads holds the index in its own memory (read, not mapped: a file of the
        # store may change after it was checked, see the module docstring). Where every row lies in
        # the columns only the checksums are read again: 8 of an index row's 48 bytes, 8 MiB rather
        # than 48 in each worker for a million samples (docs/ARCHITECTURE.md, "Memory with many workers").
        in_columns = self._fixed is not None and bool(np.all(rows["shard"] == COLUMN))
        self.rows: IndexRows | None = None if in_columns else rows
        self._sums: npt.NDArray[np.uint64] = np.ascontiguousarray(rows["checksum"]) if in_columns else rows["checksum"]
        self._col_paths = [gen_dir / col_name(k) for k in range(len(self.specs))]
        self.columns: list[Leaf] = []
        for path, (dtype, shape), width in zip(self._col_paths, self.specs, codec.row_bytes(self.specs)):
            fd = self._hold(path)
            nbytes = self.num_samples * width
            if os.fstat(fd).st_size < nbytes:
                raise CorruptSampleError(f"data file {path} is truncated: {os.fstat(fd).st_size} bytes, expected "
                                         f"{nbytes}; the generation is damaged (prune it and rewrite)")
            self._col_files.append((fd, path, nbytes))
            mapped = _map(fd, nbytes)
            if mapped is None:
                self.columns.append(np.zeros((self.num_samples, *shape), dtype=dtype))
                continue
            self._maps.append(mapped)
            count = self.num_samples * math.prod(shape)
            self.columns.append(np.frombuffer(mapped, dtype=dtype, count=count).reshape(self.num_samples, *shape))
        self.segments: list[npt.NDArray[np.uint8] | None] = []
        for shard_id in shard_ids:
            path = gen_dir / f"{shard_id}.seg"
            try:
                fd = self._hold(path)
            except FileNotFoundError:
                fd = -1
            size = os.fstat(fd).st_size if fd >= 0 else 0
            mapped = _map(fd, size) if size else None
            self._seg_files.append((fd, path, size) if mapped is not None else None)
            if mapped is not None:
                self._maps.append(mapped)
            self.segments.append(np.frombuffer(mapped, dtype=np.uint8) if mapped is not None else None)

    def _hold(self, path: Path) -> int:
        """Open the generation's file `path` (see :func:`open_data`) until close()."""
        fd = open_data(path)
        self._held.append(fd)
        return fd

    def _check_file(self, fd: int, path: Path, needed: int) -> None:
        """Raise unless the file `fd` (this generation's `path`) still holds `needed` bytes: reading
        a mapping beyond the end of its file is a SIGBUS."""
        if self._closed:
            raise CacheStoreError(f"generation {self.generation} in {self.where} was closed")
        size = os.fstat(fd).st_size
        if size < needed:
            exc = CorruptSampleError(
                f"data file {path} of generation {self.generation} shrank to {size} bytes under this reader "
                f"({needed} were there when it was opened): it was truncated or overwritten in place; "
                f"the generation is damaged (`cachestore prune` removes it)")
            exc.generation = self.generation
            raise exc

    def _check_columns(self) -> None:
        for fd, path, needed in self._col_files:
            self._check_file(fd, path, needed)

    def _fault(self) -> CorruptSampleError:
        """The error of a read the compiled gather broke off at a SIGBUS: the file it names."""
        self._check_columns()  # raises, naming the file that shrank
        exc = CorruptSampleError(f"a page of generation {self.generation} in {self.where} could not be read "
                                 "(SIGBUS): one of its files was truncated under this reader")
        exc.generation = self.generation
        return exc

    def _record(self, i: int, row: np.void) -> npt.NDArray[np.uint8]:
        shard = int(row["shard"])  # one of the shards listed: checked when the index was read
        seg, held = self.segments[shard], self._seg_files[shard]
        start, length = int(row["offset"]), int(row["length"])
        if seg is None or held is None or start + length > seg.size:
            raise self.corrupt(i, "its record lies beyond the end of the data file (truncated?)")
        self._check_file(held[0], held[1], start + length)
        return seg[start:start + length]

    def _leaves(self, i: int, copy: bool, verify: bool) -> tuple[TreeDef, list[Leaf]]:
        """Sample `i` as ``(treedef, leaves)``, its checksum checked when `verify` (never unpickled)."""
        row = self.rows[i] if self.rows is not None else None
        if row is not None and row["shard"] != COLUMN:
            return record_leaves(self, i, self._record(i, row), row, verify, copy)
        if self.schema is None:
            raise self.corrupt(i, "its index row names the columns, which this generation does not have")
        self._check_columns()
        leaves = [col[i, ...] for col in self.columns]
        if verify:
            check_row(self, i, leaves, int(self._sums[i]))
        return self.schema, [np.array(leaf) for leaf in leaves] if copy else leaves

    def read(self, index: int, copy: bool = True) -> Sample:
        i = self.check_index(index)
        return self.sample(i, *self._leaves(i, copy, self.verify))

    def check(self, index: int) -> None:
        self._leaves(self.check_index(index), False, True)

    def verify_all(self) -> list[CorruptSampleError]:
        """Every checksum, a fixed layout's rows gathered a block at a time (far fewer calls than
        one sample at a time)."""
        if self._fixed is None or self._closed:
            return super().verify_all()
        bad: list[CorruptSampleError] = []
        block = max(1, VERIFY_BLOCK_BYTES * 4 // max(1, sum(self._widths)))
        scratch = [np.empty((block, *shape), dtype=dtype) for dtype, shape in self.specs]
        start = 0
        while start < self.num_samples:
            stop = min(self.num_samples, start + block)
            try:
                self._gather_verified(np.arange(start, stop, dtype=np.int64), [a[:stop - start] for a in scratch])
                start = stop
            except CorruptSampleError as exc:
                bad.append(exc)
                if exc.index is None:
                    break  # a file shrank: the generation, not a sample
                start = exc.index + 1
        return bad

    def batch_layout(self) -> BatchLayout | None:
        return self._fixed

    def data_bytes(self) -> int:
        return sum(c.nbytes for c in self._byte_rows) + sum(s.nbytes for s in self.segments if s is not None)

    def reads_explicitly(self) -> bool:
        if self._explicit is None:
            self._explicit = self._fixed is not None and not fits(self.data_bytes())
        return self._explicit

    def read_range(self, start: int, stop: int, out: list[Leaf]) -> None:
        """One ``pread`` per column, into `out`, then every row verified (see the base class).

        Why not the mapping: a page that is not in memory costs a fault per 4 KiB touched, and the
        kernel reads ahead little for a fault; a large ``pread`` goes to the disk at its speed.
        The pages read are dropped from the page cache at once (``POSIX_FADV_DONTNEED``): a
        generation that does not fit memory would only push out what the process needs.
        """
        if self._fixed is None:
            raise ValueError("read_range needs a fixed-layout generation")
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"range {start}..{stop} out of generation {self.generation} of {self.num_samples} samples")
        n = stop - start
        rows = flat_rows(out, n)
        with self._open_columns() as column_fd:
            for k, (dest, width) in enumerate(zip(rows, self._widths)):
                if width and n:
                    _pread_into(column_fd(k), dest.reshape(-1).data, start * width, self._col_paths[k])
        if self.verify and n:
            first = first_mismatch(row_checksums(rows, n), self._sums[start:stop].tolist())
            if first is not None:
                raise self.corrupt(start + first, "checksum mismatch")

    def read_rows(self, indices: np.ndarray, out: list[Leaf]) -> None:
        """Rows `indices` into `out` with ``pread`` s of runs of consecutive rows (a column small
        enough to stay in memory is gathered from its mapping), every row verified."""
        if self._fixed is None:
            raise ValueError("read_rows needs a fixed-layout generation")
        idx = batch_indices(indices, self.num_samples, self.generation)
        n = idx.size
        rows = flat_rows(out, n)
        sort = np.argsort(idx, kind="stable")
        ordered = idx[sort]
        # Runs of consecutive rows: [starts[r], ends[r]) of `ordered`.
        breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, n]
        native = native_gather()
        with self._open_columns() as column_fd:
            for k, (dest, width) in enumerate(zip(rows, self._widths)):
                if not width or not n:
                    continue
                if self._byte_rows[k].nbytes <= SMALL_COLUMN_BYTES:
                    self._check_file(*self._col_files[k])
                    np.take(self._byte_rows[k], idx, axis=0, out=dest)
                    continue
                fd = column_fd(k)
                if native is not None:
                    # One call, the GIL released: for rows at random, the Python loop below spends
                    # much of its time around the reads, holding the GIL other reading threads need.
                    status = native.pread_rows(fd, dest, width, ordered, sort.astype(np.int64))
                    if status:
                        raise _read_error(status, self._col_paths[k])
                    continue
                for a, b in zip(starts.tolist(), ends.tolist()):
                    buffers = [dest[j].data for j in sort[a:b].tolist()]
                    _preadv_all(fd, buffers, int(ordered[a]) * width, self._col_paths[k])
        if self.verify and n:
            first = first_mismatch(row_checksums(rows, n), self._sums[idx].tolist())
            if first is not None:
                raise self.corrupt(int(idx[first]), "checksum mismatch")

    @contextmanager
    def _open_columns(self) -> Iterator[Callable[[int], int]]:
        """Count an explicit read in flight while it runs; it gets the fd of column ``k`` from the
        function this yields. Its fds stay open until it is done, whenever close() comes."""
        with self._fds_lock:
            if self._closed:
                raise CacheStoreError(f"generation {self.generation} in {self.where} was closed")
            self._reading += 1
        try:
            yield self._fd
        finally:
            self._done_reading()

    def _done_reading(self) -> None:
        """An explicit read ended: the last one after close() closes the fds."""
        with self._fds_lock:
            self._reading -= 1
            if self._closed and not self._reading:
                self._close_fds()

    def _fd(self, k: int) -> int:
        """The fd of column `k` (held since the generation was opened)."""
        return self._col_files[k][0]

    def _close_fds(self) -> None:
        """Close the files (the caller holds the lock, and no read is in flight)."""
        held, self._held = self._held, []
        for fd in held:
            os.close(fd)

    def read_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        if self._fixed is None:
            if out is not None:
                raise ValueError("out= is only supported for generations with a fixed layout")
            return stack_samples([self.read(i, copy=False) for i in indices])
        idx = batch_indices(indices, self.num_samples, self.generation)
        if not self._mapped_in:
            self._map_in()
        if self.verify:
            out = self._gather_verified(idx, out)
        else:
            self._check_columns()
            out = gather_columns(self.columns, self.specs, idx, out)
        return codec.unflatten_batch(self._fixed[0], out)

    def _map_in(self) -> None:
        """Map every page of the columns into this process, once, before its first batch read.

        Batch reads go over the whole generation, and a page touched for the first time in a
        process costs a fault there (each worker's, the training process's), which slowed the
        first read epoch; mapped in one call (``MADV_POPULATE_READ``), it reads at full speed
        from the start. Only for a generation that fits the memory room (:mod:`cachestore.space.room`):
        a larger one would be read from disk up front, and thrash.
        """
        self._mapped_in = True
        native = native_gather()
        if native is None or not fits(sum(c.nbytes for c in self._byte_rows)):
            return
        for col in self._byte_rows:
            if col.size:
                native.populate(col)

    def _gather_verified(self, idx: npt.NDArray[np.int64], out: list[Leaf] | None) -> list[Leaf]:
        """Gather rows `idx` into `out` and check each row's checksum, block by block.

        A block (``VERIFY_BLOCK_BYTES``) is gathered, then hashed while it is still in cache:
        gathering the whole batch first and hashing it after read every byte from memory twice
        (a batch of megabytes does not fit in cache).
        """
        n = idx.size
        if out is None:
            out = [np.empty((n, *shape), dtype=dtype) for dtype, shape in self.specs]
        rows = flat_rows(out, n)
        native = native_gather()
        if native is not None and len(rows) <= native.MAX_LEAVES:
            # One call per batch, the GIL released: gather threads run side by side.
            if self._closed:
                raise CacheStoreError(f"generation {self.generation} in {self.where} was closed")
            bad = native.gather_verified(self._byte_rows, self._widths, np.ascontiguousarray(idx),
                                         tuple(rows), self._sums[idx])
            if bad == -2:
                raise self._fault()
            if bad >= 0:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")
            return out
        self._check_columns()
        expected = self._sums[idx].tolist()
        block = max(1, VERIFY_BLOCK_BYTES // max(1, sum(r.shape[1] for r in rows)))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            gather_columns(self.columns, self.specs, idx[lo:hi], [dest[lo:hi] for dest in out])
            first = first_mismatch(row_checksums([r[lo:hi] for r in rows], hi - lo), expected[lo:hi])
            if first is not None:
                raise self.corrupt(int(idx[lo + first]), "checksum mismatch")
        return out

    def close(self) -> None:
        with self._fds_lock:
            self._closed = True
            if not self._reading:
                self._close_fds()  # else the last read in flight closes them
        self.columns = []
        self._byte_rows = ()
        self.segments = []
        self._maps = []
