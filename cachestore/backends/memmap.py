"""The default backend: plain files, memory-mapped for reading.

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
import json
import os
import stat
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import psutil

from .. import codec, safefs
from ..collate import stack_samples
from ..disk import allocated_bytes
from ..errors import BudgetExceededError, CacheStoreError, CorruptSampleError
from ..checksums import checksum, first_mismatch, flat_rows, row_checksums
from ..native import native_gather
from ..safefs import fsync_dir
from .base import GenerationData, ShardWriter, StagingData, StagingToken
from .batch import batch_indices, gather_columns
from .directory import DirectoryBackend
from .staging import check_complete

INDEX_DTYPE = np.dtype([("index", "<i8"), ("shard", "<i4"), ("pad", "<i4"), ("offset", "<i8"),
                        ("length", "<i8"), ("checksum", "<u8"), ("raw", "<i8")])
COLUMN = -1  # shard value of a row stored in the columns
SCHEMA = "schema.json"
_NO_SPACE = (errno.ENOSPC, errno.EDQUOT)
#: Rows gathered, then hashed, per block of a verified batch read: small enough to stay in this
#: core's L2 between the two, so the data crosses the memory bus once (gather), not twice.
VERIFY_BLOCK_BYTES = 1 << 20


def _write_all(fd: int, data: Any, offset: int | None = None) -> None:
    """Write all of `data`: a regular file takes a short write when the disk fills,
    and only the next call reports ``ENOSPC``; ignoring the count loses bytes silently."""
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view) if offset is None else os.pwrite(fd, view, offset)
        view = view[n:]
        if offset is not None:
            offset += n


def _col_name(k: int) -> str:
    return f"col-{k}.bin"


def _load_schema(staging: Path) -> tuple | None:
    try:
        return codec.treedef_from_json(safefs.read_json(staging / SCHEMA, "a generation schema"))
    except FileNotFoundError:
        return None


class MemmapShard(ShardWriter):
    def __init__(self, token: StagingToken, shard_id: str) -> None:
        super().__init__(token.generation, token.budget, token.num_samples, token.compress, token.allow_pickle)
        self.dir = Path(token.path)
        self.shard_id = shard_id
        self._schema: tuple | None = None
        self._schema_checked = False
        self._cols: list[tuple[int, int]] = []  # (fd, row bytes)
        self._seg_fd: int | None = None
        self._seg_end = 0
        self._idx_fd = safefs.open_nofollow(self.dir / f"{shard_id}.idx", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
        self._rows: list[tuple] = []

    def _claim_schema(self, treedef: tuple) -> None:
        self._schema_checked = True
        schema = _load_schema(self.dir)
        if schema is None and not self.compress and codec.is_stackable(treedef) and codec.leaf_specs(treedef):
            tmp = self.dir / f".schema-{self.shard_id}.tmp"
            safefs.write_new(tmp, json.dumps(codec.treedef_to_json(treedef)).encode())
            try:
                os.link(tmp, self.dir / SCHEMA)
            except FileExistsError:
                pass
            finally:
                tmp.unlink()
            schema = _load_schema(self.dir)
        if schema is None or self.compress:
            return
        self._schema = schema
        for k, (dtype, shape) in enumerate(codec.leaf_specs(schema)):
            fd = safefs.open_nofollow(self.dir / _col_name(k), os.O_RDWR | os.O_CREAT)
            self._cols.append((fd, dtype.itemsize * int(np.prod(shape, dtype=np.int64))))

    def _write(self, index: int, treedef: tuple, leaves: list[np.ndarray]) -> int:
        try:
            if not self._schema_checked:
                self._claim_schema(treedef)
            if treedef == self._schema:
                for (fd, rowbytes), leaf in zip(self._cols, leaves):
                    if rowbytes:
                        _write_all(fd, codec.leaf_bytes(leaf), index * rowbytes)
                nbytes = sum(r for _, r in self._cols)
                self._rows.append((index, COLUMN, 0, 0, nbytes, checksum(leaves), nbytes))
                return nbytes
            record = codec.encode_record(treedef, leaves, self.compress)
            if self._seg_fd is None:
                self._seg_fd = safefs.open_nofollow(self.dir / f"{self.shard_id}.seg",
                                                    os.O_WRONLY | os.O_CREAT | os.O_APPEND)
                self._seg_end = os.fstat(self._seg_fd).st_size  # a shard reopened after a close appends
            _write_all(self._seg_fd, record)
            self._rows.append((index, 0, 0, self._seg_end, len(record), checksum([record]),
                               sum(leaf.nbytes for leaf in leaves)))
            self._seg_end += len(record)
            return len(record)
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise BudgetExceededError(f"disk full while writing generation {self.generation} "
                                          f"into {self.dir}: {exc}") from exc
            raise

    def _flush(self) -> None:
        if not self._rows:
            return
        rows = np.array(self._rows, dtype=INDEX_DTYPE)
        self._rows = []
        try:
            _write_all(self._idx_fd, rows.tobytes())
        except OSError as exc:
            if exc.errno in _NO_SPACE:
                raise BudgetExceededError(f"disk full while writing {self.dir}: {exc}") from exc
            raise

    def _close(self) -> None:
        fds = [fd for fd, _ in self._cols] + [fd for fd in (self._seg_fd, self._idx_fd) if fd is not None]
        for fd in fds:
            # Written to disk by the process that wrote them (a worker, or a background refresh's
            # spare time), so the commit's own fsync in the training process finds little left to
            # do: it took 15 ms of a 22 ms refresh commit that the training loop waited for.
            # Durability is the commit's job: an error here is reported by its fsync.
            try:
                os.fsync(fd)
            except OSError:
                pass
            os.close(fd)
        self._cols = []
        self._seg_fd = None

    def usage(self) -> int:
        return allocated_bytes(self.dir)


def _truncate(path: Path, size: int) -> None:
    fd = safefs.open_nofollow(path, os.O_WRONLY)
    try:
        os.ftruncate(fd, size)
    finally:
        os.close(fd)


def _read_rows(path: Path) -> np.ndarray:
    data = safefs.read_bytes(path)
    usable = len(data) - len(data) % INDEX_DTYPE.itemsize  # a killed writer may leave half a row
    return np.frombuffer(data[:usable], dtype=INDEX_DTYPE)


class MemmapBackend(DirectoryBackend):
    name = "memmap"
    supports_zero_copy = True

    def _shard(self, token: StagingToken, shard_id: str) -> ShardWriter:
        return MemmapShard(token, shard_id)

    def discard_shard_tail(self, token: StagingToken, shard_id: str, keep: int) -> None:
        path = Path(token.path) / f"{shard_id}.idx"
        if path.exists():
            _truncate(path, min(path.lstat().st_size, keep * INDEX_DTYPE.itemsize))

    def _finalize(self, staging: Path, num_samples: int | None) -> dict:
        shard_ids = sorted(p.name[:-4] for p in staging.glob("*.idx"))
        parts = []
        for k, shard_id in enumerate(shard_ids):
            rows = _read_rows(staging / f"{shard_id}.idx").copy()
            rows["shard"][rows["shard"] != COLUMN] = k
            parts.append(rows)
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=INDEX_DTYPE)
        n = check_complete(rows["index"], num_samples, f"generation in {staging}")
        rows = rows[np.argsort(rows["index"], kind="stable")]
        schema = _load_schema(staging)
        if schema is not None:
            for k, (dtype, shape) in enumerate(codec.leaf_specs(schema)):
                rowbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                _truncate(staging / _col_name(k), n * rowbytes)
        with os.fdopen(safefs.create_new(staging / "index.npy"), "wb") as f:
            np.save(f, rows)
        safefs.write_new(staging / "shards.json", json.dumps(shard_ids).encode())
        in_cols = int(np.count_nonzero(rows["shard"] == COLUMN))
        layout = "fixed" if n and in_cols == n else ("records" if in_cols == 0 else "mixed")
        return {"num_samples": n, "layout": layout, "raw_bytes": int(rows["raw"].sum()),
                "stored_bytes": int(rows["length"].sum())}

    def _open(self, gen_dir: Path, manifest: dict) -> GenerationData:
        return MemmapGeneration(gen_dir, manifest, self.verify)

    # partial generations ----------------------------------------------------
    def _logged(self, staging: Path) -> np.ndarray:
        parts = [_read_rows(path)["index"] for path in sorted(staging.glob("*.idx"))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _adopt_shards(self, staging: Path, prefix: str, num_samples: int) -> int:
        records = StagingRecords(staging, verify=True)
        seen = np.zeros(num_samples, dtype=bool)
        for path in sorted(staging.glob("*.idx")):
            shard_id = path.name[:-4]
            rows = _read_rows(path)
            keep = np.zeros(len(rows), dtype=bool)
            for k, row in enumerate(rows):
                i = int(row["index"])
                # Written twice (a re-run that raced a worker's death): the first copy that verifies.
                keep[k] = 0 <= i < num_samples and not seen[i] and records.sound(shard_id, row)
                if keep[k]:
                    seen[i] = True
            new_id = prefix + shard_id
            if (staging / f"{shard_id}.seg").exists():
                os.rename(staging / f"{shard_id}.seg", staging / f"{new_id}.seg")
            safefs.write_new(staging / f"{new_id}.idx", rows[keep].tobytes())
            path.unlink()
        records.close()
        fsync_dir(staging)
        return int(seen.sum())

    def open_staging(self, token: StagingToken) -> StagingData:
        return StagingRecords(Path(token.path), self.verify)

    def _check_files(self, gen_dir: Path, manifest: dict) -> str | None:
        # Headers and small files only: listing runs this for every generation.
        n = manifest["num_samples"]
        index = gen_dir / "index.npy"
        try:
            with os.fdopen(safefs.open_nofollow(index, os.O_RDONLY), "rb") as f:
                version = np.lib.format.read_magic(f)
                read_header = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                               else np.lib.format.read_array_header_2_0)
                shape, _, dtype = read_header(f)
                data_start, size = f.tell(), os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            return f"{index} is missing"
        except (OSError, ValueError) as exc:
            return f"{index} is unreadable ({exc})"
        if dtype != INDEX_DTYPE or len(shape) != 1:
            return f"{index} is not an index of this format (dtype {dtype}, shape {shape})"
        if shape[0] != n:
            return f"{index} holds {shape[0]} rows but the manifest says {n} samples"
        if size < data_start + n * INDEX_DTYPE.itemsize:
            return f"{index} is truncated: {size} bytes, {n} rows need {data_start + n * INDEX_DTYPE.itemsize}"
        shards = gen_dir / "shards.json"
        try:
            shard_ids = safefs.read_json(shards)
            if not isinstance(shard_ids, list) or not all(isinstance(x, str) for x in shard_ids):
                raise ValueError("not a list of shard names")
        except FileNotFoundError:
            return f"{shards} is missing"
        except (OSError, ValueError) as exc:
            return f"{shards} is unreadable ({exc})"
        try:
            schema = _load_schema(gen_dir)
            specs = codec.leaf_specs(schema) if schema is not None else []
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            return f"{gen_dir / SCHEMA} is unreadable ({exc})"
        if schema is None and n and manifest.get("layout") in ("fixed", "mixed"):
            return f"{gen_dir / SCHEMA} is missing"
        for k, (dtype, shape) in enumerate(specs):
            col, needed = gen_dir / _col_name(k), n * dtype.itemsize * int(np.prod(shape, dtype=np.int64))
            st = safefs.lstat_or_none(col)
            if st is None or not stat.S_ISREG(st.st_mode):
                return f"{col} is {'missing' if st is None else safefs.describe_entry(col)}"
            if st.st_size < needed:
                return f"{col} is truncated: {st.st_size} bytes, {n} samples need {needed}"
        return None


class StagingRecords(StagingData):
    """Samples of a memmap staging area, read with ``pread`` (its files still grow)."""

    def __init__(self, staging: Path, verify: bool) -> None:
        self.dir = staging
        self.verify = verify
        self._where: dict[int, tuple[str, Any]] = {}  # index -> (shard id, index row)
        self._schema: tuple | None = None
        self._specs: list = []

    def _scan(self) -> None:
        for path in sorted(self.dir.glob("*.idx")):
            shard_id = path.name[:-4]
            for row in _read_rows(path):
                self._where.setdefault(int(row["index"]), (shard_id, row))
        if self._schema is None:
            self._schema = _load_schema(self.dir)
            self._specs = codec.leaf_specs(self._schema) if self._schema is not None else []

    def _leaves(self, shard_id: str, row: Any) -> tuple[tuple, list[np.ndarray]] | None:
        """The record of `row` as ``(treedef, leaves)``, ``None`` when it is missing or fails its checksum."""
        if self._schema is None:
            self._schema = _load_schema(self.dir)
            self._specs = codec.leaf_specs(self._schema) if self._schema is not None else []
        i = int(row["index"])
        if row["shard"] == COLUMN:
            if self._schema is None:
                return None
            leaves = []
            for k, (dtype, shape) in enumerate(self._specs):
                rowbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
                data = _pread(self.dir / _col_name(k), i * rowbytes, rowbytes) if rowbytes else b""
                if len(data) != rowbytes:
                    return None
                leaves.append(np.frombuffer(data, dtype=dtype).reshape(shape).copy())
            if self.verify and checksum(leaves) != row["checksum"]:
                return None
            return self._schema, leaves
        record = _pread(self.dir / f"{shard_id}.seg", int(row["offset"]), int(row["length"]))
        if len(record) != row["length"] or (self.verify and checksum([record]) != row["checksum"]):
            return None
        try:
            return codec.decode_record(record, copy=True)
        except CorruptSampleError:
            return None

    def sound(self, shard_id: str, row: Any) -> bool:
        return self._leaves(shard_id, row) is not None

    def read(self, index: int) -> Any:
        if index not in self._where:
            self._scan()  # written since the last look
        if index not in self._where:
            raise CacheStoreError(f"sample {index} is not in the staging area {self.dir}")
        leaves = self._leaves(*self._where[index])
        if leaves is None:
            raise CorruptSampleError(f"sample {index} in the staging area {self.dir} is corrupt or truncated")
        return codec.unflatten(*leaves)


def _pread(path: Path, offset: int, length: int) -> bytes:
    try:
        fd = safefs.open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return b""
    try:
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    size = path.stat().st_size if path.exists() else -1
    if size < nbytes:
        raise CorruptSampleError(f"data file {path} is truncated: {size} bytes, expected {nbytes}; "
                                 "the generation is damaged (prune it and rewrite)")
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class MemmapGeneration(GenerationData):
    # Read-only maps and arrays: a batch read touches no shared state.
    threadsafe_batches = True

    def __init__(self, gen_dir: Path, manifest: dict, verify: bool) -> None:
        super().__init__(int(manifest["generation"]), int(manifest["num_samples"]), str(gen_dir), verify)
        self.layout = manifest.get("layout")
        try:
            self.rows = np.load(gen_dir / "index.npy")
            shard_ids = json.loads((gen_dir / "shards.json").read_text())
        except (OSError, ValueError) as exc:
            raise CorruptSampleError(f"index of generation {self.generation} in {gen_dir} is unreadable: {exc}") from exc
        if len(self.rows) != self.num_samples:
            raise CorruptSampleError(f"index of generation {self.generation} in {gen_dir} has "
                                     f"{len(self.rows)} rows, expected {self.num_samples}")
        self.schema = _load_schema(gen_dir)
        self.specs = codec.leaf_specs(self.schema) if self.schema is not None else []
        self.columns = [_map(gen_dir / _col_name(k), dtype, (self.num_samples, *shape))
                        for k, (dtype, shape) in enumerate(self.specs)]
        # The columns as rows of bytes, for the compiled gather.
        self._byte_rows = tuple(flat_rows(self.columns, self.num_samples))
        self._widths = tuple(r.shape[1] for r in self._byte_rows)
        self._mapped_in = False
        self.segments: list[np.ndarray | None] = []
        for shard_id in shard_ids:
            seg = gen_dir / f"{shard_id}.seg"
            size = seg.stat().st_size if seg.exists() else 0
            self.segments.append(np.memmap(seg, dtype=np.uint8, mode="r") if size else None)

    def _record(self, i: int, row: Any) -> memoryview:
        seg = self.segments[row["shard"]]
        start, length = int(row["offset"]), int(row["length"])
        if seg is None or start + length > seg.size:
            raise self.corrupt(i, "its record lies beyond the end of the data file (truncated?)")
        rec = seg[start:start + length]
        if self.verify and checksum([rec]) != row["checksum"]:
            raise self.corrupt(i, "checksum mismatch")
        return rec

    def read(self, index: int, copy: bool = True) -> Any:
        i = self.check_index(index)
        row = self.rows[i]
        if row["shard"] == COLUMN:
            leaves = [col[i, ...] for col in self.columns]
            if self.verify and checksum(leaves) != row["checksum"]:
                raise self.corrupt(i, "checksum mismatch")
            if copy:
                leaves = [np.array(leaf) for leaf in leaves]
            return codec.unflatten(self.schema, leaves)
        treedef, leaves = codec.decode_record(self._record(i, row), copy=copy)
        return codec.unflatten(treedef, leaves)

    def batch_layout(self) -> tuple[tuple, list] | None:
        return (self.schema, self.specs) if self.layout == "fixed" else None

    def read_batch(self, indices: Sequence[int], out: list[np.ndarray] | None = None) -> Any:
        if self.layout != "fixed":
            if out is not None:
                raise ValueError("out= is only supported for generations with a fixed layout")
            return stack_samples([self.read(i, copy=False) for i in indices])
        idx = batch_indices(indices, self.num_samples, self.generation)
        if not self._mapped_in:
            self._map_in()
        if self.verify:
            out = self._gather_verified(idx, out)
        else:
            out = gather_columns(self.columns, self.specs, idx, out)
        return codec.unflatten_batch(self.schema, out)

    def _map_in(self) -> None:
        """Map every page of the columns into this process, once, before its first batch read.

        Batch reads go over the whole generation, and a page touched for the first time in a
        process costs a fault there (each worker's, the training process's): the first read epoch
        gathered 48 KiB samples at 1.67 ms per batch of 256, then 1.30; mapped in one call
        (``MADV_POPULATE_READ``, 13-35 ms for 768 MB in the page cache), 1.26 from the start. Not
        for a generation above a quarter of the available memory: that would read it from disk
        up front, and its epochs are bound by the disk anyway.
        """
        self._mapped_in = True
        native = native_gather()
        if native is None or sum(c.nbytes for c in self._byte_rows) > psutil.virtual_memory().available // 4:
            return
        for col in self._byte_rows:
            if col.size:
                native.populate(col)

    def _gather_verified(self, idx: np.ndarray, out: list[np.ndarray] | None) -> list[np.ndarray]:
        """Gather rows `idx` into `out` and check each row's checksum, block by block.

        A block (``VERIFY_BLOCK_BYTES``) is gathered, then hashed while it is still in cache:
        gathering the whole batch first and hashing it after read every byte from memory twice
        (a 12 MiB batch does not fit in cache), which cost a third of the read's speed.
        """
        n = idx.size
        if out is None:
            out = [np.empty((n, *shape), dtype=dtype) for dtype, shape in self.specs]
        rows = flat_rows(out, n)
        native = native_gather()
        if native is not None and len(rows) <= native.MAX_LEAVES:
            # One call per batch, the GIL released: gather threads run side by side.
            bad = native.gather_verified(self._byte_rows, self._widths, np.ascontiguousarray(idx),
                                         tuple(rows), np.ascontiguousarray(self.rows["checksum"][idx]))
            if bad >= 0:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")
            return out
        expected = self.rows["checksum"][idx].tolist()
        block = max(1, VERIFY_BLOCK_BYTES // max(1, sum(r.shape[1] for r in rows)))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            gather_columns(self.columns, self.specs, idx[lo:hi], [dest[lo:hi] for dest in out])
            bad = first_mismatch(row_checksums([r[lo:hi] for r in rows], hi - lo), expected[lo:hi])
            if bad is not None:
                raise self.corrupt(int(idx[lo + bad]), "checksum mismatch")
        return out

    def close(self) -> None:
        self.columns = []
        self._byte_rows = ()
        self.segments = []
