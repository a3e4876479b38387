"""A memmap generation read by byte ranges: the backend's own files, wherever their bytes are.

:class:`RangeGeneration` reads the files of :mod:`.memmap_files` through a :class:`ByteSource`,
which answers ranges of named files: the remote tier's objects (:mod:`cachestore.remote.reader`)
read a generation so, without a local copy. The small files (the index, the schema, the shard
list) are read whole at open and parsed by the backend's own code (:func:`.memmap_files.index_start`,
:func:`.memmap_files.index_rows`, :func:`.memmap_files.schema_of`); a sample is then one range for
its record or one per column, a batch one range per run of consecutive samples and column, all
asked for together so that a source over a network sends them in few requests. Every record is
verified with the store's checksums (:func:`.memmap_files.record_leaves`).

A generation may come in parts, each with samples ``start..stop-1`` and files of its own (the
remote tier publishes a generation that several nodes computed so): a part's index (``index.bin``,
rows without a header) lists its own samples, its records lie in ``records.seg`` and its columns
begin at its first sample. A whole generation is one part with a committed generation's files.
"""

from __future__ import annotations

import io
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np
import numpy.typing as npt

from ..errors import CorruptSampleError, MalformedFileError
from ..format import codec
from ..format.checksums import first_mismatch, flat_rows, row_checksums
from ..format.codec import Batch, Leaf, LeafSpec, Sample, TreeDef
from ..format.collate import stack_samples
from ..guard.untrusted import parse_json, parse_shard_ids
from .batch import Indices, batch_indices
from .memmap_files import (COLUMN, INDEX_DTYPE, SCHEMA, SCHEMA_BYTES, IndexRows, check_row, col_name, index_rows,
                           index_start, record_leaves, schema_of)
from .reading import BatchLayout, GenerationData

#: (part, file name, offset in the file, length): bytes to read.
Want = tuple[int, str, int, int]
#: Samples verified per read of :meth:`RangeGeneration.verify_all`.
VERIFY_STEP = 256


class ByteSource(Protocol):
    """The files of a generation's parts, read by byte ranges."""

    def size(self, part: int, name: str) -> int | None:
        """The bytes of file `name` of `part`; ``None`` where the part has no such file."""

    def whole(self, part: int, name: str) -> bytes | None:
        """File `name` of `part` read whole (a small one: an index, a schema), checked where the
        source holds checksums of it; ``None`` where the part has no such file."""

    def read(self, wants: Sequence[Want]) -> list[bytes | memoryview]:
        """The bytes of each of `wants`, in order."""


@dataclass(frozen=True)
class Part:
    """Samples ``start..stop-1`` of a generation, named `name`; `whole`: in a committed generation's
    files, else in a part's (see the module docstring)."""

    name: str
    start: int
    stop: int
    whole: bool


@dataclass(frozen=True)
class OpenPart:
    """A part as read at open: its index rows (in index order) and the files they name."""

    start: int
    rows: IndexRows
    segments: tuple[str | None, ...]  # by the rows' shard number; None: not there
    columns: tuple[str, ...]  # col-K.bin: row r is sample start + r
    schema: TreeDef | None  # of the samples in its columns (parts computed apart may differ)
    specs: tuple[LeafSpec, ...]
    widths: tuple[int, ...]


def open_part(source: ByteSource, k: int, part: Part, where: str) -> OpenPart:
    """Part `k` of `source` read and checked: its index lists samples ``start..stop-1`` in order,
    every record lies inside a segment that is there, every column holds its rows.

    Raises
    ------
    MalformedFileError
        Naming the file (and `where`) that is missing, malformed or too short.
    """
    n, of = part.stop - part.start, f"{where}: {{}} of {part.name}"
    name = "index.npy" if part.whole else "index.bin"
    raw = source.whole(k, name)
    if raw is None:
        raise MalformedFileError(f"{where}: {part.name} has no index")
    data = memoryview(raw)
    if part.whole:
        start = index_start(io.BytesIO(raw), len(raw), of.format(name), n)
        data = data[start:start + n * INDEX_DTYPE.itemsize]
    elif len(raw) % INDEX_DTYPE.itemsize:
        raise MalformedFileError(f"{of.format(name)} is not whole rows of an index")
    names = (parse_shard_ids(parse_json(source.whole(k, "shards.json") or b"[]", of.format("shards.json")),
                             of.format("shards.json")) if part.whole else ["records"])
    rows = index_rows(data, n, len(names), of.format(name), part.start)
    segments = tuple(f"{s}.seg" if source.size(k, f"{s}.seg") is not None else None for s in names)
    _check_records(rows, [None if s is None else source.size(k, s) for s in segments], of.format(name))
    schema_raw = source.whole(k, SCHEMA)
    schema = None if schema_raw is None else schema_of(parse_json(schema_raw, of.format(SCHEMA), SCHEMA_BYTES),
                                                       of.format(SCHEMA))
    specs = codec.leaf_specs(schema) if schema is not None else []
    in_columns = np.flatnonzero(rows["shard"] == COLUMN)
    if in_columns.size and schema is None:
        raise MalformedFileError(f"{where}: {part.name} has samples in columns but no {SCHEMA}")
    held = int(in_columns[-1]) + 1 if in_columns.size else 0  # a column holds rows up to its last sample
    columns = tuple(col_name(j) for j in range(len(specs))) if in_columns.size else ()
    for column, width in zip(columns, codec.row_bytes(specs)):
        size = source.size(k, column)
        if size is None or size < held * width:
            raise MalformedFileError(f"{of.format(column)} is missing or too short")
    return OpenPart(part.start, rows, segments, columns, schema, tuple(specs), tuple(codec.row_bytes(specs)))


def _check_records(rows: IndexRows, sizes: list[int | None], where: str) -> None:
    """Every record row lies inside a segment that is there (the index's own checks found the
    shard numbers listed and the offsets and sizes >= 0)."""
    shard = rows["shard"].astype(np.int64)
    records = shard != COLUMN
    if not np.any(records):
        return
    ends = np.array([-1 if size is None else size for size in sizes], dtype=np.int64)[shard[records]]
    if np.any(ends < 0):
        raise MalformedFileError(f"{where} names a segment that is not there")
    if np.any(rows["offset"][records] + rows["length"][records] > ends):
        raise MalformedFileError(f"{where}: a record lies outside its segment")


def runs(idx: npt.NDArray[np.int64], starts: npt.NDArray[np.int64]) -> tuple[npt.NDArray[np.intp],
                                                                            npt.NDArray[np.int64], list[int],
                                                                            list[int], npt.NDArray[np.intp]]:
    """`idx` in runs of consecutive samples of one part (parts beginning at `starts`):
    ``(order, sorted indices, run starts, run ends, the part of each sorted index)``."""
    order = np.argsort(idx, kind="stable")
    ordered = idx[order]
    part = np.searchsorted(starts, ordered, side="right") - 1
    breaks = np.flatnonzero((np.diff(ordered) != 1) | (np.diff(part) != 0)) + 1
    return order, ordered, np.r_[0, breaks].tolist(), np.r_[breaks, idx.size].tolist(), part


class RangeGeneration(GenerationData):
    """A committed memmap generation read through a :class:`ByteSource` (see the module docstring).

    Subclasses say what else a structure read back must pass (:meth:`check_structure`) and
    release what their source holds (:meth:`close`).
    """

    threadsafe_batches = True

    def __init__(self, source: ByteSource, parts: Sequence[Part], generation: int, num_samples: int, where: str,
                 verify: bool, allow_pickle: bool = False) -> None:
        super().__init__(generation, num_samples, where, verify, allow_pickle)
        self.source = source
        self.parts: list[OpenPart] = []
        for k, part in enumerate(parts):
            opened = open_part(source, k, part, where)
            if opened.schema is not None:
                self.check_structure(opened.schema, f"{where}: {SCHEMA} of {part.name}")
            self.parts.append(opened)
        self._starts = np.array([p.start for p in self.parts], dtype=np.int64)
        first = self.parts[0].schema if self.parts else None
        fixed = first is not None and all(p.schema == first and bool(np.all(p.rows["shard"] == COLUMN))
                                          for p in self.parts)
        self._fixed: BatchLayout | None = (first, list(self.parts[0].specs)) if fixed and first is not None else None
        self.specs: list[LeafSpec] = self._fixed[1] if self._fixed is not None else []
        self._widths = codec.row_bytes(self.specs)
        if self._fixed is not None:
            self.uniform_bytes = sum(self._widths)

    def check_structure(self, treedef: TreeDef, where: str) -> None:
        """Raise unless `treedef`, read from `where` (a schema, a record's), may be read here: any
        structure the strict parser took, by default."""

    def _part(self, i: int) -> int:
        return int(np.searchsorted(self._starts, i, side="right")) - 1

    # reading -----------------------------------------------------------------------
    def read(self, index: int, copy: bool = True) -> Sample:
        i = self.check_index(index)
        return self._samples(np.array([i], dtype=np.int64))[0]

    def _samples(self, idx: npt.NDArray[np.int64]) -> list[Sample]:
        """Samples `idx` (checked), each with one read for its record or one per column."""
        wants: list[Want] = []
        found: list[tuple[int, np.void, OpenPart | None]] = []
        for i in idx.tolist():
            k = self._part(i)
            part = self.parts[k]
            row = part.rows[i - part.start]
            if int(row["shard"]) == COLUMN:
                found.append((i, row, part))
                wants += [(k, col, (i - part.start) * w, w) for col, w in zip(part.columns, part.widths)]
            else:
                segment = part.segments[int(row["shard"])]
                assert segment is not None  # checked at open: a record row names a segment that is there
                found.append((i, row, None))
                wants.append((k, segment, int(row["offset"]), int(row["length"])))
        got = iter(self.source.read(wants))
        out = []
        for i, row, in_columns in found:
            if in_columns is not None and in_columns.schema is not None:
                leaves = [np.frombuffer(next(got), dtype=dtype).reshape(shape).copy()
                          for dtype, shape in in_columns.specs]
                if self.verify:
                    check_row(self, i, leaves, int(row["checksum"]))
                out.append(self.sample(i, in_columns.schema, leaves))
                continue
            treedef, leaves = record_leaves(self, i, next(got), row, self.verify, copy=True)
            self.check_structure(treedef, f"sample {i} of {self.where}")
            out.append(self.sample(i, treedef, leaves))
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
        """Rows `idx` into `out`: one read per run of consecutive samples (in one part) and column."""
        n = idx.size
        rows = flat_rows(out, n)
        if not n:
            return
        order, ordered, starts, ends, part_of = runs(idx, self._starts)
        wants: list[Want] = []
        for a, b in zip(starts, ends):
            k = int(part_of[a])
            first = int(ordered[a]) - self.parts[k].start
            wants += [(k, col, first * w, (b - a) * w) for col, w in zip(self.parts[k].columns, self._widths) if w]
        got = iter(self.source.read(wants))
        for a, b in zip(starts, ends):
            for k, w in enumerate(self._widths):
                if w:
                    rows[k][order[a:b]] = np.frombuffer(next(got), dtype=np.uint8).reshape(b - a, w)
        if self.verify:
            bad = first_mismatch(row_checksums(rows, n), self._checksums(idx).tolist())
            if bad is not None:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")

    def _checksums(self, idx: npt.NDArray[np.int64]) -> npt.NDArray[np.uint64]:
        out = np.empty(idx.size, dtype=np.uint64)
        part_of = np.searchsorted(self._starts, idx, side="right") - 1
        for k in np.unique(part_of).tolist():
            mask = part_of == k
            out[mask] = self.parts[k].rows["checksum"][idx[mask] - self.parts[k].start]
        return out

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
        """Every checksum, :data:`VERIFY_STEP` samples a read; a step that fails is read again one
        sample at a time, to name each bad one."""
        bad = []
        for lo in range(0, self.num_samples, VERIFY_STEP):
            hi = min(self.num_samples, lo + VERIFY_STEP)
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
