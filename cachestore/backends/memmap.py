"""The default backend: plain files, memory-mapped for reading.

The files and their layout are described in :mod:`.memmap_files`; a shard writes
them (:mod:`.memmap_shard`), a reader maps a committed generation
(:mod:`.memmap_generation`), a resuming writer reads a staging area back
(:mod:`.memmap_staging`), and a generation is read by byte ranges where its files are not local
(:mod:`.memmap_ranges`: the remote tier's direct reads). This module is the catalog side: the commit's merge of the
shards' indexes, the adoption of a partial generation, the checks of a listing.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import stat
from pathlib import Path
from typing import BinaryIO

import numpy as np

from ..format import codec
from ..guard import safefs
from ..guard.claims import shard_tag
from ..guard.safefs import fsync_dir
from .base import ShardWriter, StagingToken
from .directory import DirectoryBackend
from .manifest import Manifest
from .memmap_files import (COLUMN, INDEX_DTYPE, SCHEMA, check_index, col_name, generation_schema, iter_rows,
                           load_schema, read_rows, read_shard_ids, reserve, truncate)
from .memmap_generation import MemmapGeneration
from .memmap_shard import MemmapShard
from .memmap_staging import StagingRecords
from .reading import GenerationData, StagingData
from .staging import check_complete, in_range


#: Rows of a shard's index read at once while a commit merges the shards' indexes (3 MiB).
MERGE_ROWS = 1 << 16
#: A commit writes the merged index in at most this many ranges of sample indices, each read from every
#: shard's index in turn: what it holds at once is the indices column (8 bytes a sample) and one range's
#: rows (1/8 of 48 bytes a sample), not the whole index three times over while the workers that wrote
#: it still live (docs/ARCHITECTURE.md, "Memory with many workers").
MERGE_RANGES = 8


def _index_summary(paths: list[Path]) -> tuple[np.ndarray, int, int, int]:
    """The sample indices the shards' indexes at `paths` hold (in the shards' order, then the rows'),
    and their sums of raw and stored bytes and count of rows stored in the columns."""
    indices, raw, stored, in_cols = [], 0, 0, 0
    for path in paths:
        for rows in iter_rows(path, MERGE_ROWS):
            indices.append(rows["index"].copy())
            raw += int(rows["raw"].sum())
            stored += int(rows["length"].sum())
            in_cols += int(np.count_nonzero(rows["shard"] == COLUMN))
    written = np.concatenate(indices) if indices else np.zeros(0, dtype=np.int64)
    return written, raw, stored, in_cols


def _write_merged(f: BinaryIO, paths: list[Path], n: int) -> None:
    """Write to `f` the ``.npy`` of the shards' index rows at `paths` ordered by sample index, each
    row's shard the place of its shard in `paths` (rows stored in the columns keep ``COLUMN``).

    The rows must hold each index ``0..n-1`` exactly once (``check_complete``): the row of index ``i``
    is then row ``i`` of the file. The file is the one ``np.save`` writes of the sorted rows.
    """
    np.lib.format.write_array_header_1_0(f, {"descr": np.lib.format.dtype_to_descr(INDEX_DTYPE),
                                             "fortran_order": False, "shape": (n,)})
    span = max(MERGE_ROWS, -(-n // MERGE_RANGES))
    for start in range(0, n, span):
        stop = min(n, start + span)
        out = np.empty(stop - start, dtype=INDEX_DTYPE)
        for k, path in enumerate(paths):
            for rows in iter_rows(path, MERGE_ROWS):
                index = rows["index"]
                part = rows[(index >= start) & (index < stop)]  # a copy: rows are read-only
                part["shard"][part["shard"] != COLUMN] = k
                out[part["index"] - start] = part
        f.write(out.tobytes())


def _logged_here(rows: np.ndarray, tags: np.ndarray, tag: int) -> np.ndarray:
    """Which of a shard's index `rows` hold the copy of their sample the done map `tags` names: the
    shard's `tag` is the one written there."""
    index = rows["index"].astype(np.int64)
    inside = (index >= 0) & (index < len(tags))
    keep = np.zeros(len(rows), dtype=bool)
    keep[inside] = tags[index[inside]] == tag
    return keep


class MemmapBackend(DirectoryBackend):
    """Generations of plain files (:mod:`.memmap_files`), memory-mapped for reading."""

    name = "memmap"
    supports_zero_copy = True
    supports_shared_write = True
    supports_streaming = True

    def _shard(self, token: StagingToken, shard_id: str) -> ShardWriter:
        return MemmapShard(token, shard_id)

    def discard_shard_tail(self, token: StagingToken, shard_id: str, keep: int) -> None:
        path = Path(token.path) / f"{shard_id}.idx"
        if path.exists():
            truncate(path, min(path.lstat().st_size, keep * INDEX_DTYPE.itemsize))

    def _finalize(self, staging: Path, num_samples: int | None) -> Manifest:
        shard_ids = sorted(p.name[:-4] for p in staging.glob("*.idx"))
        paths = [staging / f"{shard_id}.idx" for shard_id in shard_ids]
        written, raw, stored, in_cols = _index_summary(paths)
        n = check_complete(written, num_samples, f"generation in {staging}")
        del written
        schema = load_schema(staging)
        if schema is not None:
            for k, rowbytes in enumerate(codec.row_bytes(codec.leaf_specs(schema))):
                # Rows of samples kept in segments are holes in a column: their blocks are reserved.
                (reserve if in_cols < n else truncate)(staging / col_name(k), n * rowbytes)
        with os.fdopen(safefs.create_new(staging / "index.npy"), "wb") as f:
            _write_merged(f, paths, n)
        safefs.write_new(staging / "shards.json", json.dumps(shard_ids).encode())
        layout = "fixed" if n and in_cols == n else ("records" if in_cols == 0 else "mixed")
        summary: Manifest = {"num_samples": n, "layout": layout, "raw_bytes": raw, "stored_bytes": stored}
        if schema is not None:
            # Under the manifest's checksum: the row checksums cover bytes, not what they mean
            # (memmap_files.generation_schema).
            summary["schema"] = codec.treedef_to_json(schema)
        return summary

    def _open(self, gen_dir: Path, manifest: Manifest) -> GenerationData:
        return MemmapGeneration(gen_dir, manifest, self.verify, self.allow_pickle)

    # partial generations ----------------------------------------------------
    def _logged(self, staging: Path) -> np.ndarray:
        parts = [read_rows(path)["index"] for path in sorted(staging.glob("*.idx"))]
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _adopt_shards(self, staging: Path, prefix: str, num_samples: int | None) -> int:
        records = StagingRecords(staging, verify=True)
        seen: set[int] = set()
        for path in sorted(staging.glob("*.idx")):
            shard_id = path.name[:-4]
            rows = read_rows(path)
            keep = np.zeros(len(rows), dtype=bool)
            for k, row in enumerate(rows):
                i = int(row["index"])
                # Written twice (a re-run that raced a worker's death): the first copy that verifies.
                keep[k] = in_range(i, num_samples) and i not in seen and records.sound(shard_id, row)
                if keep[k]:
                    seen.add(i)
            new_id = prefix + shard_id
            if (staging / f"{shard_id}.seg").exists():
                os.rename(staging / f"{shard_id}.seg", staging / f"{new_id}.seg")
            safefs.write_new(staging / f"{new_id}.idx", rows[keep].tobytes())
            path.unlink()
        records.close()
        fsync_dir(staging)
        return len(seen)

    def keep_logged(self, token: StagingToken, tags: np.ndarray) -> None:
        staging = Path(token.path)
        for path in sorted(staging.glob("*.idx")):
            tag = shard_tag(path.name[:-4])
            # Read a range of rows at a time, twice where a row goes: a commit runs this while the workers
            # that wrote the shards still live (see MERGE_RANGES).
            with contextlib.closing(iter_rows(path, MERGE_ROWS)) as chunks:
                if all(_logged_here(rows, tags, tag).all() for rows in chunks):
                    continue
            tmp = staging / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            fd = safefs.create_new(tmp)
            try:
                for rows in iter_rows(path, MERGE_ROWS):
                    safefs.write_all(fd, rows[_logged_here(rows, tags, tag)].tobytes())
            finally:
                os.close(fd)
            os.replace(tmp, path)
        fsync_dir(staging)

    def open_staging(self, token: StagingToken) -> StagingData:
        return StagingRecords(Path(token.path), self.verify, token.num_samples if token.shared else None,
                              self.allow_pickle)

    def _check_files(self, gen_dir: Path, manifest: Manifest) -> str | None:
        # Headers and small files only: listing runs this for every generation.
        n = manifest["num_samples"]
        try:
            check_index(gen_dir / "index.npy", n)
            shard_ids = read_shard_ids(gen_dir)
            schema = generation_schema(gen_dir, manifest)
        except FileNotFoundError as exc:
            return f"{exc.filename} is missing"
        except (OSError, ValueError) as exc:  # MalformedFileError, SymlinkError among them
            return str(exc)
        specs = codec.leaf_specs(schema) if schema is not None else []
        if schema is None and n and manifest.get("layout") in ("fixed", "mixed"):
            return f"{gen_dir / SCHEMA} is missing"
        for k, rowbytes in enumerate(codec.row_bytes(specs)):
            col, needed = gen_dir / col_name(k), n * rowbytes
            st = safefs.lstat_or_none(col)
            if st is None or not stat.S_ISREG(st.st_mode):
                return f"{col} is {'missing' if st is None else safefs.describe_entry(col)}"
            if st.st_size < needed:
                return f"{col} is truncated: {st.st_size} bytes, {n} samples need {needed}"
        for shard_id in shard_ids:  # (a manifest with no "files" list, of an older store, did not say)
            seg = gen_dir / f"{shard_id}.seg"
            st = safefs.lstat_or_none(seg)
            if st is not None and not stat.S_ISREG(st.st_mode):
                return f"{seg} is {safefs.describe_entry(seg)}"
        return None
