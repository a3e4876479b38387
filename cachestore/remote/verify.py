"""Checking a generation that came from a remote before it becomes a local one.

Every record is verified against the store's own checksums, and nothing is decoded
further than its structure: a pickled leaf is never loaded here, and a generation whose
samples hold one is refused unless the local store allows pickle (a remote is untrusted
input). The structure itself is checked (known leaf kinds, no object dtypes) before any
array is made from it.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from ..backends.base import Backend
from ..backends.manifest import check_generation
from ..backends.memmap_files import COLUMN, INDEX_DTYPE, SCHEMA, col_name
from ..backends.reading import GenerationData
from ..errors import CorruptSampleError
from ..format import codec
from ..format.checksums import checksum, row_checksums
from ..format.codec import TreeDef
from ..format.records import decode_record
from ..format.structure import parse_treedef
from ..guard import safefs
from ..guard.untrusted import read_document
from .errors import RemoteManifestError

#: Rows verified per read of a fixed-layout generation.
BLOCK_BYTES = 16 << 20
#: Bytes of the rows :class:`ColumnCheck` hashes at once.
LANDING_BYTES = 1 << 20
#: The index of a memmap generation (what :class:`ColumnCheck` needs first, with the schema).
INDEX = "index.npy"
_KINDS = {*codec.CONTAINERS, "n", "a", "t", "g", "i", "f", "b", "s", "y", "p"}


def _nodes(node: Any, depth: int = 0) -> Iterator[Any]:
    if depth > 64 or not isinstance(node, tuple) or not node or node[0] not in _KINDS:
        raise ValueError("not a sample structure this cachestore knows")
    yield node
    if node[0] in codec.CONTAINERS:
        for child in codec.children(node):
            yield from _nodes(child, depth + 1)


def check_treedef(treedef: TreeDef, allow_pickle: bool, where: str) -> None:
    """Refuse a structure with a pickled leaf (unless `allow_pickle`), an unknown node or an object dtype."""
    try:
        nodes = list(_nodes(treedef))
        specs = codec.leaf_specs(treedef)
    except (ValueError, TypeError, IndexError, KeyError) as exc:
        raise CorruptSampleError(f"{where}: its sample structure is invalid ({exc})") from None
    if any(dtype.hasobject for dtype, _ in specs):
        raise CorruptSampleError(f"{where}: its sample structure names an object dtype")
    if not allow_pickle and any(n[0] == "p" for n in nodes):
        raise CorruptSampleError(f"{where}: its samples hold pickled leaves, which are never loaded from a remote "
                                 "unless the store is opened with allow_pickle=True (pickle runs code)")


def verify_memmap_dir(gen_dir: Path, allow_pickle: bool, where: str, limit: int | None = None,
                      columns_checked: bool = False) -> None:
    """Check every record of the memmap generation in `gen_dir` (files checked by the caller); none is
    decompressed past its index row's size nor `limit` (the store's ``max_sample_bytes``). The rows in
    columns are skipped when `columns_checked` (a :class:`ColumnCheck` of this directory finished)."""
    rows = _load_index(gen_dir / INDEX, where)
    n = len(rows)
    if not np.array_equal(rows["index"], np.arange(n)):
        raise CorruptSampleError(f"{where}: its index does not list samples 0..{n - 1} in order")
    try:
        shards = read_document(gen_dir / "shards.json")
    except (OSError, ValueError) as exc:
        raise CorruptSampleError(f"{where}: its shards.json is unreadable ({exc})") from None
    if not isinstance(shards, list) or not all(isinstance(s, str) and "/" not in s and not s.startswith(".")
                                               for s in shards):
        raise CorruptSampleError(f"{where}: shards.json is not a list of shard names")
    in_cols = rows["shard"] == COLUMN
    if np.any(in_cols) and not columns_checked:
        _verify_columns(gen_dir, rows, in_cols, allow_pickle, where)
    for k, shard in enumerate(shards):
        mine = np.flatnonzero(rows["shard"] == k)
        if mine.size:
            _verify_records(gen_dir / f"{shard}.seg", rows[mine], allow_pickle, where, limit)
    if np.any((rows["shard"] != COLUMN) & ((rows["shard"] < 0) | (rows["shard"] >= len(shards)))):
        raise CorruptSampleError(f"{where}: its index names a shard that is not there")


def _load_index(path: Path, where: str) -> Any:
    try:
        rows = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise CorruptSampleError(f"{where}: its index is unreadable ({exc})") from None
    if rows.dtype != INDEX_DTYPE or rows.ndim != 1:
        raise CorruptSampleError(f"{where}: its index is not of this format")
    return rows


def _verify_columns(gen_dir: Path, rows: Any, in_cols: Any, allow_pickle: bool, where: str) -> None:
    try:
        schema = parse_treedef(read_document(gen_dir / SCHEMA), str(gen_dir / SCHEMA))
    except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise CorruptSampleError(f"{where}: its schema is unreadable ({exc})") from None
    check_treedef(schema, allow_pickle, where)
    specs = codec.leaf_specs(schema)
    widths = codec.row_bytes(specs)
    n = len(rows)
    cols = []
    for k, width in enumerate(widths):
        path = gen_dir / col_name(k)
        size = path.stat().st_size
        if size < n * width:
            raise CorruptSampleError(f"{where}: {col_name(k)} is truncated")
        cols.append(np.memmap(path, dtype=np.uint8, mode="r", shape=(n, width)) if width and n else
                    np.zeros((n, width), dtype=np.uint8))
    idx = np.flatnonzero(in_cols)
    block = max(1, BLOCK_BYTES // max(1, sum(widths)))
    for lo in range(0, idx.size, block):
        chosen = idx[lo:lo + block]
        a, b = int(chosen[0]), int(chosen[-1]) + 1
        # Consecutive rows (every sample in columns, the usual case) are a view: no copy of the data.
        parts = [c[a:b] if b - a == chosen.size else np.ascontiguousarray(c[chosen]) for c in cols]
        sums = np.array(row_checksums(parts, chosen.size), dtype=np.uint64)
        bad = np.flatnonzero(sums != rows["checksum"][chosen])
        if bad.size:
            raise CorruptSampleError(f"{where}: sample {int(chosen[bad[0]])} fails its checksum")


class ColumnCheck:
    """Every column row of a memmap generation checked against its index as its bytes land.

    Made once ``index.npy`` and ``schema.json`` are in `gen_dir` (downloaded first); the download
    then tells :meth:`landed` of each verified chunk of the columns, and the rows whose bytes are
    all in are hashed at once, in blocks of about :data:`LANDING_BYTES`, by the download thread that
    completed them: while the other requests are in flight, and from the processor's cache the chunk
    just went through. The columns are not read a second time after the download (that pass read
    the whole generation back from memory, the fetch waiting). :meth:`finish` checks what never
    landed whole (a column shorter than its rows), :meth:`close` gives the files back.
    """

    def __init__(self, gen_dir: Path, allow_pickle: bool, where: str) -> None:
        rows = _load_index(gen_dir / INDEX, where)
        try:
            schema = parse_treedef(read_document(gen_dir / SCHEMA), str(gen_dir / SCHEMA))
        except (OSError, ValueError, TypeError, KeyError, IndexError) as exc:
            raise CorruptSampleError(f"{where}: its schema is unreadable ({exc})") from None
        check_treedef(schema, allow_pickle, where)
        self.dir, self.where = gen_dir, where
        self.widths = codec.row_bytes(codec.leaf_specs(schema))
        self.n = len(rows)
        self.sums = rows["checksum"].copy()
        self.in_cols = rows["shard"] == COLUMN
        self.rows = max(1, LANDING_BYTES // max(1, sum(self.widths)))  # rows per block
        starts = np.arange(0, self.n, self.rows)
        per_block = np.minimum(starts + self.rows, self.n) - starts
        # Bytes of each (column, block) still to land: block j is checked once missing[:, j] is all zero.
        self.missing = np.outer(np.array(self.widths, dtype=np.int64), per_block)
        self.checked = np.zeros(starts.size, dtype=bool)
        self.lock = threading.Lock()
        self.maps: dict[int, Any] = {}

    def landed(self, name: str, at: int, n: int) -> None:
        """Bytes ``at..at+n-1`` of file `name` are in (verified); check the blocks they complete."""
        if not (name.startswith("col-") and name.endswith(".bin") and name[4:-4].isdigit()):
            return
        k = int(name[4:-4])
        if k >= len(self.widths) or not self.widths[k] or not self.n:
            return
        span = self.rows * self.widths[k]
        end = min(at + n, self.n * self.widths[k])
        ready = []
        with self.lock:
            for j in range(at // span, -(-end // span)):
                self.missing[k, j] -= max(0, min(end, (j + 1) * span) - max(at, j * span))
                if not self.checked[j] and not self.missing[:, j].any():
                    self.checked[j] = True
                    ready.append(j)
        for j in ready:
            self._check(j)

    def finish(self) -> None:
        """Check every block not checked yet (a column shorter than its rows is damage)."""
        for k, w in enumerate(self.widths):
            st = safefs.lstat_or_none(self.dir / col_name(k))
            if w and self.n and (st is None or st.st_size < self.n * w):
                raise CorruptSampleError(f"{self.where}: {col_name(k)} is truncated")
        for j in np.flatnonzero(~self.checked).tolist():
            self.checked[j] = True
            self._check(j)

    def close(self) -> None:
        """Give the column files back (their mappings)."""
        with self.lock:
            self.maps.clear()

    def _check(self, j: int) -> None:
        a, b = j * self.rows, min(self.n, (j + 1) * self.rows)
        parts = [self._column(k)[a:b] if w else np.zeros((b - a, 0), dtype=np.uint8)
                 for k, w in enumerate(self.widths)]
        sums = np.array(row_checksums(parts, b - a), dtype=np.uint64)
        bad = np.flatnonzero((sums != self.sums[a:b]) & self.in_cols[a:b])
        if bad.size:
            raise CorruptSampleError(f"{self.where}: sample {a + int(bad[0])} fails its checksum")

    def _column(self, k: int) -> Any:
        """Column `k`'s rows, mapped (hashed where they lie: the chunk just went through the processor's cache)."""
        with self.lock:
            if k not in self.maps:
                path = self.dir / col_name(k)
                st = safefs.lstat_or_none(path)
                if st is None or st.st_size < self.n * self.widths[k]:
                    raise CorruptSampleError(f"{self.where}: {col_name(k)} is truncated")
                self.maps[k] = np.memmap(path, dtype=np.uint8, mode="r", shape=(self.n, self.widths[k]))
            return self.maps[k]


def _verify_records(seg: Path, rows: Any, allow_pickle: bool, where: str, limit: int | None) -> None:
    st = safefs.lstat_or_none(seg)
    size = st.st_size if st is not None else -1
    ends = rows["offset"] + rows["length"]
    if np.any(rows["offset"] < 0) or np.any(rows["length"] < 0) or (rows.size and int(ends.max()) > size):
        raise CorruptSampleError(f"{where}: a record lies outside {seg.name}")
    data = np.memmap(seg, dtype=np.uint8, mode="r") if size > 0 else np.zeros(0, dtype=np.uint8)
    seen: set[str] = set()
    for row in rows:
        start, length = int(row["offset"]), int(row["length"])
        rec = data[start:start + length]
        if checksum([rec]) != int(row["checksum"]):
            raise CorruptSampleError(f"{where}: sample {int(row['index'])} fails its checksum")
        check_record(rec, allow_pickle, f"{where}: sample {int(row['index'])}", seen, int(row["raw"]), limit)


def check_record(rec: Any, allow_pickle: bool, where: str, seen: set[str], raw: int | None = None,
                 limit: int | None = None) -> None:
    """A record's structure is valid (checked once per distinct structure); a compressed one is
    decompressed to at most `raw` (its index row's size) and `limit` bytes (see :func:`decode_record`)."""
    try:
        treedef, _ = decode_record(rec, copy=False, raw=raw, limit=limit)
    except (CorruptSampleError, ValueError, TypeError, KeyError, IndexError) as exc:
        raise CorruptSampleError(f"{where} does not decode ({exc})") from None
    text = json.dumps(codec.treedef_to_json(treedef))
    if text not in seen:
        check_treedef(treedef, allow_pickle, where)
        seen.add(text)


def verify_generation(backend: Backend, gen_dir: Path, generation: int, num_samples: int, allow_pickle: bool,
                      where: str, columns_checked: bool = False) -> None:
    """Check a generation directory fetched from a remote as a commit would have left it, then every record
    (those in columns already, when `columns_checked`: a :class:`ColumnCheck` of `gen_dir` finished).

    Raises
    ------
    RemoteManifestError
        It is not the generation the remote's manifest announced (generation, sample count).
    CorruptSampleError
        A file is missing or damaged, a record fails its checksum or holds a pickled leaf.
    """
    check_files = getattr(backend, "_check_files", lambda d, m: None)
    manifest, damage = check_generation(gen_dir, generation, check_files, max_sample_bytes=backend.max_sample_bytes)
    if damage is not None:
        raise CorruptSampleError(f"{where}: {damage.replace(str(gen_dir), 'the downloaded generation')}")
    if manifest.get("num_samples") != num_samples:
        raise RemoteManifestError(f"{where}: the generation holds {manifest.get('num_samples')} samples, its remote "
                                  f"manifest announced {num_samples}")
    if backend.name == "memmap":
        verify_memmap_dir(gen_dir, allow_pickle, where, backend.max_sample_bytes, columns_checked)
        return
    opener = getattr(backend, "_open")
    data: GenerationData = opener(gen_dir, manifest)
    data.bound_samples(backend.max_sample_bytes)
    try:
        _verify_generic(data, allow_pickle, where)
    finally:
        data.close()


def _verify_generic(data: GenerationData, allow_pickle: bool, where: str) -> None:
    """Every record of another backend's generation (LMDB), without unpickling anything."""
    layout = data.batch_layout()
    n = len(data)
    if layout is not None:
        treedef, specs = layout
        check_treedef(treedef, allow_pickle, where)
        step = max(1, BLOCK_BYTES // max(1, sum(codec.row_bytes(specs))))
        for lo in range(0, n, step):
            hi = min(n, lo + step)
            out = [np.empty((hi - lo, *shape), dtype=dtype) for dtype, shape in specs]
            data.read_batch(np.arange(lo, hi), out=out)
        return
    leaves_of = getattr(data, "_leaves", None)
    env = getattr(data, "env", None)
    if leaves_of is None or env is None:
        raise CorruptSampleError(f"{where}: records of the {type(data).__name__} layout cannot be verified")
    from ..backends.lmdb_generation import record_key

    seen: set[str] = set()
    with env.begin() as txn:
        for i in range(n):
            treedef, _ = leaves_of(i, txn.get(record_key(i)), False)
            text = json.dumps(codec.treedef_to_json(treedef))
            if text not in seen:
                check_treedef(treedef, allow_pickle, f"{where}: sample {i}")
                seen.add(text)
