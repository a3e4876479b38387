"""How much memory this process may use for pages: the host's free memory, or its cgroup's room.

Every fits-in-memory decision asks :func:`memory_room`: whether a generation is
mapped whole or read with explicit I/O, the loader's read order, the room of an
in-RAM store. The host's available memory (``psutil``) overstates the room of a
process in a container with a memory limit: there the room is the cgroup's
limit minus what the cgroup already holds, the smallest over the process's
cgroup and its ancestors (a limit may be set on any of them). What it holds is
counted without the file pages the kernel reclaims first (``inactive_file``):
a cache just read leaves them behind, and they give way to new ones.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil

#: Where the cgroup file systems are mounted, and where a process finds its cgroups.
CGROUP_ROOT = "/sys/fs/cgroup"
PROC_CGROUP = "/proc/self/cgroup"
#: A v1 limit at or above this is "no limit" (the kernel writes PAGE_COUNTER_MAX pages).
V1_UNLIMITED = 1 << 60


def memory_room(cgroup_root: str | os.PathLike[str] = CGROUP_ROOT,
                proc_cgroup: str | os.PathLike[str] = PROC_CGROUP) -> int:
    """Bytes of memory this process may still use for pages.

    The smaller of the host's available memory and, under a cgroup memory
    limit (v1 or v2), the limit minus the cgroup's usage (its reclaimable file
    pages left out), over the process's cgroup and every ancestor.

    Parameters
    ----------
    cgroup_root, proc_cgroup
        Where the cgroup file systems are, and the file naming the process's
        cgroups (tests point these at fake trees).

    Returns
    -------
    int
        The room in bytes (``psutil``'s available memory when no cgroup limits it).
    """
    room = int(psutil.virtual_memory().available)
    limited = cgroup_room(Path(cgroup_root), Path(proc_cgroup))
    return min(room, limited) if limited is not None else room


def cgroup_room(root: Path, proc_cgroup: Path) -> int | None:
    """The cgroup's room (limit minus working set) for this process, ``None`` without a limit."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return None
    rooms: list[int] = []
    for line in lines:
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if not hierarchy or not path:
            continue
        if hierarchy == "0" and controllers == "":  # v2: one unified hierarchy (under unified/ beside v1)
            base = root / "unified" if (root / "unified").is_dir() else root
            rooms += _rooms(base, path, "memory.max", "memory.current", "inactive_file")
        elif "memory" in controllers.split(","):  # v1: the memory controller's own hierarchy
            base = root / "memory" if (root / "memory").is_dir() else root
            rooms += _rooms(base, path, "memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
    return min(rooms) if rooms else None


def _rooms(base: Path, path: str, limit_file: str, usage_file: str, inactive_key: str) -> list[int]:
    """Limit minus working set of the cgroup at `path` and each ancestor that has a limit."""
    rooms = []
    parts = [p for p in path.strip("/").split("/") if p]
    for depth in range(len(parts), -1, -1):
        here = base.joinpath(*parts[:depth])
        limit = _number(here / limit_file)
        if limit is None or limit >= V1_UNLIMITED:
            continue
        usage = _number(here / usage_file) or 0
        inactive = _stat(here / "memory.stat", inactive_key) or 0
        rooms.append(max(0, limit - max(0, usage - inactive)))
    return rooms


def _number(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def _stat(path: Path, key: str) -> int | None:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key and value.strip().isdigit():
                return int(value)
    except OSError:
        pass
    return None


def fits(nbytes: int, fraction: float = 0.5) -> bool:
    """Whether `nbytes` of pages fit in `fraction` of :func:`memory_room` (the rest is the process's)."""
    return nbytes <= memory_room() * fraction


def sample_limit(disk_bytes: int | None) -> int:
    """The default ``max_sample_bytes`` of a store: what one sample may take when read back.

    A quarter of this process's memory room (a batch holds several samples, and a reader's pages
    the rest), and never more than the store's budget (`disk_bytes`: no sample larger was ever
    written into it). A record or a schema claiming more is damage, refused before anything is
    allocated (see docs/ARCHITECTURE.md, "Untrusted stores"). A generation whose samples all
    share one schema bounds each by that schema's bytes as well
    (:meth:`cachestore.backends.reading.GenerationData.bound_samples`).
    """
    room = max(1, memory_room() // 4)
    return room if disk_bytes is None else max(1, min(room, disk_bytes))
