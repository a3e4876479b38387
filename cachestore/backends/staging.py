"""Staging areas: their names, their producer records, and the check every commit makes.

A directory backend writes a generation into ``.staging-<generation>-<pid>-<hex>``
(see :mod:`.directory`). Every resuming writer's staging area records its producer
in ``staging.json`` (generation, sample count, compression and the hash of the
store's fingerprint): the next writer of the same generation whose record matches
adopts it (:meth:`~.base.Backend.adopt`); any other is debris. A commit first marks
the record ``committing`` (:func:`mark_committing`), since from then on the area is
no partial generation any more. Processes that write one generation together share
``.shared-<generation>-<fingerprint hash>`` instead (:mod:`cachestore.write.shared`); one
with no member left is a partial generation too, or debris when its producer differs.

:func:`check_complete` is the rule every backend's commit applies (the in-RAM one
included): each index ``0..n-1`` exactly once.
"""

from __future__ import annotations

import fcntl
import os
import secrets
from pathlib import Path
from typing import Sequence

import numpy as np
import numpy.typing as npt

from ..errors import CacheStoreError
from ..guard import safefs
from ..guard.trust import Trust
from ..guard.untrusted import decimal, read_document
from .base import ProducerRecord

STAGING_PREFIX = ".staging-"
STAGING_META = "staging.json"


def staging_dirname(generation: int, pid: int | None = None) -> str:
    """A new staging directory name for `generation`, owned by `pid` (this process by default)."""
    return f"{STAGING_PREFIX}{generation:06d}-{os.getpid() if pid is None else pid}-{secrets.token_hex(4)}"


def parse_staging(name: str) -> tuple[int, int] | None:
    """``(generation, pid)`` of a staging directory name, ``None`` if it is not one (ASCII digits only:
    see :func:`cachestore.guard.untrusted.decimal`)."""
    if not name.startswith(STAGING_PREFIX):
        return None
    parts = name[len(STAGING_PREFIX):].split("-")
    if len(parts) != 3 or not parts[2].isascii() or not parts[2].isalnum():
        return None
    generation, pid = decimal(parts[0]), decimal(parts[1])
    return None if generation is None or pid is None else (generation, pid)


def staging_record(staging: Path, trust: Trust | None = None) -> ProducerRecord | None:
    """The producer record of a staging area (``staging.json``), ``None`` when absent or unreadable,
    or (given `trust`) when another user than those it trusts owns the area or its record: such an
    area is nobody's to adopt or join (see :mod:`cachestore.guard.trust`)."""
    try:
        if trust is not None and trust.why_not(staging, staging.lstat(), "the staging area") is not None:
            return None
        record = read_document(staging / STAGING_META, "a staging record", 1 << 20, trust)
    except (OSError, ValueError):  # MalformedFileError among them: too large, too deep, not JSON
        return None
    return record if isinstance(record, dict) else None


def unshared_record(area: Path, trust: Trust | None) -> ProducerRecord:
    """A shared area's producer record (see :func:`staging_record`) less its ``shared`` mark: what an
    ordinary staging area of the same producer records."""
    return {k: v for k, v in (staging_record(area, trust) or {}).items() if k != "shared"}


def idle_shared_areas(root: Path, generation: int) -> list[Path]:
    """Shared staging areas of `generation` in the store `root` that nobody is a member of now."""
    if not root.is_dir():
        return []
    return [entry for entry in sorted(root.iterdir()) if parse_shared(entry.name) == generation
            and safefs.is_real_dir(entry) and not has_members(entry)]


def mark_committing(staging: Path) -> None:
    """Make a staging area unadoptable before its commit changes it.

    ``_finalize`` is not a step a later writer can resume: it drops the shards' logs and may
    rewrite the data (LMDB's columns, memmap's index), so a writer killed in the middle of it
    leaves an area whose samples no log describes. Such an area is debris, never a partial
    generation; without room for the mark, the record goes (an area without one is debris too).
    """
    record = staging_record(staging)
    if record is None:
        return
    try:
        safefs.write_json_atomic(staging / STAGING_META, {**record, "committing": True})
    except OSError:
        safefs.unlink_name(staging / STAGING_META)


def matches(found: ProducerRecord | None, wanted: ProducerRecord) -> bool:
    """Whether a staging record names the producer `wanted` names (every field `wanted` has);
    never one whose commit began (see :func:`mark_committing`)."""
    if found is None or wanted.get("fingerprint") is None or found.get("committing"):
        return False
    return all(found.get(f) == value for f, value in wanted.items() if f != "kept")


#: Shared staging areas (:mod:`cachestore.write.shared`): ``.shared-<generation>-<fingerprint hash>``, made under
#: ``.shared-tmp-<pid>-<hex>``; their members hold the lock file beside it (``<area>.members``) shared.
SHARED_PREFIX = ".shared-"
SHARED_TMP_PREFIX = ".shared-tmp-"
MEMBERS_SUFFIX = ".members"


def members_path(area: str | os.PathLike[str]) -> Path:
    """The lock file the members of the shared area `area` hold (beside it: it outlives a commit's rename)."""
    area = Path(area)
    return area.with_name(area.name + MEMBERS_SUFFIX)


def shared_dirname(generation: int, fingerprint: object) -> str:
    """The shared staging area of `generation` for the producer whose fingerprint hash is `fingerprint`."""
    return f"{SHARED_PREFIX}{generation:06d}-{str(fingerprint)[:16]}"


def parse_shared(name: str) -> int | None:
    """The generation of a shared staging area's name, ``None`` when `name` is not one."""
    if not name.startswith(SHARED_PREFIX) or name.startswith(SHARED_TMP_PREFIX) or name.endswith(MEMBERS_SUFFIX):
        return None
    head = name[len(SHARED_PREFIX):].split("-", 1)[0]
    return decimal(head)


def tmp_owner(name: str) -> int | None:
    """The pid that was creating a shared area under the temp name `name`, ``None`` when it is not one."""
    if not name.startswith(SHARED_TMP_PREFIX):
        return None
    head = name[len(SHARED_TMP_PREFIX):].split("-", 1)[0]
    return decimal(head)


def has_members(area: str | os.PathLike[str]) -> bool:
    """Whether a live process is a member of the shared area `area` (writes into it now)."""
    try:
        fd = safefs.open_nofollow(members_path(area), os.O_RDONLY)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def check_complete(indices: Sequence[int] | npt.NDArray[np.integer], num_samples: int | None, where: str) -> int:
    """Verify `indices` hold ``0..n-1`` exactly once; return n."""
    written = np.asarray(indices, dtype=np.int64)
    n = int(written.max()) + 1 if written.size else 0
    if num_samples is not None:
        if n > num_samples:
            raise CacheStoreError(f"{where}: index {n - 1} written but the generation has {num_samples} samples")
        n = num_samples
    counts = np.bincount(written, minlength=n) if written.size else np.zeros(n, dtype=np.int64)
    missing = np.flatnonzero(counts == 0)
    dup = np.flatnonzero(counts > 1)
    if missing.size or dup.size:
        parts = []
        if missing.size:
            parts.append(f"{missing.size} indices never written (e.g. {missing[:5].tolist()})")
        if dup.size:
            parts.append(f"{dup.size} written more than once (e.g. {dup[:5].tolist()})")
        raise CacheStoreError(f"{where} cannot be committed: {'; '.join(parts)}; "
                              "a generation must hold every index 0..n-1 exactly once")
    return n


def in_range(index: int, num_samples: int | None) -> bool:
    """Whether a logged `index` can belong to a generation of `num_samples` (``None``: a stream's, of a
    length known at its end)."""
    return index >= 0 and (num_samples is None or index < num_samples)
