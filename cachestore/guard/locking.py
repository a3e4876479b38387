"""The single-writer lock: an ``flock`` on a file that dies with its process.

Why ``flock`` and not a pid file: the kernel releases it when the holder dies
(SIGKILL included), so a crashed writer never blocks the next one, and there
is no stale-pid guessing. The pid written into the file is only for messages
(on a full disk there is none: the lock is still taken).

The lock file is opened with ``O_NOFOLLOW | O_NONBLOCK``: a ``writer.lock`` replaced by a
symlink (to a user's file, say) or a FIFO is unlinked - the link, not its target - and
made afresh, so the pid is never written through it (see :mod:`.safefs`).

The lock file is unlinked on release so nothing is left behind. That opens a
classic race (B opens the old inode, A unlinks it, C creates a new file: B and
C both "hold" a lock); :meth:`WriterLock.acquire` closes it by checking, after
locking, that the path still names the inode it locked, and retrying if not.
"""

from __future__ import annotations

import fcntl
import os
import time
from pathlib import Path
from typing import Callable

from ..errors import NotRegularFileError, StoreLockedError, SymlinkError
from ..space.disk import is_out_of_space, out_of_space
from .safefs import open_nofollow, unlink_name
from .untrusted import decimal

LOCK_NAME = "writer.lock"
#: Seconds a writer waits out a momentary lock taken by `lock_holder`.
PROBE_GRACE = 0.2
#: Seconds a writer waits out a brief holder of the lock (a prune removing debris or old generations),
#: which says so in the lock file, before it gives up as it would against a writer.
BRIEF_GRACE = 60.0
#: What a brief holder writes after its pid.
BRIEF = "brief"
#: What :func:`lock_holder` says when the writers are processes writing together (:mod:`cachestore.write.shared`).
SHARED_WRITERS = -2


def lock_holder(root: str | os.PathLike[str]) -> int | None:
    """Pid of the live process holding the writer lock of `root`, or ``None``.

    -1: a writer that has not written its pid yet; :data:`SHARED_WRITERS`:
    processes that write one generation together hold it shared.
    """
    path = Path(root) / LOCK_NAME
    try:
        # flock needs no write access: inspect works on a read-only store
        fd = open_nofollow(path, os.O_RDONLY)
    except FileNotFoundError:
        return None
    except (SymlinkError, NotRegularFileError):
        return None  # a symlink or a FIFO is nobody's lock (a writer unlinks it); nothing is read through it
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            return _read_pid(fd) or -1
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return SHARED_WRITERS
        fcntl.flock(fd, fcntl.LOCK_UN)
        return None
    finally:
        os.close(fd)


def _read_pid(fd: int) -> int | None:
    try:
        return decimal((os.pread(fd, 64, 0).decode().split() or ["0"])[0]) or None  # ASCII digits only
    except (ValueError, OSError):
        return None


def _brief(fd: int) -> bool:
    """Whether the holder of the lock file `fd` said it holds it briefly (:data:`BRIEF`)."""
    try:
        return os.pread(fd, 64, 0).decode().split()[1:2] == [BRIEF]
    except (ValueError, OSError, UnicodeDecodeError):
        return False


class _LockFile:
    """The open, lock and verify loop both writer locks share (see the module docstring).

    A subclass names how it locks (:attr:`_mode`) and what it says when it cannot
    (:meth:`_refusal`), and may do something with the file once it holds it (:meth:`_locked`).
    """

    #: The ``flock`` operation taken (without ``LOCK_NB``).
    _mode: int

    def __init__(self, root: str | os.PathLike[str]) -> None:
        self.path = Path(root) / LOCK_NAME
        self._fd: int | None = None

    @property
    def held(self) -> bool:
        """Whether this object holds the lock now (taken and not released)."""
        return self._fd is not None

    def acquire(self) -> None:
        """Take the lock or raise :class:`StoreLockedError` naming the holder (a no-op when held)."""
        if self._fd is not None:
            return
        start = time.monotonic()
        deadline = start + PROBE_GRACE
        for _ in range(1000):
            try:
                fd = open_nofollow(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            except (SymlinkError, NotRegularFileError):
                # A planted symlink or FIFO: drop the name, never write into a target nor flock a pipe.
                unlink_name(self.path)
                continue
            except OSError as exc:
                if is_out_of_space(exc):
                    raise out_of_space(exc, "creating the writer lock", self.path.parent) from exc
                raise
            try:
                held = self._lock(fd, deadline, start + BRIEF_GRACE) and self._same_file(fd)
                if held:
                    self._locked(fd)
            except BaseException:
                # Whatever failed (a full disk when writing the pid, an interrupt), the fd must not
                # outlive this call: it holds the flock, and a leaked one locks the store until exit.
                os.close(fd)
                raise
            if held:
                self._fd = fd
                return
            os.close(fd)  # the file was unlinked under us by a releasing holder: retry with a new one
        raise StoreLockedError(f"could not take the writer lock of {self.path.parent}")  # pragma: no cover

    def _lock(self, fd: int, deadline: float, brief_deadline: float) -> bool:
        """``flock`` `fd`, waiting out (until `deadline`) a holder that wrote no pid, and (until
        `brief_deadline`) one that holds it briefly (a prune); raise :class:`StoreLockedError`
        when a writer holds it."""
        while True:
            try:
                fcntl.flock(fd, self._mode | fcntl.LOCK_NB)
                return True
            except BlockingIOError:
                pid = _read_pid(fd)
                now = time.monotonic()
                if pid is None and now < deadline:
                    # No pid written: most likely `lock_holder` probing with a shared lock
                    # for a moment (inspect, prune), not a writer. Give it a few ms.
                    time.sleep(0.005)
                    continue
                if pid is not None and _brief(fd) and now < brief_deadline:
                    # A prune: processes joining a generation (a rank whose neighbour just
                    # committed and prunes) wait for it rather than fail.
                    time.sleep(0.01)
                    continue
                raise StoreLockedError(self._refusal(f"process {pid}" if pid else "another process")) from None

    def _same_file(self, fd: int) -> bool:
        """Whether the lock path still names the file `fd` locked (a releasing holder may have
        unlinked it between our open and our flock)."""
        try:
            return os.fstat(fd).st_ino == os.lstat(self.path).st_ino
        except FileNotFoundError:
            return False

    def _refusal(self, who: str) -> str:
        """The message of the :class:`StoreLockedError` raised when `who` holds the lock."""
        raise NotImplementedError

    def _locked(self, fd: int) -> None:
        """Called once `fd` holds the lock on the file at the path (the caller closes it if this raises)."""


class WriterLock(_LockFile):
    """Exclusive, non-blocking writer lock on a store directory."""

    _mode = fcntl.LOCK_EX

    def __init__(self, root: str | os.PathLike[str], brief: bool = False) -> None:
        super().__init__(root)
        self.brief = brief  # held for a moment (a prune): writers that meet it wait (BRIEF_GRACE)

    def _refusal(self, who: str) -> str:
        return (f"store {self.path.parent} is being written by {who}; "
                "only one writer at a time (wait for it to finish, or stop it)")

    def _locked(self, fd: int) -> None:
        """Write our pid into the file, for the messages of those it keeps out."""
        try:
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}{' ' + BRIEF if self.brief else ''}\n".encode(), 0)
        except OSError as exc:
            if not is_out_of_space(exc):
                # We hold the lock on the file at the path, so removing it is as safe as release().
                self.path.unlink(missing_ok=True)
                raise
            # A full disk: the flock is the lock, the pid only names us in messages. Keep it, so
            # that prune can free space on a full disk, and a writer fails on its first write
            # with a BudgetExceededError its caller can handle ("stream"), not here.

    def release(self) -> None:
        """Unlink the lock file and drop the lock (idempotent).

        Only the file this lock holds is unlinked: after the store was removed (``rm -rf``) another
        writer may hold a new lock file at the path, which must stay.
        """
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            if self._same_file(fd):
                os.unlink(self.path)
        except FileNotFoundError:
            pass
        finally:
            os.close(fd)


class SharedWriterLock(_LockFile):
    """The writer lock taken shared, by each of the processes that write one generation together.

    It keeps out what must run alone (an exclusive :class:`WriterLock`: a
    writer that does not share, a prune removing debris) and lets any number
    of sharing writers in. The last one out unlinks the file.
    """

    _mode = fcntl.LOCK_SH

    def _refusal(self, who: str) -> str:
        return (f"store {self.path.parent} is being written by {who}, which does not share "
                "its generation (wait for it to finish, or stop it)")

    def release(self) -> None:
        """Drop the lock; the last holder unlinks the file (idempotent)."""
        fd, self._fd = self._fd, None
        if fd is None:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_UN)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if os.fstat(fd).st_ino == os.lstat(self.path).st_ino:
                os.unlink(self.path)
        except (BlockingIOError, FileNotFoundError):
            pass  # other holders remain (or someone unlinked it already)
        finally:
            os.close(fd)


class WriterLease:
    """The right to write one store, held by one writer and given back once.

    :meth:`cachestore.Store.writer` takes the store's :class:`WriterLock` and
    hands the lease to the :class:`~cachestore.GenerationWriter`, which calls
    :meth:`release` when it commits or aborts: the writer never needs the
    store itself, and the lock cannot be released twice or by someone else.
    """

    def __init__(self, lock: WriterLock | SharedWriterLock | None,
                 on_release: Callable[[], None] | None = None) -> None:
        self._lock = lock
        self._on_release = on_release
        self.released = False

    def release(self) -> None:
        """Give the lease back (idempotent)."""
        if self.released:
            return
        self.released = True
        try:
            if self._on_release is not None:
                self._on_release()
        finally:
            if self._lock is not None:
                self._lock.release()
