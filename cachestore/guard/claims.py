"""Who computes which sample of a generation that several processes write together.

A shared staging area (:mod:`cachestore.write.shared`) holds two small files:

``claims``
    One byte per sample, never written: a process that computes sample ``i``
    holds an open-file-description lock (``F_OFD_SETLK``) on byte ``i`` from
    before it calls the dataset until the sample is on disk and marked done.
    The kernel drops the lock when the file description closes, so a process
    killed mid-claim leaves the sample to the others without any clean-up.
``done``
    One ``uint32`` per sample: 0 until the sample is written, then the tag of
    the shard that holds it (:func:`shard_tag`). A commit keeps, for each index,
    the copy of the shard the map names, so a copy a killed writer left half
    done (and someone else computed again) never wins. Its blocks are allocated
    when the area is made (``posix_fallocate``): on a full file system a store
    through a shared mapping into a page with no block behind it is a SIGBUS
    that kills the process (on tmpfs even a load from a hole is). It is mapped
    only when every page has its block; a done map with holes (an area an older
    version made) is read and written with ``pread``/``pwrite``, where a full
    disk is an ``ENOSPC`` the budget policy handles.

Why one lock per sample and not per chunk of samples: claims are taken as a
process walks its own batch, one sample before computing it. Two jobs with the
same order then split every batch between them instead of one waiting for the
other's whole chunk, and a job with another order waits only for the samples it
needs, never for neighbours it does not. A lock costs one ``fcntl`` (about a
microsecond); the files cost one and five bytes per sample.

Open file description locks (Linux 3.15+) belong to the open file, not to the
process: every :class:`Claims` opens its own, so two threads of one process
(a thread executor) conflict with each other as two processes do.
"""

from __future__ import annotations

import errno
import fcntl
import mmap
import os
import struct
import zlib
from pathlib import Path
from typing import Iterable

import numpy as np
import numpy.typing as npt

from . import safefs
from ..space.disk import is_out_of_space, out_of_space

CLAIMS_NAME = "claims"
DONE_NAME = "done"
#: ``struct flock`` for ``F_OFD_*``: l_type, l_whence, l_start, l_len, l_pid (0), padded as the kernel lays it out.
FLOCK = struct.Struct("hhqqi4x")
#: One entry of the done map.
TAG = struct.Struct("<I")


def shard_tag(shard_id: str) -> int:
    """The non-zero 32-bit tag the done map records for samples of shard `shard_id`."""
    return (zlib.crc32(shard_id.encode()) & 0xFFFFFFFF) | 1


def byte_lock(fd: int, offset: int, kind: int, wait: bool) -> bool:
    """Lock byte `offset` of the file `fd` is open on (``kind``: ``F_WRLCK`` or ``F_RDLCK``), for this
    open file description (``F_OFD_SETLK``; see the module docstring).

    Returns
    -------
    bool
        ``True`` when locked; ``False`` when another open file description holds a conflicting lock
        (only without `wait`: with it, the call blocks until the lock is free).
    """
    try:
        fcntl.fcntl(fd, fcntl.F_OFD_SETLKW if wait else fcntl.F_OFD_SETLK,
                    FLOCK.pack(kind, os.SEEK_SET, offset, 1, 0))
    except (BlockingIOError, PermissionError):  # EAGAIN or EACCES: POSIX allows either for a held lock
        return False
    return True


def byte_unlock(fd: int, offset: int) -> None:
    """Give back the lock :func:`byte_lock` took on byte `offset` of `fd`'s file."""
    fcntl.fcntl(fd, fcntl.F_OFD_SETLK, FLOCK.pack(fcntl.F_UNLCK, os.SEEK_SET, offset, 1, 0))


def create_claim_files(directory: Path, num_samples: int) -> None:
    """Make the claim and done files of `num_samples` samples in `directory`, zeroed.

    The claims file is only ever locked (its size costs no block); the done map's blocks are
    allocated now, so that marking a sample done cannot meet a full disk (see the module docstring).

    Raises
    ------
    BudgetExceededError
        The file system has no room for the done map.
    """
    for name, size in ((CLAIMS_NAME, num_samples), (DONE_NAME, 4 * num_samples)):
        try:
            fd = safefs.create_new(directory / name, os.O_RDWR)
            try:
                os.ftruncate(fd, max(1, size))
                if name == DONE_NAME:
                    _reserve(fd, max(1, size))
            finally:
                os.close(fd)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, f"creating the {name} file of a shared staging area", directory) from exc
            raise


def _pwrite_all(fd: int, data: bytes, offset: int) -> None:
    """Write all of `data` at `offset` (a short write is retried; the next call reports ``ENOSPC``)."""
    view = memoryview(data)
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


def _reserved(fd: int, size: int) -> bool:
    """Whether the first `size` bytes of `fd`'s file have all their blocks (no hole a store or, on tmpfs,
    a load through a mapping would have to allocate)."""
    st = os.fstat(fd)
    return size > 0 and st.st_size >= size and st.st_blocks * 512 >= -(-size // st.st_blksize) * st.st_blksize


def _reserve(fd: int, size: int) -> None:
    """Allocate the blocks of the first `size` bytes of `fd` (where the file system can: the writes that
    follow meet a full disk as ``ENOSPC`` anyway, since they never go through a mapping)."""
    try:
        os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise


def done_map(directory: Path, num_samples: int) -> npt.NDArray[np.uint32]:
    """A read-only copy of the done map of `directory` (tags; 0 = not written)."""
    fd = safefs.open_nofollow(directory / DONE_NAME, os.O_RDONLY)
    try:
        data = os.pread(fd, 4 * num_samples, 0)
    finally:
        os.close(fd)
    out = np.zeros(num_samples, dtype=np.uint32)
    got = np.frombuffer(data, dtype="<u4")
    out[:len(got)] = got
    return out


class Claims:
    """This process's (or thread's) handle on the claims of one shared staging area.

    Parameters
    ----------
    directory
        The shared staging area.
    num_samples
        Samples of the generation.
    """

    def __init__(self, directory: str | os.PathLike[str], num_samples: int) -> None:
        self.dir = Path(directory)
        self.num_samples = num_samples
        self._fd = safefs.open_nofollow(self.dir / CLAIMS_NAME, os.O_RDWR)
        try:
            # The done map went (a committing member unlinked it): the claims fd must not outlive this
            # call, nor its locks the caller's handle on them.
            self._done_fd = safefs.open_nofollow(self.dir / DONE_NAME, os.O_RDWR)
        except BaseException:
            os.close(self._fd)
            raise
        self._map: mmap.mmap | None = None
        self._done: npt.NDArray[np.uint32] | None = None
        if _reserved(self._done_fd, TAG.size * num_samples):
            # Every page has its block (the map was reserved when the area was made): marks and looks go
            # through a mapping, a fancy assignment per flush rather than a pwrite per sample. A done map
            # with holes (an area an older version made) is read and written with pread/pwrite.
            self._map = mmap.mmap(self._done_fd, TAG.size * num_samples)
            self._done = np.frombuffer(self._map, dtype="<u4")
        #: Indices this handle holds claims on.
        self.held: set[int] = set()

    def _lock(self, index: int, kind: int, wait: bool) -> bool:
        if not 0 <= index < self.num_samples:
            raise IndexError(f"sample {index} is outside 0..{self.num_samples - 1}")
        return byte_lock(self._fd, index, kind, wait)

    def done(self, index: int) -> bool:
        """Whether sample `index` is written (by anyone)."""
        if not 0 <= index < self.num_samples:
            return False
        if self._done is not None:
            return bool(self._done[index])
        data = os.pread(self._done_fd, TAG.size, TAG.size * index)
        return len(data) == TAG.size and TAG.unpack(data)[0] != 0  # a short done map: not written

    def try_claim(self, index: int) -> bool:
        """Claim `index` if nobody holds it; ``False`` when another holder computes it now.

        A claim on a sample already done is given back at once (``False`` too):
        check :meth:`done` after a ``False``.
        """
        if index in self.held:
            return True
        if not self._lock(index, fcntl.F_WRLCK, wait=False):
            return False
        if self.done(index):  # finished between the caller's look and the lock
            self._unlock(index)
            return False
        self.held.add(index)
        return True

    def wait_claim(self, index: int) -> bool:
        """Wait until nobody else holds `index`; then ``True`` when it is this caller's to compute
        (claimed: its holder died before finishing), ``False`` when it is done."""
        if self.done(index):
            return False
        self._lock(index, fcntl.F_WRLCK, wait=True)
        if self.done(index):
            self._unlock(index)
            return False
        self.held.add(index)
        return True

    def finish(self, indices: Iterable[int], shard_id: str) -> None:
        """Mark `indices` (claimed by this caller, written and flushed into `shard_id`) done, and give
        their claims back. The order matters: done before unlocking, so a waiter woken by the unlock
        sees the sample as written.

        Raises
        ------
        BudgetExceededError
            No room to mark them (a done map whose blocks could not be reserved): their claims are
            still held, for the caller to give back (the samples are then not part of the generation).
        """
        tag = TAG.pack(shard_tag(shard_id))
        indices = list(indices)
        try:
            if self._done is not None:
                inside = np.asarray([i for i in indices if 0 <= i < self.num_samples], dtype=np.int64)
                self._done[inside] = shard_tag(shard_id)
            else:
                for index in indices:
                    if 0 <= index < self.num_samples:
                        _pwrite_all(self._done_fd, tag, TAG.size * index)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, "marking samples done", self.dir) from exc
            raise
        for index in indices:
            if index in self.held:
                self._unlock(index)
                self.held.discard(index)

    def release(self, indices: Iterable[int] | None = None) -> None:
        """Give claims back without marking them done (the samples were not written)."""
        for index in list(self.held if indices is None else indices):
            if index in self.held:
                self._unlock(index)
                self.held.discard(index)

    def _unlock(self, index: int) -> None:
        byte_unlock(self._fd, index)

    def close(self) -> None:
        """Give every claim back (closing the file does) and close the done map."""
        self.held.clear()
        self._done = None
        if self._map is not None:
            self._map.close()
            self._map = None
        for fd in (self._fd, self._done_fd):
            if fd >= 0:
                os.close(fd)
        self._fd = self._done_fd = -1
