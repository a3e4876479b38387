"""A generation's manifest: what a commit records, and the cheap checks listing makes of it.

The manifest (``manifest.json``, written last by a commit) records the generation,
its sample count and layout, the size of every data file and its own checksum, so
listing finds a missing, garbage or edited manifest, a missing, truncated or
symlinked file, without reading data (see :mod:`.directory`, "Damage after a commit").
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any, Callable, TypeAlias

import xxhash

from ..errors import MalformedFileError
from ..format import codec
from ..format.structure import parse_treedef
from ..guard import safefs, untrusted
from ..guard.trust import OWN, Trust
from . import settling

MANIFEST_NAME = "manifest.json"

#: A generation's ``manifest.json`` (or the fields a backend adds to it): JSON whose common
#: fields :func:`check_generation` has checked; each backend reads its own (hence ``Any``).
Manifest: TypeAlias = dict[str, Any]


def check_generation(gen_dir: Path, generation: int, check_files: Callable[[Path, Manifest], str | None],
                     trust: Trust = OWN, max_sample_bytes: int | None = None) -> tuple[Manifest, str | None]:
    """``(manifest, why it is damaged or None)`` from cheap checks: owners (`trust`), names,
    manifest, file sizes, then the backend's own `check_files`, then the manifest's checksum.

    A generation another user made is damage unless `trust` names that user: in a prefix others
    can write, one put in place of the job's own (correct checksums, other values) would
    otherwise be served (see :mod:`cachestore.guard.trust`); the job writes its own instead.

    A generation directory is only ever made by a commit (a rename of a finished
    staging area), so one without a readable manifest, or whose files do not have
    the sizes the manifest recorded, is damage - not a commit in progress.

    Raises
    ------
    FileNotFoundError
        `gen_dir` is gone (removed by a concurrent prune).
    """
    kind = safefs.describe_entry(gen_dir)
    if kind == "missing":
        raise FileNotFoundError(gen_dir)
    if kind != "a directory":
        return {}, f"{gen_dir} is {kind}, not a generation directory the store made"
    foreign = trust.why_not(gen_dir, gen_dir.lstat(), "the generation directory")
    if foreign is not None:
        return {}, foreign
    path = gen_dir / MANIFEST_NAME
    try:
        manifest = untrusted.read_document(path, "a generation manifest", trust=trust)
    except FileNotFoundError:
        if not os.path.lexists(gen_dir):
            raise
        return {}, f"{path} is missing"
    except (OSError, ValueError) as exc:
        return {}, f"{path} is a symlink" if os.path.islink(path) else f"{path} is unreadable ({exc})"
    try:
        manifest = untrusted.parse_manifest(manifest, str(path), generation)
        schema = parse_treedef(manifest["schema"], f"{path} ('schema')") if "schema" in manifest else None
    except MalformedFileError as exc:
        partial = manifest if isinstance(manifest, dict) else {}
        return partial, f"{path} is invalid: {exc}"
    if max_sample_bytes is not None and schema is not None:
        one = sum(codec.row_bytes(codec.leaf_specs(schema)))
        if one > max_sample_bytes:
            return manifest, (f"{path}: a sample of its schema takes {one} bytes, more than the store's "
                              f"max_sample_bytes ({max_sample_bytes}): pass a larger one to read it")
    files = manifest.get("files", {})  # recorded at commit (checked names and sizes); older stores have none
    for name, expected in sorted(files.items()):
        st = safefs.lstat_or_none(gen_dir / name)
        if st is None and not os.path.lexists(gen_dir):
            raise FileNotFoundError(gen_dir)  # renamed away by a prune while we looked
        if st is None or not stat.S_ISREG(st.st_mode):
            state = "missing" if st is None else safefs.describe_entry(gen_dir / name)
            return manifest, f"{gen_dir / name} is {state} (the manifest records a file of {expected} bytes)"
        if (foreign := trust.why_not(gen_dir / name, st, "the file")) is not None:
            return manifest, foreign
        if st.st_size != expected:
            how = "truncated" if st.st_size < expected else "longer than written"
            return manifest, f"{gen_dir / name} is {how}: {st.st_size} bytes, the manifest recorded {expected}"
    damage = settling.damage(gen_dir) or check_files(gen_dir, manifest)
    if damage is None and "checksum" in manifest and manifest["checksum"] != manifest_checksum(manifest):
        damage = f"{path} does not match its checksum (edited or damaged since the commit)"
    if damage is not None and not os.path.lexists(gen_dir):
        raise FileNotFoundError(gen_dir)  # renamed away by a prune while we looked: gone, not damaged
    return manifest, damage


def manifest_checksum(manifest: Manifest) -> str:
    """xxh3 of a manifest's canonical JSON (its ``checksum`` field left out).

    Listing compares it, so a manifest edited or damaged in place (a sample
    count that no longer matches the data, say) is found without reading data.
    """
    body = {k: v for k, v in manifest.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True, default=str).encode())


def manifest_int(manifest: Manifest, key: str) -> int:
    """The int field `key` of `manifest`, 0 when it is absent or not an int."""
    value = manifest.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0
