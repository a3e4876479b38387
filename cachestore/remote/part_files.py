"""A part's files, taken from a memmap staging area for publishing.

:func:`part_sources` takes the part's samples from the staging area - for each index the
first copy that passes its checksum, so a duplicate a killed writer left never wins - as the
files ``index.bin`` (index rows, records re-addressed into ``records.seg``), ``records.seg``,
``col-K.bin`` (the part's slice of each column) and ``schema.json`` (see :mod:`.parts`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import xxhash

from ..backends.memmap_files import COLUMN, INDEX_DTYPE, SCHEMA, col_name, read_rows
from ..errors import CacheStoreError
from ..format import codec
from ..format.checksums import row_checksums
from ..format.structure import parse_treedef
from ..guard import safefs
from ..guard.untrusted import read_document
from .packing import Source


def part_sources(staging: Path, start: int, stop: int) -> list[Source]:
    """The files of part ``start..stop-1`` from a memmap staging area (see the module docstring).

    Raises
    ------
    CacheStoreError
        A sample of the part is not in the area (or no copy of it passes its checksum).
    """
    safefs.require_real_dir(staging, "staging area")
    found: list[tuple[Any, str]] = []
    for path in sorted(staging.glob("*.idx")):
        rows = read_rows(path)
        rows = rows[(rows["index"] >= start) & (rows["index"] < stop)]
        if rows.size:
            found.append((rows, path.name[:-4]))
    n = stop - start
    chosen: list[Any] = [None] * n
    shard_of: list[str] = [""] * n
    schema_path = staging / SCHEMA
    specs = codec.leaf_specs(parse_treedef(read_document(schema_path), str(schema_path))) if schema_path.exists() else []
    widths = codec.row_bytes(specs)
    slot_sums = _column_sums(staging, start, stop, widths, found)
    for rows, shard in found:
        for row in rows:
            i = int(row["index"]) - start
            if chosen[i] is not None:
                continue
            if int(row["shard"]) == COLUMN:
                ok = slot_sums.get(i) == int(row["checksum"])
            else:
                ok = _record_sum(staging / f"{shard}.seg", int(row["offset"]), int(row["length"])) == int(row["checksum"])
            if ok:
                chosen[i], shard_of[i] = row, shard
    missing = [start + i for i, row in enumerate(chosen) if row is None]
    if missing:
        raise CacheStoreError(f"the part {start}..{stop - 1} of {staging} is incomplete: {len(missing)} samples "
                              f"missing or damaged (e.g. {missing[:5]}); it cannot be published")
    index = np.zeros(n, dtype=INDEX_DTYPE)
    records: list[tuple[str, int, int]] = []
    pos = 0
    last_col = -1
    for i, row in enumerate(chosen):
        index[i] = row
        if int(row["shard"]) == COLUMN:
            index[i]["offset"] = 0
            last_col = i
        else:
            index[i]["shard"], index[i]["offset"] = 0, pos
            records.append((str(staging / f"{shard_of[i]}.seg"), int(row["offset"]), int(row["length"])))
            pos += int(row["length"])
    index["pad"] = 0
    sources = [Source("index.bin", data=index.tobytes())]
    if records:
        sources.append(Source("records.seg", records))
    if last_col >= 0:
        sources.append(Source(SCHEMA, data=safefs.read_bytes(schema_path)))
        for k, w in enumerate(widths):
            sources.append(Source(col_name(k), [(str(staging / col_name(k)), start * w, (last_col + 1) * w)]
                                  if w else []))
    return sources


def _record_sum(seg: Path, offset: int, length: int) -> int | None:
    fd = safefs.open_nofollow(seg, os.O_RDONLY)
    try:
        data = os.pread(fd, length, offset)
    finally:
        os.close(fd)
    return xxhash.xxh3_64_intdigest(data) if len(data) == length else None


def _column_sums(staging: Path, start: int, stop: int, widths: list[int], found: list[tuple[Any, str]]) -> dict[int, int]:
    """The checksum of what each column slot of the part holds, for the samples some row puts there."""
    wanted = sorted({int(r["index"]) - start for rows, _ in found for r in rows if int(r["shard"]) == COLUMN})
    if not wanted or not widths:
        return {}
    last = wanted[-1] + 1
    cols = []
    for k, w in enumerate(widths):
        size = os.path.getsize(staging / col_name(k))
        if size < (start + last) * w:
            return {}  # a column shorter than its rows: none of them verifies
        cols.append(np.memmap(staging / col_name(k), dtype=np.uint8, mode="r", offset=start * w, shape=(last, w))
                    if w else np.zeros((last, 0), dtype=np.uint8))
    idx = np.array(wanted, dtype=np.int64)
    sums = row_checksums([np.ascontiguousarray(c[idx]) for c in cols], idx.size)
    return dict(zip(wanted, sums))
