"""Process-owned names under a store path: who owns what, and rotation windows.

A rotation window (see ``docs/ARCHITECTURE.md``) is scratch space that one
live process owns under a prefix, named ``rotation-<pid>-<hex>``. The store
layer knows these names so that ``inspect`` can show them and ``prune`` (or the
next process) can remove the windows of dead owners; what goes inside a window
is the loader's business.
"""

from __future__ import annotations

import os
import re
import secrets
from pathlib import Path

from .disk import allocated_bytes

WINDOW_PREFIX = "rotation-"
_WINDOW_RE = re.compile(r"\Arotation-([0-9]{1,18})-[0-9a-f]+\Z", re.ASCII)  # ASCII digits: untrusted.decimal


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (a process of another user counts as alive)."""
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def window_owner(name: str) -> int | None:
    """Owner pid of a ``rotation-<pid>-<hex>`` window name, ``None`` if it is not one."""
    match = _WINDOW_RE.match(name)
    return int(match.group(1)) if match else None


def is_window_name(name: str) -> bool:
    """Whether `name` is in the rotation-window namespace (well-formed or not)."""
    return name.startswith(WINDOW_PREFIX)


def list_windows(root: str | os.PathLike[str]) -> list[tuple[str, int, int | None]]:
    """``(path, allocated bytes, owner pid or None)`` of each ``rotation-*`` entry in `root`."""
    found: list[tuple[str, int, int | None]] = []
    try:
        entries = sorted(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if is_window_name(entry.name) and (entry.is_dir() or entry.is_symlink()):
            found.append((str(entry), allocated_bytes(entry), window_owner(entry.name)))
    return found


def dead_windows(root: str | os.PathLike[str]) -> list[tuple[str, int]]:
    """Rotation windows in `root` whose owner process is dead (a live one is in use)."""
    return [(path, nbytes) for path, nbytes, pid in list_windows(root)
            if pid is not None and not pid_alive(pid)]


def new_window_dir(root: str | os.PathLike[str]) -> Path:
    """Create and return an empty window directory owned by this process under `root`: this user's
    alone (mode 0700), so that no other user can put a slot into it."""
    path = Path(root) / f"{WINDOW_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    path.mkdir(mode=0o700)  # the umask only takes bits away
    return path
