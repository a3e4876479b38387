"""File operations that never follow a symlink in a name the store owns.

Why: every name under a store (``writer.lock``, ``store.json``, manifests,
staging, generation and rotation directories, temp files) is created by the
store. A symlink there was put by someone else - a user tidying up, a script
gone wrong - and following it would write a pid, a manifest or samples into
a file the store does not own (``open(path, "w")`` on a link truncates its
target). So names are opened with ``O_NOFOLLOW`` and checked with ``lstat``;
a link is refused (:class:`SymlinkError`) or, where the name is disposable,
unlinked - the link itself, never its target.

``O_NOFOLLOW`` guards the last component only: the directories above are
checked with :func:`is_real_dir` before files are made in them. Every open also
adds ``O_NONBLOCK`` and checks ``fstat``: only a regular file is opened (a FIFO
put in a prefix others can write would block the reader forever; a device is
nobody's store file), else :class:`NotRegularFileError` names it.

Documents the store replaces (``store.json``, manifests, staging records) are
written by :func:`write_json_atomic`: whole or not at all, never through a link.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import stat
from pathlib import Path
from typing import Any

from ..errors import CacheStoreError, NotRegularFileError, SymlinkError
from ..space.disk import is_out_of_space, out_of_space

#: Temp names made by :func:`write_json_atomic`: ``.<name>.<pid>.<hex>.tmp``.
TEMP_NAME = re.compile(r"\A\..+\.([0-9]{1,18})\.[0-9a-f]+\.tmp\Z", re.ASCII)


def symlink_error(path: str | os.PathLike[str], what: str = "") -> SymlinkError:
    """The error for a store-owned `path` found to be a symlink."""
    what = f" ({what})" if what else ""
    return SymlinkError(errno.ELOOP, f"{path}{what} is a symlink; cachestore never follows symlinks in the "
                                     "names it owns. Remove the link (its target is not the store's), "
                                     "or use another path for the store")


def is_link_error(exc: OSError) -> bool:
    """Whether `exc` is what ``open(..., O_NOFOLLOW)`` raises on a symlink."""
    return exc.errno == errno.ELOOP


def open_nofollow(path: str | os.PathLike[str], flags: int, mode: int = 0o644, what: str = "") -> int:
    """``os.open`` with ``O_NOFOLLOW | O_NONBLOCK``, then ``fstat``: the fd of a regular file (a
    directory where `flags` hold ``O_DIRECTORY``).

    A symlink at `path` raises :class:`SymlinkError`; anything else that is not a regular file (a
    FIFO, a socket, a device someone put in the store's place) raises :class:`NotRegularFileError`
    naming it. ``O_NONBLOCK`` is why a FIFO never hangs the opening (a FIFO's ``open`` waits for
    its other end); on a regular file or a directory it changes nothing.
    """
    try:
        fd = os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode)
    except OSError as exc:
        if is_link_error(exc) and os.path.islink(path):
            raise symlink_error(path, what) from None
        if exc.errno == errno.ENXIO:  # a FIFO opened for writing with no reader
            raise not_regular_error(path, what) from None
        raise
    try:
        st = os.fstat(fd)
        if not (stat.S_ISDIR(st.st_mode) if flags & os.O_DIRECTORY else stat.S_ISREG(st.st_mode)):
            raise not_regular_error(path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def open_at(dir_fd: int, name: str, flags: int, where: str | os.PathLike[str], what: str = "",
            mode: int = 0o600) -> int:
    """:func:`open_nofollow` of `name` in the directory open at `dir_fd` (`where`, for messages).

    Through the directory's fd, not its path: a directory renamed aside and replaced by another
    (someone else's, in a prefix others can write) is still the one the fd was opened on.
    """
    path = os.path.join(where, name)
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK, mode, dir_fd=dir_fd)
    except OSError as exc:
        if is_link_error(exc):
            raise symlink_error(path, what) from None
        if exc.errno == errno.ENXIO:
            raise not_regular_error(path, what) from None
        raise
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise not_regular_error(path, what)
    except BaseException:
        os.close(fd)
        raise
    return fd


def not_regular_error(path: str | os.PathLike[str], what: str = "") -> NotRegularFileError:
    """The error for a store-owned `path` found to be a FIFO, a socket or a device."""
    what = f" ({what})" if what else ""
    return NotRegularFileError(errno.EINVAL, f"{path}{what} is not a regular file (a FIFO, a socket or a "
                                             "device put in the store's place); cachestore never opens one. "
                                             "Remove it, or use another path for the store")


def create_new(path: str | os.PathLike[str], flags: int = os.O_WRONLY, mode: int = 0o644) -> int:
    """Create `path` as a new file (``O_CREAT | O_EXCL | O_NOFOLLOW``) and return its fd.

    For disposable store-owned names (temp files, slot files): whatever is at
    `path` already - a leftover or a planted symlink - is unlinked first (the
    link, not its target), then the file is made fresh.
    """
    for _ in range(3):
        try:
            return os.open(path, flags | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except FileExistsError:
            unlink_name(path)
    raise FileExistsError(errno.EEXIST, f"{path} keeps reappearing; another process is creating it")


def unlink_name(path: str | os.PathLike[str]) -> None:
    """Remove the directory entry `path` if it is a file or a symlink (never a directory, never a target)."""
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def write_all(fd: int, data: bytes) -> None:
    """Write all of `data` to `fd` (one ``write`` may take less)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def write_new(path: str | os.PathLike[str], data: bytes) -> None:
    """Write `data` into a fresh file at `path` (see :func:`create_new`)."""
    fd = create_new(path)
    try:
        write_all(fd, data)
    finally:
        os.close(fd)


def read_bytes(path: str | os.PathLike[str], what: str = "") -> bytes:
    """The content of the regular file `path`; a symlink raises :class:`SymlinkError`."""
    fd = open_nofollow(path, os.O_RDONLY, what=what)
    try:
        chunks = []
        while chunk := os.read(fd, 1 << 20):
            chunks.append(chunk)
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_json(path: str | os.PathLike[str], what: str = "") -> Any:
    """The JSON document in `path`, read without following a symlink."""
    return json.loads(read_bytes(path, what))


def lstat_or_none(path: str | os.PathLike[str]) -> os.stat_result | None:
    """``os.lstat(path)`` (a symlink itself, never its target), ``None`` when nothing is there."""
    try:
        return os.lstat(path)
    except FileNotFoundError:
        return None


def identity(path: str | os.PathLike[str]) -> tuple[int, int]:
    """Which file or directory `path` names now (device, inode), not following a symlink: a rename
    takes the name away, and what is made under it later is another."""
    st = os.lstat(path)
    return st.st_dev, st.st_ino


def identity_or_none(path: str | os.PathLike[str]) -> tuple[int, int] | None:
    """:func:`identity`, ``None`` when nothing is at `path`."""
    st = lstat_or_none(path)
    return None if st is None else (st.st_dev, st.st_ino)


def is_real_dir(path: str | os.PathLike[str]) -> bool:
    """Whether `path` is a directory itself (not a symlink to one)."""
    st = lstat_or_none(path)
    return st is not None and stat.S_ISDIR(st.st_mode)


def require_real_dir(path: str | os.PathLike[str], what: str) -> None:
    """Raise unless `path` is a real directory: :class:`SymlinkError` for a link, else :class:`CacheStoreError`."""
    st = lstat_or_none(path)
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise symlink_error(path, what)
    if st is None or not stat.S_ISDIR(st.st_mode):
        raise CacheStoreError(f"{what} {path} is gone or is not a directory (aborted or pruned?)")


def describe_entry(path: Path) -> str:
    """``"a symlink"``, ``"a file"`` ... for messages about a name that should be a directory."""
    st = lstat_or_none(path)
    if st is None:
        return "missing"
    if stat.S_ISLNK(st.st_mode):
        return "a symlink"
    if stat.S_ISDIR(st.st_mode):
        return "a directory"
    return "a file" if stat.S_ISREG(st.st_mode) else "not a regular file"


def write_json_atomic(path: Path, obj: object) -> None:
    """Write `obj` as JSON to `path` via a temp file, fsync and rename.

    Raises
    ------
    BudgetExceededError
        When the file system (or quota) has no room for it.
    """
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with os.fdopen(create_new(tmp), "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)  # replaces a symlink at `path` itself, never its target
        fsync_dir(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(exc):
            raise out_of_space(exc, f"writing {path.name}", path.parent) from exc
        raise


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """fsync the directory `path`, so the renames and creations in it survive a power cut."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """fsync the regular file `path` (opened without following a symlink), so its bytes survive a power cut."""
    fd = open_nofollow(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
