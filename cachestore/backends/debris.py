"""What a crash leaves in a store's directory, recognised by name only.

Debris is a staging area of a writer that is gone (``.staging-<generation>-<pid>-<hex>``, or
one of another producer), a shared area nobody is a member of any more whose commit was cut
short or whose producer is another (``.shared-<generation>-<hash>`` and its ``.members``
lock file), a temp file of a dead pid (``.<name>.<pid>.<hex>.tmp``, ``.shared-tmp-<pid>-*``)
and a rotation window of a dead pid (``rotation-<pid>-<hex>``). Names are read strictly
(ASCII digits, :mod:`cachestore.guard.untrusted`): a name the store did not make is never debris,
whatever it looks like, and is left alone. A partial generation of the producer a caller
names is data, not debris (see :mod:`.directory`, "Partial generations").
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Collection

from ..guard import safefs
from ..guard.safefs import TEMP_NAME
from ..space.disk import allocated_bytes
from ..space.scratch import dead_windows, pid_alive
from .base import ProducerRecord
from .staging import (MEMBERS_SUFFIX, SHARED_PREFIX, has_members, matches, members_path, parse_shared,
                      parse_staging, staging_record, tmp_owner)


def find_debris(root: Path, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
                keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
    """``(path, allocated bytes)`` of the debris in the store directory `root`, except the staging
    areas of the live writer `keep_pid` and those in `keep_paths`, and the partial generations
    whose producer record matches `keep_record`."""
    found: list[tuple[str, int]] = []
    if not root.is_dir():
        return found
    for entry in root.iterdir():
        if entry.name.startswith(SHARED_PREFIX):
            found += _shared_debris(entry, keep_record)
            continue
        parsed = parse_staging(entry.name)
        if parsed is not None and parsed[1] != keep_pid and str(entry) not in keep_paths:
            if keep_record is not None and safefs.is_real_dir(entry) and matches(
                    staging_record(entry), keep_record):
                continue  # a partial generation of this producer: the next writer adopts it
            found.append((str(entry), allocated_bytes(entry)))
        elif (tmp := TEMP_NAME.match(entry.name)) and not pid_alive(int(tmp.group(1))):
            # a live pid may be between writing and renaming its temp file
            found.append((str(entry), allocated_bytes(entry)))
    found += dead_windows(root)
    return sorted(found)


def _shared_debris(entry: Path, keep_record: ProducerRecord | None) -> list[tuple[str, int]]:
    """`entry` (a name of the shared namespace) when it is debris: an area (or its lock file) nobody is a
    member of, whose commit was cut short or whose producer is not `keep_record`; a dead creator's temp."""
    owner = tmp_owner(entry.name)
    if owner is not None:
        return [] if pid_alive(owner) else [(str(entry), allocated_bytes(entry))]
    area = entry.with_name(entry.name[:-len(MEMBERS_SUFFIX)]) if entry.name.endswith(MEMBERS_SUFFIX) else entry
    if parse_shared(area.name) is None or has_members(area):
        return []
    if entry != area:  # a lock file: debris with its area, or alone
        return [] if os.path.lexists(area) else [(str(entry), allocated_bytes(entry))]
    record = staging_record(area) if safefs.is_real_dir(area) else None
    if keep_record is not None and matches(record, keep_record):
        return []  # a partial generation of this producer: the next process to write it joins it
    out = [(str(area), allocated_bytes(area))]
    if os.path.lexists(members_path(area)):
        out.append((str(members_path(area)), allocated_bytes(members_path(area))))
    return out
