"""Shared-memory slots that carry batches from workers to the training process.

Lifetime: no segment may outlive the processes that use it
------------------------------------------------------------
A slot is a ``memfd`` (an anonymous tmpfs file) created by the training
process, which keeps its descriptor open for the slot's lifetime. A worker
opens the same file through ``/proc/<training pid>/fd/<fd>`` and keeps its own
descriptor. Nothing has a name in ``/dev/shm``, so the kernel frees a slot
when the last process holding it (descriptor or mapping) is gone - whatever
ended them: close, an exception, SIGTERM, SIGKILL of the training process
(its workers then die too: see the parent-death signal in
:mod:`loader.executors.process.worker`). Every alternative leaves a window: a named file is
unlinked by a cleanup that SIGKILL skips; a sweep of dead pids' files at the
next start only runs if there is a next start; a resource-tracker process
dies with a SIGKILLed process group.

Where ``memfd`` or ``/proc/<pid>/fd`` is not available (not Linux, or a
non-dumpable training process that workers may not open), slots fall back to
files under ``/dev/shm`` named ``cachestore-<pid>-<hex>-<slot>``: removed on
close, and by :func:`sweep_dead_segments` at the next start after a crash.

A task names its slot by a string (:attr:`Task.slot_name`): the ``/proc``
path followed by ``#`` and a unique label, or the file name. Slots are
reused: a freshly mapped page costs micro-seconds to fault in, a new buffer
per batch would cost more than the copy. The training process hands a batch
out as numpy views of the slot; the slot returns to the free list when the
last view dies (a ``weakref.finalize`` on a per-batch ctypes exporter, the
one object every view keeps alive). A batch larger than its slot is written
by the worker after growing the slot's file in place (``ftruncate``); the
training process maps the larger size when the result says so. A slot's
pages are allocated before a batch is written into them (``posix_fallocate``:
by the training process for the bytes of the largest batch it has seen, when
it creates the slot, and by the worker for the bytes of the batch it writes),
so a full ``/dev/shm`` or memory limit is an ``OSError`` there, never a SIGBUS
when a page is first touched. The spare quarter a slot is sized with (for a
batch a little larger than the last) is only allocated where a batch needs
it: resident, it was a quarter more memory for every slot of every epoch.
"""

from __future__ import annotations

import ctypes
import errno
import glob
import mmap
import os
import sys
import tempfile

from cachestore.guard.untrusted import decimal
from cachestore.space.scratch import pid_alive

from ...leaves import round_up

MIN_SLOT = 1 << 20
_SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
#: Start of the ``/proc/<pid>/maps`` path of a memfd slot (``/memfd:<label> (deleted)``).
MEMFD_PREFIX = "/memfd:cachestore-"
_PROC_FD = "/proc/"
_PR_GET_DUMPABLE = 3


def shm_dir() -> str:
    return _SHM_DIR


def slot_size_for(needed: int) -> int:
    """The size a slot gets for a batch of `needed` bytes: a quarter spare, whole MiB, at least ``MIN_SLOT``."""
    return max(MIN_SLOT, round_up(int(needed * 1.25), 1 << 20))


def _memfd_usable() -> bool:
    """Whether slots can be memfds that workers open through ``/proc/<pid>/fd``."""
    if not sys.platform.startswith("linux") or not hasattr(os, "memfd_create"):
        return False
    if not os.path.isdir(f"/proc/{os.getpid()}/fd"):
        return False
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        # Another process may open our /proc/<pid>/fd entries only while we are dumpable.
        return bool(libc.prctl(_PR_GET_DUMPABLE, 0, 0, 0, 0) == 1)
    except (OSError, AttributeError):
        return False


#: Slots are memfds (see the module docstring); read once, set to False to force files.
USE_MEMFD = _memfd_usable()


def is_segment_path(path: str) -> bool:
    """Whether `path` (from ``/proc/<pid>/maps`` or ``/proc/<pid>/fd``) is a slot of this package."""
    return path.startswith(MEMFD_PREFIX) or path.startswith(os.path.join(_SHM_DIR, "cachestore-"))


def path_of(name: str) -> str:
    if name.startswith(_PROC_FD):
        return name.split("#", 1)[0]
    return os.path.join(_SHM_DIR, name)


def allocate(fd: int, size: int, used: int | None = None) -> None:
    """Make the file of `fd` at least `size` bytes long, with the pages of its first `used` bytes (all of them by
    default) allocated now (see the module docstring)."""
    try:
        if os.fstat(fd).st_size < size:
            os.ftruncate(fd, size)
        os.posix_fallocate(fd, 0, size if used is None else max(1, min(used, size)))
    except OSError as exc:
        if exc.errno in (errno.EOPNOTSUPP, errno.EINVAL):
            return  # no fallocate here: pages come on first touch, as with any mapping
        raise OSError(exc.errno, f"cannot allocate {size} bytes of shared memory for loader batches "
                                 f"({exc.strerror}); free memory (or space in {_SHM_DIR}), or use smaller "
                                 "batches") from exc


def unlink_segment(name: str) -> None:
    """Remove a file segment's name (nothing to do for a memfd slot: it has none)."""
    if name.startswith(_PROC_FD):
        return
    try:
        os.unlink(os.path.join(_SHM_DIR, name))
    except FileNotFoundError:
        pass


def sweep_dead_segments() -> list[str]:
    """Remove file segments of training processes that no longer exist (memfd slots need no sweep)."""
    removed = []
    for path in glob.glob(os.path.join(_SHM_DIR, "cachestore-*")):
        parts = os.path.basename(path).split("-")
        # ASCII digits only: anyone may name a file here, and int() takes "٣" (and fails on "²").
        pid = decimal(parts[1]) if len(parts) > 2 else None
        if pid is not None and not pid_alive(pid):
            try:
                os.unlink(path)
                removed.append(path)
            except OSError:
                pass
    return removed


def close_quietly(m: mmap.mmap) -> None:
    try:
        m.close()
    except BufferError:
        pass  # views still exported; the mapping goes with them


