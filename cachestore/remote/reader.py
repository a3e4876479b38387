"""Reading a published generation straight from the remote (no local copy): a map-style dataset.

For when the local disk budget cannot hold a generation. The small files (the index, the
schema) are read once at open, verified chunk by chunk, and checked: every row lies inside
its file, every index once. A batch is then one ranged read per run of consecutive samples
and column (or per run of adjacent records), the reads of each object sent together
(obstore coalesces nearby ranges) and several objects in parallel; every record is verified
with the store's checksums; no pickled leaf is loaded unless ``allow_pickle``.

Block order (blocks of consecutive records, docs/ARCHITECTURE.md "Larger than memory") suits it:
a batch of such blocks is a few large reads.
"""

from __future__ import annotations

import io
import json
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from . import layout
from ..backends.batch import Indices, batch_indices
from ..backends.memmap_files import COLUMN, INDEX_DTYPE
from ..backends.reading import BatchLayout, GenerationData
from ..backends.spec import StoreSpec
from ..errors import CorruptSampleError
from ..format import codec
from ..format.checksums import checksum, first_mismatch, flat_rows, row_checksums
from ..format.codec import Batch, Leaf, LeafSpec, Sample, TreeDef
from ..format.collate import stack_samples
from ..format.records import decode_record
from ..format.structure import parse_treedef
from ..guard.untrusted import parse_json, parse_shard_ids
from ..read.reader import Reader
from ..space.room import sample_limit
from .client import runtime_started
from .errors import RemoteManifestError
from .leases import ReaderLease
from .manifest import FileEntry, FileSet, check_sizes
from .verify import check_treedef

if TYPE_CHECKING:
    from .base import RemoteBase

#: (set, file, offset in the file, length): bytes to read.
Want = tuple[int, FileEntry, int, int]


@dataclass
class _Set:
    """One set of files, as read at open: rows of samples ``start..stop-1`` and where they lie."""

    fs: FileSet
    start: int
    rows: Any  # INDEX_DTYPE rows, in index order
    segments: list[FileEntry | None]  # by the rows' shard number
    columns: list[FileEntry]
    base: int  # the sample of a column's first row
    schema: TreeDef | None = None  # of the samples in its columns (parts computed apart may differ)
    specs: tuple[LeafSpec, ...] = ()
    widths: tuple[int, ...] = ()


class RemoteGeneration(GenerationData):
    """A published generation read from the remote (see the module docstring)."""

    threadsafe_batches = True

    def __init__(self, remote: "RemoteBase", generation: int, allow_pickle: bool, verify: bool) -> None:
        m = remote.manifest(generation)
        super().__init__(generation, m.num_samples, f"{remote.path}/generations/{generation:06d}.json", verify)
        self.remote = remote
        self.allow_pickle = allow_pickle
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()
        self.sets: list[_Set] = []
        self.lease: ReaderLease | None = None
        for k, fs in enumerate(m.sets):
            prefix = layout.data_prefix(remote.key, generation, fs.name)
            check_sizes(fs, {i.key.rsplit("/", 1)[-1]: i.size for i in remote.client.list_objects(prefix)}, self.where)
            self.sets.append(self._open_set(k, fs, m.layout == "whole"))
        self._starts = np.array([s.start for s in self.sets], dtype=np.int64)
        self._fixed: BatchLayout | None = self._layout()
        self.specs: list[LeafSpec] = self._fixed[1] if self._fixed is not None else []
        self._widths = codec.row_bytes(self.specs)
        if self._fixed is not None:
            self.uniform_bytes = sum(self._widths)
        limit = remote.max_sample_bytes
        self.bound_samples(sample_limit(None) if limit is None else limit)
        self.lease = ReaderLease(remote, generation)

    # opening --------------------------------------------------------------------
    def _layout(self) -> BatchLayout | None:
        """The batch layout when every sample of every set is in columns of one schema, else ``None``."""
        first = self.sets[0].schema
        if first is None or not all(s.schema == first and bool(np.all(s.rows["shard"] == COLUMN)) for s in self.sets):
            return None
        return (first, list(self.sets[0].specs))

    def _small(self, k: int, fs: FileSet, name: str) -> bytes | None:
        f = fs.file(name)
        if f is None:
            return None
        if f.size > 1 << 30:
            raise RemoteManifestError(f"{self.where}: {name} of {fs.name} is {f.size} bytes, too large for an index")
        out = bytes(self._fetch([(k, f, 0, f.size)], fs_override=fs)[0])
        # The index files are verified chunk by chunk (records are verified by their own checksums).
        pos = 0
        for n, c in zip(f.lengths.tolist(), f.checksums.tolist()):
            if xxhash.xxh3_64_intdigest(out[pos:pos + n]) != c:
                raise CorruptSampleError(f"{self.where}: {name} of {fs.name} does not match its checksum")
            pos += n
        return bytes(out)

    def _open_set(self, k: int, fs: FileSet, whole: bool) -> _Set:
        raw = self._small(k, fs, "index.npy" if whole else "index.bin")
        if raw is None:
            raise RemoteManifestError(f"{self.where}: {fs.name} has no index")
        try:
            rows = (np.load(io.BytesIO(raw), allow_pickle=False) if whole
                    else np.frombuffer(raw, dtype=INDEX_DTYPE) if len(raw) % INDEX_DTYPE.itemsize == 0 else None)
        except ValueError:
            rows = None
        if rows is None or rows.dtype != INDEX_DTYPE or rows.ndim != 1 or len(rows) != fs.stop - fs.start \
                or not np.array_equal(rows["index"], np.arange(fs.start, fs.stop)):
            raise RemoteManifestError(f"{self.where}: the index of {fs.name} does not list samples "
                                      f"{fs.start}..{fs.stop - 1} in order")
        schema_raw = self._small(k, fs, "schema.json")
        schema = self._parse_schema(schema_raw, fs) if schema_raw is not None else None
        specs = codec.leaf_specs(schema) if schema is not None else []
        if whole:
            where = f"{self.where}: shards.json of {fs.name}"
            names = parse_shard_ids(parse_json(self._small(k, fs, "shards.json") or b"[]", where), where)
            segments = [fs.file(f"{name}.seg") for name in names]
        else:
            segments = [fs.file("records.seg")]
        columns = []
        col_rows = np.flatnonzero(rows["shard"] == COLUMN)
        in_cols = bool(col_rows.size)
        held = int(col_rows[-1]) + 1 if in_cols else 0  # a column holds rows up to its last column sample
        if in_cols and schema is None:
            raise RemoteManifestError(f"{self.where}: {fs.name} has samples in columns but no schema")
        for j, width in enumerate(codec.row_bytes(specs) if in_cols else []):
            col = fs.file(f"col-{j}.bin")
            if col is None or col.size < (held + (fs.start if whole else 0)) * width:
                raise RemoteManifestError(f"{self.where}: col-{j}.bin of {fs.name} is missing or too short")
            columns.append(col)
        self._check_rows(rows, segments, fs)
        return _Set(fs, fs.start, rows, segments, columns, 0 if whole else fs.start, schema, tuple(specs),
                    tuple(codec.row_bytes(specs)))

    def _parse_schema(self, raw: bytes, fs: FileSet) -> TreeDef:
        try:
            schema = parse_treedef(parse_json(raw, f"{self.where}: schema of {fs.name}"), f"{self.where}: schema of {fs.name}")
        except (ValueError, TypeError, KeyError, IndexError) as exc:
            raise RemoteManifestError(f"{self.where}: the schema of {fs.name} is invalid ({exc})") from None
        check_treedef(schema, self.allow_pickle, self.where)
        return schema

    def _check_rows(self, rows: Any, segments: list[FileEntry | None], fs: FileSet) -> None:
        """Every record row lies inside a segment that is there (column rows were checked by their files)."""
        shard = rows["shard"].astype(np.int64)
        recs = shard != COLUMN
        if not np.any(recs):
            return
        if np.any((shard[recs] < 0) | (shard[recs] >= len(segments))):
            raise RemoteManifestError(f"{self.where}: the index of {fs.name} names a segment that is not there")
        sizes = np.array([s.size if s is not None else -1 for s in segments], dtype=np.int64)
        off, n = rows["offset"][recs], rows["length"][recs]
        if np.any(off < 0) or np.any(n < 0) or np.any(off + n > sizes[shard[recs]]):
            raise RemoteManifestError(f"{self.where}: a record of {fs.name} lies outside its segment")

    # fetching bytes ----------------------------------------------------------------
    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.remote.settings.concurrency,
                                                thread_name_prefix="cachestore-remote-read")
            return self._pool

    def _fetch(self, wants: Sequence[Want], fs_override: FileSet | None = None) -> list[bytes | memoryview]:
        """The bytes of each want; the ranges of one object go in one call, objects in parallel."""
        pieces: list[list[tuple[tuple[int, int], int]]] = []  # per want: ((set, object), slot in its group)
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for s, f, off, n in wants:
            mine = []
            starts = f.starts
            j = int(np.searchsorted(starts, off, side="right")) - 1
            while n > 0:
                inner = off - int(starts[j])
                take = min(n, int(f.lengths[j]) - inner)
                key = (s, int(f.objects[j]))
                group = groups.setdefault(key, ([], []))
                group[0].append(int(f.offsets[j]) + inner)
                group[1].append(int(f.offsets[j]) + inner + take)
                mine.append((key, len(group[0]) - 1))
                off, n, j = off + take, n - take, j + 1
            pieces.append(mine)

        def get(key: tuple[int, int]) -> list[memoryview]:
            s, obj = key
            fs = fs_override if fs_override is not None else self.sets[s].fs
            name = layout.data_object(self.remote.key, self.generation, fs.name, fs.objects[obj][0])
            starts, ends = groups[key]
            return self.remote.client.get_ranges(name, starts, ends)

        keys = list(groups)
        if len(keys) == 1:
            got = {keys[0]: get(keys[0])}
        else:
            got = dict(zip(keys, self._executor().map(get, keys)))
        if self.lease is not None:
            self.lease.renew()
        out: list[bytes | memoryview] = []
        for mine in pieces:
            if len(mine) == 1:
                out.append(got[mine[0][0]][mine[0][1]])
            else:
                out.append(b"".join(bytes(got[key][slot]) for key, slot in mine))
        return out

    def _set_of(self, i: int) -> _Set:
        return self.sets[int(np.searchsorted(self._starts, i, side="right")) - 1]

    # reading -----------------------------------------------------------------------
    def read(self, index: int, copy: bool = True) -> Sample:
        i = self.check_index(index)
        return self._samples(np.array([i], dtype=np.int64))[0]

    def _samples(self, idx: npt.NDArray[np.int64]) -> list[Sample]:
        """Samples `idx` (checked), each with one read for its record or its columns' rows."""
        wants: list[Want] = []
        kinds: list[tuple[int, Any, _Set | None]] = []
        for i in idx.tolist():
            st = self._set_of(i)
            row = st.rows[i - st.start]
            s = self.sets.index(st)
            if int(row["shard"]) == COLUMN:
                kinds.append((i, row, st))
                wants += [(s, col, (i - st.base) * w, w) for col, w in zip(st.columns, st.widths)]
            else:
                seg = st.segments[int(row["shard"])]
                assert seg is not None  # checked at open: a record row names a segment that is there
                kinds.append((i, row, None))
                wants.append((s, seg, int(row["offset"]), int(row["length"])))
        got = iter(self._fetch(wants))
        out = []
        for i, row, in_set in kinds:
            if in_set is not None and in_set.schema is not None:
                leaves = [np.frombuffer(next(got), dtype=dtype).reshape(shape).copy()
                          for dtype, shape in in_set.specs]
                if self.verify and checksum(leaves) != row["checksum"]:
                    raise self.corrupt(i, "checksum mismatch")
                out.append(codec.unflatten(in_set.schema, leaves, allow_pickle=self.allow_pickle))
                continue
            rec = next(got)
            if self.verify and xxhash.xxh3_64_intdigest(rec) != int(row["checksum"]):
                raise self.corrupt(i, "checksum mismatch")
            try:
                treedef, leaves = decode_record(rec, copy=True, raw=int(row["raw"]), limit=self.max_sample_bytes)
            except (CorruptSampleError, ValueError, TypeError, KeyError, IndexError) as exc:
                raise self.corrupt(i, f"its record does not decode ({exc})") from None
            check_treedef(treedef, self.allow_pickle, f"sample {i} of {self.where}")
            out.append(codec.unflatten(treedef, leaves, allow_pickle=self.allow_pickle))
        return out

    def batch_layout(self) -> BatchLayout | None:
        return self._fixed

    def read_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        idx = batch_indices(indices, self.num_samples, self.generation)
        if self._fixed is None:
            if out is not None:
                raise ValueError("out= is only supported for generations with a fixed layout")
            return stack_samples(self._samples(idx))
        if out is None:
            out = [np.empty((idx.size, *shape), dtype=dtype) for dtype, shape in self.specs]
        self._gather(idx, out)
        return codec.unflatten_batch(self._fixed[0], out)

    def _gather(self, idx: npt.NDArray[np.int64], out: list[Leaf]) -> None:
        """Rows `idx` into `out`: one read per run of consecutive samples (in one set) and column."""
        n = idx.size
        rows = flat_rows(out, n)
        if not n:
            return
        sort = np.argsort(idx, kind="stable")
        ordered = idx[sort]
        set_no = np.searchsorted(self._starts, ordered, side="right") - 1
        breaks = np.flatnonzero((np.diff(ordered) != 1) | (np.diff(set_no) != 0)) + 1
        starts, ends = np.r_[0, breaks], np.r_[breaks, n]
        wants: list[Want] = []
        for a, b in zip(starts.tolist(), ends.tolist()):
            st = self.sets[int(set_no[a])]
            first = int(ordered[a]) - st.base
            wants += [(int(set_no[a]), col, first * w, (b - a) * w) for col, w in zip(st.columns, self._widths) if w]
        got = iter(self._fetch(wants))
        for a, b in zip(starts.tolist(), ends.tolist()):
            for k, w in enumerate(self._widths):
                if not w:
                    continue
                block = np.frombuffer(next(got), dtype=np.uint8).reshape(b - a, w)
                rows[k][sort[a:b]] = block
        if self.verify:
            bad = first_mismatch(row_checksums(rows, n), self._checksums(idx).tolist())
            if bad is not None:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")

    def _checksums(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        out = np.empty(idx.size, dtype=np.uint64)
        set_no = np.searchsorted(self._starts, idx, side="right") - 1
        for s in np.unique(set_no).tolist():
            mask = set_no == s
            st = self.sets[s]
            out[mask] = st.rows["checksum"][idx[mask] - st.start]
        return out

    def data_bytes(self) -> int:
        return sum(s.fs.nbytes for s in self.sets)

    def reads_explicitly(self) -> bool:
        return True

    def read_range(self, start: int, stop: int, out: list[Leaf]) -> None:
        if self._fixed is None:
            raise ValueError("read_range needs a fixed-layout generation")
        if not 0 <= start <= stop <= self.num_samples:
            raise IndexError(f"range {start}..{stop} out of generation {self.generation} of {self.num_samples} samples")
        self._gather(np.arange(start, stop, dtype=np.int64), out)

    def read_rows(self, indices: np.ndarray, out: list[Leaf]) -> None:
        if self._fixed is None:
            raise ValueError("read_rows needs a fixed-layout generation")
        self._gather(batch_indices(indices, self.num_samples, self.generation), out)

    def verify_all(self) -> list[CorruptSampleError]:
        bad = []
        step = 256
        for lo in range(0, self.num_samples, step):
            hi = min(self.num_samples, lo + step)
            try:
                if self._fixed is not None:
                    self.read_batch(np.arange(lo, hi))
                else:
                    self._samples(np.arange(lo, hi))
            except CorruptSampleError:
                for i in range(lo, hi):
                    try:
                        self.read(i)
                    except CorruptSampleError as exc:
                        bad.append(exc)
        return bad

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class RemoteReader(Reader):
    """A :class:`~cachestore.Reader` of a published generation, read from the remote.

    Picklable (as its remote store's settings, without credentials, and the generation):
    hand it to ``torch.utils.data.DataLoader(reader, num_workers=..., multiprocessing_context="spawn")``
    as it is; each process opens its own client. A worker forked from a process that read it already
    raises :class:`~.errors.RemoteForkError` (the client's runtime does not survive a fork) instead
    of waiting for ever.
    """

    def __init__(self, remote: "RemoteBase", generation: int) -> None:
        spec = StoreSpec(remote.path, remote.backend_name, None, remote.allow_pickle, remote.verify_reads)
        super().__init__(spec, generation, None)
        self.remote = remote

    @property
    def survives_fork(self) -> bool:
        """Whether a process forked from this one can read it: not once this process made requests (the
        client's runtime does not survive a fork; such a process raises :class:`RemoteForkError`)."""
        return not runtime_started()

    def __getstate__(self) -> dict[str, object]:
        return {"spec": self.spec, "generation": self.generation, "remote": self.remote, "_persistent": True,
                "_data": None, "_pid": -1}

    @property
    def data(self) -> GenerationData:
        if self._data is None or self._pid != os.getpid():
            self._data = RemoteGeneration(self.remote, self.generation, self.spec.allow_pickle, self.spec.verify)
            self._pid = os.getpid()
        return self._data

    def __repr__(self) -> str:
        return f"RemoteReader({self.remote.path!r}, generation={self.generation})"
