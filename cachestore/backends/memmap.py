"""The default backend: plain files, memory-mapped for reading.

The files and their layout are described in :mod:`.memmap_files`; a shard writes
them (:mod:`.memmap_shard`), a reader maps a committed generation
(:mod:`.memmap_generation`), a resuming writer reads a staging area back
(:mod:`.memmap_staging`), and a generation is read by byte ranges where its files are not local
(:mod:`.memmap_ranges`: the remote tier's direct reads). This module is the catalog side: the commit's merge of the
shards' indexes, the adoption of a partial generation, the checks of a listing.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from pathlib import Path

import numpy as np

from ..format import codec
from ..guard import safefs
from ..guard.claims import shard_tag
from ..guard.safefs import fsync_dir
from .base import ShardWriter, StagingToken
from .directory import DirectoryBackend
from .manifest import Manifest
from .memmap_files import (COLUMN, INDEX_DTYPE, SCHEMA, check_index, col_name, generation_schema, load_schema,
                           read_rows, read_shard_ids, reserve, truncate)
from .memmap_generation import MemmapGeneration
from .memmap_shard import MemmapShard
from .memmap_staging import StagingRecords
from .reading import GenerationData, StagingData
from .staging import check_complete, in_range


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
        parts = []
        for k, shard_id in enumerate(shard_ids):
            rows = read_rows(staging / f"{shard_id}.idx").copy()
            rows["shard"][rows["shard"] != COLUMN] = k
            parts.append(rows)
        rows = np.concatenate(parts) if parts else np.zeros(0, dtype=INDEX_DTYPE)
        n = check_complete(rows["index"], num_samples, f"generation in {staging}")
        rows = rows[np.argsort(rows["index"], kind="stable")]
        schema = load_schema(staging)
        in_cols = int(np.count_nonzero(rows["shard"] == COLUMN))
        if schema is not None:
            for k, rowbytes in enumerate(codec.row_bytes(codec.leaf_specs(schema))):
                # Rows of samples kept in segments are holes in a column: their blocks are reserved.
                (reserve if in_cols < n else truncate)(staging / col_name(k), n * rowbytes)
        with os.fdopen(safefs.create_new(staging / "index.npy"), "wb") as f:
            np.save(f, rows)
        safefs.write_new(staging / "shards.json", json.dumps(shard_ids).encode())
        layout = "fixed" if n and in_cols == n else ("records" if in_cols == 0 else "mixed")
        summary: Manifest = {"num_samples": n, "layout": layout, "raw_bytes": int(rows["raw"].sum()),
                             "stored_bytes": int(rows["length"].sum())}
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
            rows = read_rows(path)
            index = rows["index"].astype(np.int64)
            inside = (index >= 0) & (index < len(tags))
            keep = np.zeros(len(rows), dtype=bool)
            keep[inside] = tags[index[inside]] == shard_tag(path.name[:-4])
            if keep.all():
                continue
            tmp = staging / f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
            safefs.write_new(tmp, rows[keep].tobytes())
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
