"""Generations made of parts: node k of m computes part k, publishes it, fetches the others.

**Parts.** Part ``k`` of ``m`` is the samples ``k*n//m .. (k+1)*n//m - 1`` (:func:`part_range`):
a contiguous range, so a part's rows of each column are one slice of the column, published as
one file, and placed back into a staging area's column with one write.

**Local form.** A part is computed into the local store's staging area of the generation
(a writer's, or the shared area ranks write together) like any samples: shard files
(``<shard>.seg``, ``<shard>.idx``) and the columns. :func:`publish_part` takes the part's
files from there (:mod:`.part_files`) and publishes them like a generation (:mod:`.publish`);
its manifest ``part-KKKK.json`` goes last. :func:`fetch_parts` places a downloaded part into a
staging area as one more shard, every record verified (:mod:`.placing`); the ordinary commit
then merges it with the rest.

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

from . import layout
from ..errors import CacheStoreError, GenerationNotFoundError
from ..guard.claims import DONE_NAME, Claims
from ..store import Store
from .errors import ObjectNotFoundError, RemoteManifestError
from .manifest import (MAX_DOC_BYTES, GenerationManifest, PartManifest, encode, generation_doc, parse_part,
                       part_doc)
from .part_files import part_sources
from .placing import place_part
from .publish import PublishHandle, upload_set

if TYPE_CHECKING:
    from .base import RemoteBase

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
def conditional_puts(remote: "RemoteBase") -> bool:
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


def _claims(remote: "RemoteBase", generation: int, part: int, nparts: int) -> dict[int, list[tuple[float, str]]]:
    """The claims of a part by attempt: ``[(server time, name), ...]``."""
    out: dict[int, list[tuple[float, str]]] = {}
    for info in remote.client.list_objects(layout.parts_prefix(remote.key, generation, nparts)):
        name = info.key.rsplit("/", 1)[-1]
        base = name.split("@", 1)[0]
        parsed = layout.parse_claim(base)
        if parsed is not None and parsed[0] == part:
            out.setdefault(parsed[1], []).append((info.modified, name))
    return out


def claim_part(remote: "RemoteBase", generation: int, part: int, nparts: int, *, node: str | None = None,
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
def publish_part(remote: "RemoteBase", local: Store, staging: str, generation: int, num_samples: int, part: int,
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


def published_parts(remote: "RemoteBase", generation: int, nparts: int,
                    parts: list[int] | None = None) -> dict[int, PartManifest]:
    """The manifests of the published parts among `parts` (all by default)."""
    out = {}
    for k in (range(nparts) if parts is None else parts):
        key = layout.part_manifest(remote.key, generation, k, nparts)
        try:
            data = remote.client.get_document(key, MAX_DOC_BYTES)
        except ObjectNotFoundError:
            continue
        out[k] = parse_part(data, f"{remote.settings.url}/{key}", remote.key, generation, k, nparts)
    ns = {pm.num_samples for pm in out.values()}
    if len(ns) > 1:
        raise RemoteManifestError(f"parts of generation {generation} on {remote.path} disagree on the sample count")
    return out


def complete_parts(remote: "RemoteBase", generation: int, nparts: int) -> bool:
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
def fetch_parts(remote: "RemoteBase", local: Store, generation: int, nparts: int, *, into: str | None = None,
                parts: list[int] | None = None) -> list[int]:
    """Download parts of `generation` into `local`.

    Parameters
    ----------
    into
        A memmap staging area of the generation (the caller's writer's, or a shared area): the
        parts are placed into it as shards, for the caller's commit (in an area written together,
        :mod:`cachestore.write.shared`, their samples are marked done there). ``None``: every part is
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
            shard = place_part(remote, local, found[k], target)
            _mark_done(target, found[k], shard)
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


def _mark_done(area: Path, pm: PartManifest, shard: str) -> None:
    """In an area written together (:mod:`cachestore.write.shared`), mark the placed part's samples done in
    `shard`: its commit keeps, for each sample, the copy the done map names."""
    if not (area / DONE_NAME).exists():
        return
    claims = Claims(area, pm.num_samples)
    try:
        claims.finish(range(pm.set.start, pm.set.stop), shard)
    finally:
        claims.close()


# listing ---------------------------------------------------------------------------------------
def remote_generations(remote: "RemoteBase") -> list[RemoteGeneration]:
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
