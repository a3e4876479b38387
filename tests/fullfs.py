"""A real, small file system to fill up: a tmpfs mounted for one test, and ways to fill it.

Tests run as root (CI): mounting is allowed. Where it is refused (a container
without CAP_SYS_ADMIN), the tests that need it skip and say why.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from pathlib import Path
from typing import Iterator

import pytest

FILLER = "filler.bin"


#: Files (inodes) the test file systems hold: few, so that running out of them is quick too.
INODES = 256


@contextlib.contextmanager
def mounted_tmpfs(mount_point: Path, size: str = "4m") -> Iterator[Path]:
    """Mount a tmpfs of `size` (and :data:`INODES` inodes) at `mount_point` for the block (skip if refused)."""
    mount_point.mkdir(parents=True, exist_ok=True)
    try:
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},nr_inodes={INODES}", "tmpfs", str(mount_point)],
                       check=True, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", None) or exc
        pytest.skip(f"mounting a {size} tmpfs is not permitted here ({str(detail).strip()}); "
                    "a full disk cannot be tested for real")
    try:
        yield mount_point
    finally:
        # Lazy: a process of the test still holding a file there must not make the unmount fail.
        subprocess.run(["umount", "-l", str(mount_point)], check=True, timeout=30)


def fill(directory: str | os.PathLike, inodes: bool = False) -> Path:
    """Fill the file system of `directory` to the last byte with one file; return its path.

    With `inodes`, also use up every inode (empty files in a ``filler.d`` directory),
    so that not even an empty file or directory can be created.
    """
    path = Path(directory) / FILLER
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    try:
        if inodes:
            spare = Path(directory) / (FILLER + ".d")
            spare.mkdir()
            try:
                for i in range(10 * INODES):
                    (spare / str(i)).touch()
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
        chunk = b"\0" * (64 << 10)
        while True:
            try:
                written = os.write(fd, chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                if len(chunk) == 1:
                    return path
                chunk = chunk[:len(chunk) // 2]  # fill the last partial pages too
                continue
            if written < len(chunk):
                chunk = chunk[:max(1, written)]
    finally:
        os.close(fd)


def free(directory: str | os.PathLike) -> None:
    """Undo :func:`fill`."""
    (Path(directory) / FILLER).unlink(missing_ok=True)
    shutil.rmtree(Path(directory) / (FILLER + ".d"), ignore_errors=True)


def open_fds_to(path: str | os.PathLike) -> list[str]:
    """This process's file descriptors open on `path` (deleted or not)."""
    target, found = str(path), []
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link == target or link == target + " (deleted)":
            found.append(fd)
    return found
