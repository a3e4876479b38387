"""Generations made of parts: node k of m computes part k, publishes it, fetches the others.

**Parts.** Part ``k`` of ``m`` is the samples ``k*n//m .. (k+1)*n//m - 1`` (:func:`part_range`):
a contiguous range, so a part's rows of each column are one slice of the column, published as
one file, and placed back into a staging area's column with one write.

**Local form.** A part is computed into the local store's staging area of the generation
(a writer's, or the shared area ranks write together) like any samples: shard files
(``<shard>.seg``, ``<shard>.idx``) and the columns. :func:`publish_part` takes the part's
samples from there - for each index the first copy that passes its checksum, so a
duplicate a killed writer left never wins - as the files ``index.bin`` (index rows, records
re-addressed into ``records.seg``), ``records.seg``, ``col-K.bin`` (the part's slice of each
column) and ``schema.json``, packed and published like a generation (:mod:`.publish`); its
manifest ``part-KKKK.json`` goes last. :func:`fetch_parts` places a downloaded part into a
staging area as one more shard (``remote-pKKKK-<hex>.seg`` / ``.idx``, the index written
last, after the data it names) and its column slices at their rows, every record verified;
the ordinary commit then merges it with the rest.

**Complete.** Once all ``m`` part manifests are there, whoever sees it first (the publisher
of the last part, or a fetcher) writes the generation's manifest, naming every part's files:
the generation is then visible like one published whole (conditional create: one wins).

**Claims.** :func:`claim_part` creates ``claim-KKKK.<attempt>`` with a conditional create
(``If-None-Match: *``), so two nodes never both win a part. With a ``timeout``, a part
claimed longer ago than that and still unpublished can be claimed again (the next attempt,
again a conditional create: one taker). A server that ignores conditional creates is found
out by a probe (two creates of one key must not both succeed) and then claims fall back to
writing one's own claim object, waiting :data:`SETTLE_SECONDS`, and taking the part only if
one's own is the earliest (server time, then name) of that attempt.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from .. import codec, safefs
from ..backends.memmap_files import COLUMN, INDEX_DTYPE, SCHEMA, col_name, read_rows
from ..checksums import checksum, row_checksums
from ..errors import CacheStoreError, GenerationNotFoundError
from ..store import Store
from ..records import encode_record
from ..untrusted import parse_json, parse_treedef
from . import layout
from .errors import ObjectNotFoundError, RemoteManifestError
from .fetch import download_set, object_sizes
from .manifest import (GenerationManifest, PartManifest, encode, generation_doc, parse_part, part_doc)
from .packing import Source
from .publish import PublishHandle, upload_set
from .verify import _check_record, check_treedef

if TYPE_CHECKING:
    from .store import RemoteStore

log = logging.getLogger(__name__)

SETTLE_SECONDS = 2.0
_PROBED: dict[str, bool] = {}


def part_range(num_samples: int, part: int, nparts: int) -> tuple[int, int]:
    """``(start, stop)``: the samples of part `part` of `nparts` of a generation of `num_samples`."""
    if not 0 <= part < nparts <= layout.MAX_PARTS:
        raise ValueError(f"part {part} of {nparts}: need 0 <= part < nparts <= {layout.MAX_PARTS}")
    return part * num_samples // nparts, (part + 1) * num_samples // nparts


def node_name() -> str:
    """This process's name in claims and part manifests: host and pid."""
    return f"{socket.gethostname()[:48]}:{os.getpid()}"


@dataclass(frozen=True)
class Claim:
    """A part this node won: compute it, then :func:`publish_part` it."""

    generation: int
    part: int
    nparts: int
    attempt: int
    node: str


@dataclass(frozen=True)
class RemoteGeneration:
    """What the remote holds of one generation: complete, or the parts published and claimed so far."""

    id: int
    complete: bool
    num_samples: int | None = None
    nparts: int | None = None
    published: tuple[int, ...] = ()
    claimed: tuple[int, ...] = ()
    extra: dict[str, Any] = field(default_factory=dict)


# claims ------------------------------------------------------------------------------
def conditional_puts(remote: "RemoteStore") -> bool:
    """Whether the server honours conditional creates (probed once per process and root)."""
    if remote.settings.conditional_put != "auto":
        return remote.settings.conditional_put == "yes"
    root = str(remote.settings.url)
    if root not in _PROBED:
        key = f"{layout.parts_prefix(remote.key, 0)}/probe-{secrets.token_hex(8)}"
        first = remote.client.put_new(key, b"1")
        second = remote.client.put_new(key, b"2")
        remote.client.delete([key])
        _PROBED[root] = first and not second
        if not _PROBED[root]:
            log.warning("%s does not honour conditional creates (If-None-Match); part claims wait %.0f s and "
                        "compare instead", root, SETTLE_SECONDS)
    return _PROBED[root]


def _claims(remote: "RemoteStore", generation: int, part: int, nparts: int) -> dict[int, list[tuple[float, str]]]:
    """The claims of a part by attempt: ``[(server time, name), ...]``."""
    out: dict[int, list[tuple[float, str]]] = {}
    for info in remote.client.list_objects(layout.parts_prefix(remote.key, generation, nparts)):
        name = info.key.rsplit("/", 1)[-1]
        base = name.split("@", 1)[0]
        parsed = layout.parse_claim(base)
        if parsed is not None and parsed[0] == part:
            out.setdefault(parsed[1], []).append((info.modified, name))
    return out


def claim_part(remote: "RemoteStore", generation: int, part: int, nparts: int, *, node: str | None = None,
               timeout: float | None = None) -> Claim | None:
    """Claim part `part` of `nparts` of `generation` for this node: the :class:`Claim` when it won, else ``None``
    (published already, claimed by another node, or claimed less than `timeout` seconds ago)."""
    part_range(0, part, nparts)
    node = node or node_name()
    if remote.client.head(layout.part_manifest(remote.key, generation, part, nparts)) is not None:
        return None
    claims = _claims(remote, generation, part, nparts)
    if claims:
        latest = max(claims)
        age = time.time() - min(t for t, _ in claims[latest])
        if timeout is None or age < timeout:
            return None
        attempt = latest + 1
        log.warning("part %d of %d of generation %d was claimed %.0f s ago and is not published: claiming it again",
                    part, nparts, generation, age)
    else:
        attempt = 0
    body = json.dumps({"node": node, "time": time.time()}).encode()
    key = layout.claim_key(remote.key, generation, part, nparts, attempt)
    if conditional_puts(remote):
        won = remote.client.put_new(key, body)
    else:
        mine = f"{key}@{secrets.token_hex(8)}"
        remote.client.put(mine, body)
        time.sleep(SETTLE_SECONDS)  # a claimant that wrote at the same time is listed by now
        first = min(_claims(remote, generation, part, nparts).get(attempt, []), default=None)
        won = first is not None and first[1] == mine.rsplit("/", 1)[-1]
    return Claim(generation, part, nparts, attempt, node) if won else None


# publishing a part -------------------------------------------------------------------------
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
    specs = codec.leaf_specs(parse_treedef(safefs.read_json(schema_path), str(schema_path))) if schema_path.exists() else []
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


def publish_part(remote: "RemoteStore", local: Store, staging: str, generation: int, num_samples: int, part: int,
                 nparts: int, *, node: str | None = None) -> PartManifest:
    """Publish part `part` of `nparts` of `generation` from the memmap staging area `staging` of `local`.

    Returns the part's manifest (an existing one when the part was published already). Completes the
    generation on the remote when this was the last part missing (:func:`complete_parts`).
    """
    start, stop = part_range(num_samples, part, nparts)
    if local.backend_name != "memmap":
        raise CacheStoreError("parts are published from a memmap store's staging area")
    remote.ensure_doc(local)
    key = layout.part_manifest(remote.key, generation, part, nparts)
    if remote.client.head(key) is None:
        sources = part_sources(Path(staging), start, stop)
        handle = PublishHandle(f"part {part} of {nparts} of generation {generation}", sum(s.size for s in sources))
        fs = upload_set(remote, generation, layout.part_set(part, nparts), sources, start, stop, handle)
        pm = PartManifest(remote.key, generation, num_samples, part, nparts, node or node_name(), fs, time.time())
        remote.client.put_new(key, encode(part_doc(pm)))
    found = published_parts(remote, generation, nparts, [part])[part]
    complete_parts(remote, generation, nparts)
    return found


def published_parts(remote: "RemoteStore", generation: int, nparts: int,
                    parts: list[int] | None = None) -> dict[int, PartManifest]:
    """The manifests of the published parts among `parts` (all by default)."""
    out = {}
    for k in (range(nparts) if parts is None else parts):
        key = layout.part_manifest(remote.key, generation, k, nparts)
        try:
            data = remote.client.get(key)
        except ObjectNotFoundError:
            continue
        out[k] = parse_part(data, f"{remote.settings.url}/{key}", remote.key, generation, k, nparts)
    ns = {pm.num_samples for pm in out.values()}
    if len(ns) > 1:
        raise RemoteManifestError(f"parts of generation {generation} on {remote.path} disagree on the sample count")
    return out


def complete_parts(remote: "RemoteStore", generation: int, nparts: int) -> bool:
    """Write the generation's manifest when every part is published; whether the generation is complete."""
    key = layout.generation_manifest(remote.key, generation)
    if remote.client.head(key) is not None:
        return True
    found = published_parts(remote, generation, nparts)
    if len(found) < nparts:
        return False
    pms = [found[k] for k in range(nparts)]
    m = GenerationManifest(remote.key, generation, pms[0].num_samples, remote.backend_name, "parts",
                           tuple(pm.set for pm in pms), max(pm.created for pm in pms))
    remote.client.put_new(key, encode(generation_doc(m)))
    return True


# fetching parts ------------------------------------------------------------------------------
def fetch_parts(remote: "RemoteStore", local: Store, generation: int, nparts: int, *, into: str | None = None,
                parts: list[int] | None = None) -> list[int]:
    """Download parts of `generation` into `local`.

    Parameters
    ----------
    into
        A memmap staging area of the generation (the caller's writer's, or a shared area): the
        parts are placed into it as shards, for the caller's commit. ``None``: every part is
        fetched into a new writer's staging area, which is committed.
    parts
        Which parts (default: all). A part already placed into `into` is skipped.

    Returns
    -------
    list of int
        The parts placed.

    Raises
    ------
    GenerationNotFoundError
        A part asked for is not published (yet).
    """
    wanted = list(range(nparts)) if parts is None else list(parts)
    found = published_parts(remote, generation, nparts, wanted)
    missing = [k for k in wanted if k not in found]
    if missing:
        raise GenerationNotFoundError(f"parts {missing} of {nparts} of generation {generation} are not published "
                                      f"on {remote.path} yet")
    if into is not None:
        target = Path(into)
        placed = [k for k in wanted if not list(target.glob(f"remote-p{k:04d}-*.idx"))]
        for k in placed:
            place_part(remote, local, found[k], target)
        return placed
    n = next(iter(found.values())).num_samples
    writer = local.writer(generation, n)
    try:
        for k in wanted:
            place_part(remote, local, found[k], Path(writer.token.path))
        writer.commit()
    except BaseException:
        writer.abort()
        raise
    return wanted


def place_part(remote: "RemoteStore", local: Store, pm: PartManifest, staging: Path) -> None:
    """Download part `pm` into the memmap staging area `staging` as one shard, verified; its index last."""
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
            _check_record(rec, allow_pickle, f"{where}: sample {int(row['index'])}", seen)
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


# listing ---------------------------------------------------------------------------------------
def remote_generations(remote: "RemoteStore") -> list[RemoteGeneration]:
    """Every generation the remote knows of: complete ones, and those of which parts are published or claimed."""
    out: dict[int, RemoteGeneration] = {}
    for g in remote.generation_ids():
        m = remote.manifest(g)
        out[g] = RemoteGeneration(g, True, m.num_samples, len(m.sets) if m.layout == "parts" else None,
                                  extra={"layout": m.layout, "bytes": m.nbytes})
    seen: dict[tuple[int, int], tuple[set[int], set[int]]] = {}
    for info in remote.client.list_objects(f"{remote.key}/parts"):
        bits = info.key.split("/")
        if len(bits) < 4 or not bits[-3].isdigit() or not bits[-2].startswith("of-") or not bits[-2][3:].isdigit():
            continue
        g, nparts, name = int(bits[-3]), int(bits[-2][3:]), bits[-1]
        published, claimed = seen.setdefault((g, nparts), (set(), set()))
        if name.startswith("part-") and name.endswith(".json") and name[5:-5].isdigit():
            published.add(int(name[5:-5]))
        elif (c := layout.parse_claim(name.split("@", 1)[0])) is not None:
            claimed.add(c[0])
    for (g, nparts), (published, claimed) in sorted(seen.items()):
        if g not in out:
            out[g] = RemoteGeneration(g, False, None, nparts, tuple(sorted(published)), tuple(sorted(claimed)))
    return [out[g] for g in sorted(out)]
