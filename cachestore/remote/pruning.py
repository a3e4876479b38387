"""What ``prune`` removes from a remote store.

* Complete generations beyond the newest `keep`, except those a reader holds a lease on
  (:mod:`.leases`): the manifest goes first (the generation stops being visible), then its data.
* Data no manifest names: objects of a generation whose manifest names others (another node
  published it first), and data of generations without a manifest (an interrupted publish,
  parts of a generation never completed) once older than :data:`STALE_SECONDS`, or at once
  with `partial`. Claims and part manifests of removed or stale generations go with them.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from ..pruning import Removed
from . import layout
from .leases import LEASE_SECONDS, leased_generations

if TYPE_CHECKING:
    from .client import ObjectInfo
    from .base import RemoteBase

#: Age after which data no manifest names is an interrupted publish that nobody will finish.
STALE_SECONDS = 24 * 3600.0


def prune_remote(remote: "RemoteBase", keep: int, dry_run: bool, partial: bool) -> list[Removed]:
    """Remove (or with `dry_run` list) what the module docstring says; return it."""
    if keep < 0:
        raise ValueError("keep must be >= 0")
    now = time.time()
    ids = remote.generation_ids()
    leased = leased_generations(remote, now)
    doomed = [g for g in ids[:max(0, len(ids) - keep)] if g not in leased]
    removed: list[Removed] = []
    data: dict[int, list[ObjectInfo]] = {}
    for info in remote.client.list_objects(f"{remote.key}/data"):
        bits = info.key.split("/")
        if len(bits) >= 4 and bits[-3].isdigit():
            data.setdefault(int(bits[-3]), []).append(info)
    parts: dict[int, list[ObjectInfo]] = {}
    for info in remote.client.list_objects(f"{remote.key}/parts"):
        bits = info.key.split("/")
        if len(bits) >= 3 and bits[-3].isdigit():
            parts.setdefault(int(bits[-3]), []).append(info)
    keys: list[str] = []
    for g in doomed:
        m = remote.manifest(g)
        keys.append(layout.generation_manifest(remote.key, g))
        objs = data.pop(g, []) + parts.pop(g, [])
        keys += [o.key for o in objs]
        removed.append(Removed("generation", f"{remote.path}/generations/{g:06d}.json", m.nbytes, g))
    for g in sorted(set(data) | set(parts)):
        objs = data.get(g, []) + parts.get(g, [])
        if g in ids:
            named = {f"{s.name}/{name}" for s in remote.manifest(g).sets for name, _ in s.objects}
            stray = [o for o in data.get(g, []) if "/".join(o.key.split("/")[-2:]) not in named]
            if stray:
                keys += [o.key for o in stray]
                removed.append(Removed("unnamed", f"{remote.path}/data/{g:06d}", sum(o.size for o in stray), g))
            continue
        newest = max(o.modified for o in objs)
        if g in leased or not (partial or now - newest > STALE_SECONDS):
            continue
        keys += [o.key for o in objs]
        removed.append(Removed("partial", f"{remote.path}/data/{g:06d}", sum(o.size for o in data.get(g, [])), g))
    stale_leases = [o.key for o in remote.client.list_objects(layout.readers_prefix(remote.key))
                    if now - o.modified > LEASE_SECONDS]
    if not dry_run:
        # The manifests first: a generation is never visible with part of its data gone.
        manifests = [k for k in keys if "/generations/" in k]
        remote.client.delete(manifests)
        remote.client.delete([k for k in keys if "/generations/" not in k] + stale_leases)
    return removed
