"""The columnar layout of an LMDB generation: fixed-shape samples stored by column, in chunks.

Record by record, a batch of LMDB values is a loop in Python: one ``get``, one
copy per leaf and one hash per sample, far from memory speed for small samples
and for large ones alike. When every sample of a generation has one fixed,
stackable structure (and no compression) and a sample takes at most
``MAX_ROW_BYTES``, the commit rewrites the records as the memmap layout does, in
chunks of ``chunk_rows`` samples:

* key ``C | leaf (u32) | chunk (u64)`` (13 bytes, so never equal to an 8-byte
  record key): the raw rows of that leaf for samples
  ``chunk * chunk_rows ..`` (the last chunk is shorter);
* key ``C | 0xFFFFFFFF | chunk``: one little-endian ``u64`` checksum per row,
  :func:`~cachestore.format.checksums.checksum` of the row's leaves (as memmap's index holds it).

A batch is then one ``get`` per chunk touched and array (values are read in
place from LMDB's map), one fancy-index copy per chunk and leaf, and one hash
per row. ``chunk_rows`` makes a chunk of all leaves about ``CHUNK_BYTES``
(larger chunks read small samples faster: fewer ``get`` calls per batch).

Wide samples (over ``MAX_ROW_BYTES``) keep one record each: a record's one
``get`` already moves a whole row, and the columns cost a ``get`` per leaf and
per checksum chunk for each row touched, plus the Python around each, so a wide
sample reads faster as a record than by column. When they
all share one layout, the manifest says so (``lmdb_layout`` ``"fixed-records"``
and the ``schema``): a batch of them is then gathered straight into the
caller's arrays, as a column batch is.

Why at commit and not while writing: shard writers in several processes write
samples in any order, and a chunk needs all its rows. The commit reads each
record once (its checksum verified, so a record damaged between write and
commit is not given a fresh checksum) and writes the chunks into a new
environment that replaces the old data file; a generation that does not fit
that way (mixed structures, compression, a full disk) keeps its records.

Stores created before this layout (``format`` 1 in ``store.json``) keep
writing records, so the cachestore that made them can still read them; their
generations, and record generations of any store, read as before.
"""

from __future__ import annotations

import os
import shutil
import struct
from pathlib import Path
from typing import Callable, Sequence, TypeAlias

import lmdb
import numpy as np
import numpy.typing as npt

from ..errors import MalformedFileError
from ..format import codec, records
from ..format.checksums import checksum, first_mismatch, flat_rows, row_checksums
from ..format.codec import Leaf, LeafSpec, TreeDef, row_bytes
from ..format.structure import parse_treedef
from ..space.disk import is_out_of_space
from .manifest import Manifest

CHUNK_KEY = struct.Struct(">cIQ")
SUMS = 0xFFFFFFFF  # the leaf number of a chunk's checksums
#: Bytes of one chunk, all leaves together.
CHUNK_BYTES = 4 << 20
#: Chunk bytes written per write transaction of the conversion.
TXN_BYTES = 64 << 20
LAYOUT = "columns"  # manifest "lmdb_layout"
#: Manifest "lmdb_layout" of wide records that all share one fixed layout (no rewrite).
RECORDS = "fixed-records"
#: Samples wider than this keep one record each (see the module docstring).
MAX_ROW_BYTES = 4096
_SUM = struct.Struct("<Q")

#: A read transaction whose values are buffers into LMDB's map (``begin(buffers=True)``).
Txn: TypeAlias = "lmdb.Transaction[memoryview]"
#: The manifest fields of a layout (see :func:`convert`): plain JSON values.
LayoutFields: TypeAlias = dict[str, object]


def chunk_key(leaf: int, chunk: int) -> bytes:
    """The key of chunk `chunk` of `leaf` (:data:`SUMS`: its checksums)."""
    return CHUNK_KEY.pack(b"C", leaf, chunk)


def num_chunks(n: int, chunk_rows: int) -> int:
    """Chunks of `chunk_rows` rows that `n` samples take."""
    return -(-n // chunk_rows)


def convert(txn: Txn, n: int, target: Path, record_key: Callable[[int], bytes],
            corrupt: Callable[[int, str], Exception], one_layout: list[object] | None = None) -> LayoutFields | None:
    """Write the `n` records read through `txn` as chunks into a new environment at `target`.

    Returns the manifest fields of the columnar layout, or ``None`` (nothing left at
    `target`) when the records do not share one fixed, uncompressed, stackable
    layout or the disk has no room for the copy: the generation then keeps its records.
    Wide samples (over ``MAX_ROW_BYTES``) keep their records too; when the shards reported
    that every record has one layout (`one_layout`: ``[record bytes, structure]``, the same
    as record 0's), they get the fields of :data:`RECORDS` (nothing written at `target`).
    """
    first = txn.get(record_key(0))
    if first is None or len(first) <= _SUM.size:
        raise corrupt(0, "its record is missing or truncated")
    layout = records.record_layout(memoryview(first)[_SUM.size:])
    if layout is None or not codec.is_stackable(layout[0]):
        return None
    treedef, head, spans = layout
    specs = codec.leaf_specs(treedef)
    widths = row_bytes(specs)
    size, prefix = len(first), bytes(first[_SUM.size:_SUM.size + head])
    if sum(widths) > MAX_ROW_BYTES:
        return _fixed_records(treedef, size, one_layout)
    chunk_rows = max(1, CHUNK_BYTES // max(1, sum(widths)))
    try:
        # lock=False: this process alone writes the new environment, and LMDB maps its lock file
        # writable (a first touch of a page without a block, on a full disk, is a SIGBUS).
        env = lmdb.open(str(target), map_size=1 << 40, writemap=False, sync=False, metasync=False,
                        readahead=False, max_dbs=0, lock=False)
    except (lmdb.Error, OSError):  # no room even for an empty environment: keep the records
        shutil.rmtree(target, ignore_errors=True)
        return None
    try:
        pending: list[tuple[bytes, bytes]] = []
        pending_bytes = 0
        for c in range(num_chunks(n, chunk_rows)):
            lo, hi = c * chunk_rows, min(n, (c + 1) * chunk_rows)
            cols = [np.empty((hi - lo, w), np.uint8) for w in widths]
            for r, i in enumerate(range(lo, hi)):
                value = txn.get(record_key(i))
                if value is None or len(value) != size or value[_SUM.size:_SUM.size + head] != prefix:
                    _give_up(env, target)  # another structure: keep the records
                    return None
                if checksum([value[_SUM.size:]]) != _SUM.unpack_from(value)[0]:
                    raise corrupt(i, "checksum mismatch while committing")
                for col, (start, nbytes) in zip(cols, spans):
                    col[r] = np.frombuffer(value, np.uint8, nbytes, _SUM.size + start)
            sums = np.asarray(row_checksums(cols, hi - lo), dtype="<u8")
            pending += [(chunk_key(k, c), col.tobytes()) for k, col in enumerate(cols)]
            pending.append((chunk_key(SUMS, c), sums.tobytes()))
            pending_bytes += sum(col.nbytes for col in cols)
            if pending_bytes >= TXN_BYTES:
                _put(env, pending)
                pending, pending_bytes = [], 0
        _put(env, pending)
        env.sync(True)
    except lmdb.Error:
        # LMDB reports a full disk as MDB_MAP_FULL, a disk error or a bare EIO at commit: the
        # copy is an optimisation, so any failure to write it keeps the (sound) records.
        _give_up(env, target)
        return None
    except OSError as exc:
        _give_up(env, target)
        if is_out_of_space(exc):
            return None
        raise
    except BaseException:
        _give_up(env, target)
        raise
    env.close()
    return {"lmdb_layout": LAYOUT, "schema": codec.treedef_to_json(treedef), "chunk_rows": chunk_rows}


def _fixed_records(treedef: TreeDef, size: int, one_layout: list[object] | None) -> LayoutFields | None:
    """The manifest fields of wide records that all share record 0's layout, else ``None``.

    Such a generation keeps its records, but says its batch layout up front, so a batch can
    be gathered straight into a caller's arrays (a worker's shared-memory slot) instead of
    into new ones copied there after. Whether they all share it comes from the shards, which
    compared every record they wrote: reading each record's header here would map each
    record's first page into the training process, at every commit. Each record's checksum
    is still verified when it is read, and a record of another
    layout in such a generation is damage.
    """
    if one_layout is None or not isinstance(one_layout[0], int) or one_layout[0] + _SUM.size != size:
        return None
    try:
        if parse_treedef(one_layout[1], "a shard's layout") != treedef:
            return None
    except MalformedFileError:
        return None
    return {"lmdb_layout": RECORDS, "schema": codec.treedef_to_json(treedef)}


def stackable_schema(manifest: Manifest, where: str) -> TreeDef:
    """The structure every sample of a fixed-layout generation has (its manifest's ``schema``),
    checked: one whose leaves cannot be stacked (str, bytes, None) is no layout a commit writes."""
    schema = parse_treedef(manifest["schema"], f"{where} ('schema')")
    if not codec.is_stackable(schema):
        raise MalformedFileError(f"{where}: its 'schema' has leaves that are not stacked in columns")
    return schema


def _put(env: lmdb.Environment, items: list[tuple[bytes, bytes]]) -> None:
    with env.begin(write=True) as txn:
        for key, value in items:
            txn.put(key, value)


def _give_up(env: lmdb.Environment, target: Path) -> None:
    env.close()
    shutil.rmtree(target, ignore_errors=True)


class Columns:
    """Reads one columnar generation (see the module docstring) through an LMDB environment."""

    def __init__(self, manifest: Manifest, num_samples: int, corrupt: Callable[[int, str], Exception]) -> None:
        self.schema = stackable_schema(manifest, "manifest")
        self.specs = codec.leaf_specs(self.schema)
        self.widths = row_bytes(self.specs)
        self.chunk_rows = int(manifest["chunk_rows"])
        self.n = num_samples
        self.corrupt = corrupt

    def entries(self) -> int:
        """Values a sound generation holds: one per chunk and leaf, plus the checksums."""
        return num_chunks(self.n, self.chunk_rows) * (len(self.specs) + 1)

    def _chunk(self, txn: Txn, leaf: int, chunk: int, index: int) -> npt.NDArray[np.uint8]:
        """Chunk `chunk` of `leaf` as ``(rows, width)`` bytes, read in place (valid within `txn`)."""
        rows = min(self.chunk_rows, self.n - chunk * self.chunk_rows)
        width = _SUM.size if leaf == SUMS else self.widths[leaf]
        value = txn.get(chunk_key(leaf, chunk))
        if value is None or len(value) != rows * width:
            raise self.corrupt(index, "its chunk is missing or has the wrong size")
        return np.frombuffer(value, np.uint8).reshape(rows, width)

    def read(self, txn: Txn, i: int, verify: bool) -> list[Leaf]:
        """The leaves of sample `i`, copied out of the map."""
        c, r = divmod(i, self.chunk_rows)
        rows = [self._chunk(txn, k, c, i)[r] for k in range(len(self.specs))]
        if verify and checksum(rows) != int(self._chunk(txn, SUMS, c, i)[r].view("<u8")[0]):
            raise self.corrupt(i, "checksum mismatch")
        return [row.view(dtype).reshape(shape).copy() for row, (dtype, shape) in zip(rows, self.specs)]

    def gather(self, txn: Txn, idx: npt.NDArray[np.int64], out: list[Leaf] | None, verify: bool) -> list[Leaf]:
        """Rows `idx` (checked) into `out`: per chunk touched, one get per leaf and one copy."""
        n = idx.size
        if out is None:
            out = [np.empty((n, *shape), dtype=dtype) for dtype, shape in self.specs]
        dest = flat_rows(out, n)
        chunks, within = np.divmod(idx, self.chunk_rows)
        order = np.argsort(chunks, kind="stable")
        bounds = np.flatnonzero(np.diff(chunks[order])) + 1
        expected = np.empty(n if verify else 0, dtype="<u8")
        for group in np.split(order, bounds) if n else []:
            c, rows = int(chunks[group[0]]), within[group]
            first = int(idx[group[0]])
            for k, d in enumerate(dest):
                if not d.shape[1]:
                    continue
                # Rows as single void items: the fancy index then copies whole rows, not bytes.
                row = np.dtype((np.void, d.shape[1]))
                d.view(row)[group, 0] = self._chunk(txn, k, c, first).view(row)[rows, 0]
            if verify:
                expected[group] = self._chunk(txn, SUMS, c, first).view("<u8")[rows, 0]
        if verify:
            bad = first_mismatch(row_checksums(dest, n), expected.tolist())
            if bad is not None:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")
        return out


def replace_data(staging: Path, target: Path) -> None:
    """Make the converted environment at `target` the generation's data file."""
    os.replace(target / "data.mdb", staging / "data.mdb")
    shutil.rmtree(target, ignore_errors=True)
