"""Byte sizes, allocated-block accounting and the default budget."""

from __future__ import annotations

import errno
import os
import re
import shutil
import stat
from pathlib import Path
from typing import TypeGuard

from ..errors import BudgetExceededError

_UNITS = {
    "": 1, "b": 1,
    "k": 10**3, "kb": 10**3, "m": 10**6, "mb": 10**6, "g": 10**9, "gb": 10**9,
    "t": 10**12, "tb": 10**12,
    "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")

#: errno values that mean "no room": a full file system, or a full quota.
NO_SPACE = (errno.ENOSPC, errno.EDQUOT)

#: Free space the default budget leaves to the rest of the system.
RESERVE_FRACTION = 0.02
RESERVE_CAP = 1 << 30


def parse_size(value: int | float | str | None) -> int | None:
    """Turn ``20GB``, ``512MiB``, ``1e9`` or an int into a byte count.

    Parameters
    ----------
    value
        A non-negative number of bytes, a string with an optional decimal
        (``KB``, ``MB``, ``GB``, ``TB``) or binary (``KiB`` ... ``TiB``) unit,
        or ``None``.

    Returns
    -------
    int or None
        The size in bytes, ``None`` when `value` is ``None``.
    """
    if value is None:
        return None
    if isinstance(value, bool):
        raise ValueError(f"a size must be a number of bytes or a string like '20GB', got {value!r}")
    if isinstance(value, (int, float)):
        if value < 0:
            raise ValueError(f"a size must not be negative, got {value!r}")
        return int(value)
    if isinstance(value, str):
        match = _SIZE_RE.match(value)
        if match and match.group(2).lower() in _UNITS:
            return int(float(match.group(1)) * _UNITS[match.group(2).lower()])
    raise ValueError(f"cannot read {value!r} as a size; use bytes or a string like '20GB' or '512MiB'")


def format_size(nbytes: int | float) -> str:
    """Human-readable binary size, e.g. ``1.5 GiB``."""
    value = float(nbytes)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{value:.1f} TiB"  # pragma: no cover - loop always returns


def allocated_bytes(path: str | os.PathLike[str]) -> int:
    """Bytes actually allocated under `path` (``st_blocks``), not apparent sizes.

    Sparse files (LMDB maps, pre-sized columns) would otherwise count their
    holes. Files that vanish while we walk (a concurrent prune) are skipped.
    """
    path = Path(path)
    try:
        st = path.lstat()
    except FileNotFoundError:
        return 0
    if not path.is_dir() or path.is_symlink():
        return st.st_blocks * 512
    total = 0
    for root, dirs, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(root, name)).st_blocks * 512
            except FileNotFoundError:
                continue
    return total


def free_bytes(path: str | os.PathLike[str]) -> int:
    """Free bytes on the file system of `path` minus a small reserve."""
    usage = shutil.disk_usage(path)
    reserve = min(RESERVE_CAP, int(usage.total * RESERVE_FRACTION))
    return max(0, usage.free - reserve)


def read_only(path: str | os.PathLike[str]) -> bool:
    """Whether `path` (or, when it does not exist yet, its nearest existing parent) is on a file system
    mounted read-only, or may not be written by this process."""
    probe = os.path.abspath(os.fspath(path))
    while not os.path.exists(probe) and os.path.dirname(probe) != probe:
        probe = os.path.dirname(probe)
    try:
        if os.statvfs(probe).f_flag & os.ST_RDONLY:
            return True
    except OSError:
        return False
    return not os.access(probe, os.W_OK)


def remove_paths(paths: list[str]) -> None:
    """Remove debris entries: directories recursively, symlinks and files unlinked (never followed)."""
    for path in paths:
        if stat.S_ISDIR(_lstat_mode(path)):
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)


def _lstat_mode(path: str) -> int:
    try:
        return os.lstat(path).st_mode
    except FileNotFoundError:
        return 0


def is_out_of_space(exc: BaseException) -> TypeGuard[OSError]:
    """Whether `exc` is an ``OSError`` for a full file system or quota."""
    return isinstance(exc, OSError) and exc.errno in NO_SPACE


def out_of_space(exc: OSError, doing: str, path: str | os.PathLike[str]) -> BudgetExceededError:
    """The :class:`BudgetExceededError` to raise (``from exc``) for an out-of-space `exc`.

    It keeps ``errno``, so code that tests ``exc.errno == errno.ENOSPC`` still works.
    """
    err = BudgetExceededError(
        f"disk full while {doing} in {path} ({exc.strerror or exc}); "
        "free space on that file system (or give the store another path) and try again"
    )
    err.errno = exc.errno
    return err
