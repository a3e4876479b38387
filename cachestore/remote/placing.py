"""Placing a downloaded part into a memmap staging area, every record verified.

:func:`place_part` downloads part ``k`` into the area as one more shard
(``remote-pKKKK-<hex>.seg`` / ``.idx``, the index written last, after the data it names) and
its column slices at their rows; a part whose columns hold another structure than the
area's becomes records of its shard. The ordinary commit then merges it with the rest
(see :mod:`.parts`).
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from ..backends.memmap_files import COLUMN, INDEX_DTYPE, SCHEMA, col_name
from ..format import codec
from ..format.checksums import checksum, row_checksums
from ..format.records import encode_record
from ..format.structure import parse_treedef
from ..guard import safefs
from ..guard.untrusted import parse_json
from ..store import Store
from .download import download_set, object_sizes
from .errors import RemoteManifestError
from .manifest import PartManifest
from .verify import check_record, check_treedef

if TYPE_CHECKING:
    from .base import RemoteBase


def place_part(remote: "RemoteBase", local: Store, pm: PartManifest, staging: Path) -> str:
    """Download part `pm` into the memmap staging area `staging` as one shard, verified; its index last.
    Returns the shard's name."""
    fs = pm.set
    object_sizes(remote, pm.generation, fs)
    shard = f"remote-p{pm.part:04d}-{secrets.token_hex(3)}"
    tmp_index = staging / f".{shard}.idx.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    tmp_schema = staging / f".{shard}.schema.{os.getpid()}.{secrets.token_hex(4)}.tmp"
    schema_file = fs.file(SCHEMA)
    widths = [0]
    convert: list[bool] = [False]  # the area's columns hold another structure: this part's go to records
    tmp_cols: dict[str, Path] = {}

    def place(name: str) -> tuple[Path, int, bool]:
        if name == "index.bin":
            return tmp_index, 0, True
        if name == "records.seg":
            return staging / f"{shard}.seg", 0, True
        if name == SCHEMA:
            return tmp_schema, 0, True
        if name.startswith("col-") and name.endswith(".bin") and name[4:-4].isdigit():
            if convert[0]:
                tmp_cols[name] = staging / f".{shard}.{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp"
                return tmp_cols[name], 0, True
            return staging / name, pm.set.start * widths[int(name[4:-4])], False
        raise RemoteManifestError(f"part {pm.part} of generation {pm.generation} on {remote.path} holds a file "
                                  f"{name!r} a part does not have")

    if schema_file is not None:  # the columns' widths decide where their slices go: read the schema first
        schema_fs = type(fs)(fs.name, fs.start, fs.stop, fs.objects, (schema_file,))
        download_set(remote, pm.generation, schema_fs, staging, place)
        schema = parse_treedef(parse_json(safefs.read_bytes(tmp_schema), str(tmp_schema)), str(tmp_schema))
        check_treedef(schema, local.allow_pickle, f"part {pm.part} of generation {pm.generation}")
        widths = codec.row_bytes(codec.leaf_specs(schema))
        convert[0] = not _claim_schema(staging, tmp_schema)
        rest = tuple(f for f in fs.files if f.name != SCHEMA)
        fs = type(fs)(fs.name, fs.start, fs.stop, fs.objects, rest)
    try:
        for f in fs.files:
            if f.name.startswith("col-") and (not f.name[4:-4].isdigit() or int(f.name[4:-4]) >= len(widths)
                                              or schema_file is None):
                raise RemoteManifestError(f"part {pm.part} of generation {pm.generation} holds {f.name!r} beyond "
                                          "its schema's columns")
        download_set(remote, pm.generation, fs, staging, place)
        if convert[0]:
            _columns_to_records(staging, shard, tmp_index, tmp_cols, schema, pm)
            widths = []
        _verify_part(staging, shard, tmp_index, pm, widths, local.allow_pickle)
        os.rename(tmp_index, staging / f"{shard}.idx")
        safefs.fsync_dir(staging)
        return shard
    except BaseException:
        for path in (tmp_index, staging / f"{shard}.seg"):
            if os.path.lexists(path):
                safefs.unlink_name(path)
        raise
    finally:
        for path in tmp_cols.values():
            if os.path.lexists(path):
                safefs.unlink_name(path)


def _claim_schema(staging: Path, tmp: Path) -> bool:
    """Make `tmp` the area's schema (a link: the first writer wins); whether the area's schema is the same
    structure (``False``: another node's first sample claimed another one, as a shard's can)."""
    try:
        os.link(tmp, staging / SCHEMA)
        return True
    except FileExistsError:
        if safefs.read_bytes(staging / SCHEMA) == safefs.read_bytes(tmp):
            return True
        mine = parse_treedef(parse_json(safefs.read_bytes(tmp), str(tmp)), str(tmp))
        return bool(mine == parse_treedef(parse_json(safefs.read_bytes(staging / SCHEMA), str(staging / SCHEMA)),
                                       str(staging / SCHEMA)))
    finally:
        safefs.unlink_name(tmp)


def _columns_to_records(staging: Path, shard: str, index_path: Path, cols: dict[str, Path], schema: Any,
                        pm: PartManifest) -> None:
    """Make the part's column samples records of its shard (each verified first), for an area whose
    columns hold another structure; the index is rewritten to match."""
    where = f"part {pm.part} of generation {pm.generation}"
    rows = np.frombuffer(safefs.read_bytes(index_path), dtype=INDEX_DTYPE).copy()
    if len(rows) != pm.set.stop - pm.set.start:
        raise RemoteManifestError(f"{where}: its index does not hold one row per sample")
    specs = codec.leaf_specs(schema)
    widths = codec.row_bytes(specs)
    in_cols = np.flatnonzero(rows["shard"] == COLUMN)
    held = int(in_cols[-1]) + 1 if in_cols.size else 0  # a part's columns end at its last column sample
    maps = []
    for k, w in enumerate(widths):
        path = cols.get(col_name(k))
        size = os.path.getsize(path) if path is not None else 0
        if w and held and (path is None or size < held * w):
            raise RemoteManifestError(f"{where}: {col_name(k)} is missing or too short")
        maps.append(np.memmap(path, dtype=np.uint8, mode="r", shape=(held, w)) if w and held and path is not None
                    else np.zeros((held, 0), dtype=np.uint8))
    fd = safefs.open_nofollow(staging / f"{shard}.seg", os.O_WRONLY | os.O_CREAT | os.O_APPEND)
    try:
        pos = os.fstat(fd).st_size
        for j in np.flatnonzero(rows["shard"] == COLUMN).tolist():
            leaves = [np.frombuffer(m[j].tobytes(), dtype=dtype).reshape(shape) for m, (dtype, shape) in zip(maps, specs)]
            if checksum(leaves) != int(rows[j]["checksum"]):
                raise CorruptPart(f"{where}: sample {int(rows[j]['index'])} fails its checksum")
            rec = encode_record(schema, leaves)
            os.write(fd, rec)
            rows[j]["shard"], rows[j]["offset"], rows[j]["length"] = 0, pos, len(rec)
            rows[j]["checksum"] = xxhash.xxh3_64_intdigest(rec)
            pos += len(rec)
        os.fsync(fd)
    finally:
        os.close(fd)
    safefs.unlink_name(index_path)
    safefs.write_new(index_path, rows.tobytes())


def _verify_part(staging: Path, shard: str, index_path: Path, pm: PartManifest, widths: list[int],
                 allow_pickle: bool) -> None:
    """Every row of a placed part: in range, once, inside its file, passing its checksum."""
    where = f"part {pm.part} of generation {pm.generation}"
    raw = safefs.read_bytes(index_path)
    start, stop = pm.set.start, pm.set.stop
    if len(raw) != (stop - start) * INDEX_DTYPE.itemsize:
        raise RemoteManifestError(f"{where}: its index does not hold one row per sample")
    rows = np.frombuffer(raw, dtype=INDEX_DTYPE)
    if not np.array_equal(rows["index"], np.arange(start, stop)):
        raise RemoteManifestError(f"{where}: its index does not list samples {start}..{stop - 1} in order")
    in_cols = rows["shard"] == COLUMN
    recs = rows[~in_cols]
    if recs.size:
        seg = staging / f"{shard}.seg"
        size = os.path.getsize(seg)
        if np.any(recs["shard"] != 0) or np.any(recs["offset"] < 0) or np.any(recs["length"] < 0) \
                or int((recs["offset"] + recs["length"]).max()) > size:
            raise RemoteManifestError(f"{where}: a record lies outside its segment")
        data = np.memmap(seg, dtype=np.uint8, mode="r")
        seen: set[str] = set()
        for row in recs:
            rec = data[int(row["offset"]):int(row["offset"]) + int(row["length"])]
            if checksum([rec]) != int(row["checksum"]):
                raise CorruptPart(f"{where}: sample {int(row['index'])} fails its checksum")
            check_record(rec, allow_pickle, f"{where}: sample {int(row['index'])}", seen)
    if np.any(in_cols):
        idx = np.flatnonzero(in_cols) + start
        cols = [np.memmap(staging / col_name(k), dtype=np.uint8, mode="r", shape=(int(idx[-1]) + 1, w))
                if w else np.zeros((int(idx[-1]) + 1, 0), dtype=np.uint8) for k, w in enumerate(widths)]
        sums = row_checksums([np.ascontiguousarray(c[idx]) for c in cols], idx.size)
        bad = np.flatnonzero(np.array(sums, dtype=np.uint64) != rows["checksum"][in_cols])
        if bad.size:
            raise CorruptPart(f"{where}: sample {int(idx[bad[0]])} fails its checksum")


class CorruptPart(RemoteManifestError):
    """A part whose records do not match their checksums."""
