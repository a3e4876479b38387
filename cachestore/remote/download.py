"""Downloading a set of files from the remote, every chunk verified as it lands.

:func:`download_set` writes each file of a set into a directory the caller made for it (a
staging area). The chunks of one object that lie side by side travel in one streamed request
of about :data:`REQUEST_BYTES`, several requests in flight, and each request's bytes are
handed over as they arrive, in pieces of :data:`PIECE_BYTES`: a piece is hashed and written
while it is still in the core's cache, and no buffer of a whole request is ever made (fresh
memory for the kernel to fault in, then read back cold for the hash and the write: a second
copy of the generation that a raw GET of the same bytes does not pay; see
docs/ARCHITECTURE.md, "The remote tier"). Each chunk's xxh3 is checked against the manifest
when its last byte has landed; one that does not match (or that the answer ended before) is
read again once and written over, then the object is reported damaged
(:class:`~.errors.RemoteCorruptError` naming it); the chunk's writeback starts then, and the
caller is told (:data:`Landed`). File names come from the manifest, checked to be plain names,
and every file is created new (``O_EXCL | O_NOFOLLOW``) in the staging area, so nothing is
ever written outside it. Used by :mod:`.fetch` (a whole generation) and :mod:`.placing` (a part).
"""

from __future__ import annotations

import ctypes
import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import xxhash

from . import layout
from ..errors import CacheStoreError
from ..guard import safefs
from .errors import RemoteCorruptError
from .manifest import FileSet, check_sizes

if TYPE_CHECKING:
    from .base import RemoteBase

log = logging.getLogger(__name__)

#: Bytes of one request (side-by-side chunks of one object, cut into requests of about equal size).
#: Streamed, a larger request holds no more memory; a generation of a few objects still has a few
#: requests in flight (see docs/ARCHITECTURE.md, "The remote tier").
REQUEST_BYTES = 64 << 20
#: Bytes handed over at a time by a streamed request: they stay in the core's cache (L2) while they
#: are hashed and written, and the buffer's memory is reused from piece to piece (a larger one is
#: fresh memory again for each piece, which is what this path avoids).
PIECE_BYTES = 1 << 20

_EMPTY = xxhash.xxh3_64_intdigest(b"")
#: A chunk to download: (offset in its object, length, file index, offset in the file, xxh3).
Chunk = tuple[int, int, int, int, int]


def object_sizes(remote: "RemoteBase", generation: int, fs: FileSet) -> None:
    """Compare the objects of `fs` with their real sizes on the remote (:func:`.manifest.check_sizes`)."""
    prefix = layout.data_prefix(remote.key, generation, fs.name)
    real = {info.key.rsplit("/", 1)[-1]: info.size for info in remote.client.list_objects(prefix)}
    check_sizes(fs, real, f"{remote.path}/generations/{generation:06d}.json")


#: Where a downloaded file goes: ``(path, offset of its first byte there, created new)``. A file
#: created new is made with ``O_EXCL``; another (a part's column slice, placed into the staging
#: area's full column) is opened as it is, never truncated (other writers may be writing it).
Placement = Callable[[str], tuple[Path, int, bool]]
#: Told of each chunk once it is verified and in its file: ``(file name, offset there, length)``; called from
#: the download threads (see :class:`.verify.ColumnCheck`).
Landed = Callable[[str, int, int], None]


def download_set(remote: "RemoteBase", generation: int, fs: FileSet, dest: Path,
                 place: Placement | None = None, landed: Landed | None = None, sync: bool = True) -> None:
    """Write every file of `fs` into the directory `dest` (or where `place` says), verified chunk by chunk;
    `landed` is told of each chunk once it is. The files are fsynced at the end unless not `sync` (their
    writeback has begun: the caller settles them, :mod:`cachestore.backends.settling`)."""
    safefs.require_real_dir(dest, "download directory")
    prefix = layout.data_prefix(remote.key, generation, fs.name)
    fds: list[int] = []
    try:
        tasks: dict[int, list[Chunk]] = {}
        for k, f in enumerate(fs.files):
            path, base, new = place(f.name) if place is not None else (dest / f.name, 0, True)
            if path.parent != dest:
                raise CacheStoreError(f"{path} is not inside {dest}")  # a bug of the caller: never outside
            if new:
                fd = safefs.create_new(path, os.O_RDWR)
                fds.append(fd)
                os.ftruncate(fd, f.size)
            else:
                fd = safefs.open_nofollow(path, os.O_RDWR | os.O_CREAT)
                fds.append(fd)
            for start, obj, off, n, c in zip(f.starts.tolist(), f.objects.tolist(), f.offsets.tolist(),
                                             f.lengths.tolist(), f.checksums.tolist()):
                tasks.setdefault(obj, []).append((off, n, k, base + start, c))
        pool = ThreadPoolExecutor(max_workers=remote.settings.concurrency, thread_name_prefix="cachestore-fetch")
        try:
            names = [f.name for f in fs.files]
            told = (lambda k, at, n: landed(names[k], at, n)) if landed is not None else None
            futures = [pool.submit(_land, remote, f"{prefix}/{fs.objects[obj][0]}", batch, fds, told)
                       for obj, batch in _requests(tasks)]
            for future in futures:
                future.result()
        finally:
            pool.shutdown(cancel_futures=True)  # after an error, the requests not started yet are not made
        for fd in fds if sync else ():
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _requests(tasks: dict[int, list[Chunk]]) -> list[tuple[int, list[Chunk]]]:
    """The requests for `tasks` (each object's chunks): runs of side-by-side chunks, a run cut at chunk
    boundaries into requests of about equal size, none much over :data:`REQUEST_BYTES`."""
    requests: list[tuple[int, list[Chunk]]] = []
    for obj, chunks in tasks.items():
        runs: list[list[Chunk]] = []
        for chunk in sorted(chunks):
            if runs and runs[-1][-1][0] + runs[-1][-1][1] == chunk[0]:
                runs[-1].append(chunk)
            else:
                runs.append([chunk])
        for run in runs:
            total = sum(c[1] for c in run)
            target = total / max(1, -(-total // REQUEST_BYTES))
            batch: list[Chunk] = []
            size = 0
            for chunk in run:
                batch.append(chunk)
                size += chunk[1]
                if size >= target:
                    requests.append((obj, batch))
                    batch, size = [], 0
            if batch:
                requests.append((obj, batch))
    return requests


def _land(remote: "RemoteBase", key: str, batch: list[Chunk], fds: list[int],
          told: Callable[[int, int, int], None] | None) -> None:
    """Stream the side-by-side chunks `batch` of object `key` into their files, each piece hashed and
    written as it arrives, each chunk checked when its last byte has landed (see the module docstring)."""
    todo = batch[::-1]  # the chunk being received is the last
    digest = xxhash.xxh3_64()
    got = 0  # bytes of todo[-1] landed
    for buf in remote.client.stream_range(key, batch[0][0], batch[-1][0] + batch[-1][1], PIECE_BYTES):
        pos = 0
        while pos < len(buf) or (todo and todo[-1][1] == got):
            if not todo:
                err = RemoteCorruptError(f"reading {remote.settings.url}/{key} gave more bytes than were asked")
                err.key = key
                raise err
            _, n, k, at, _ = todo[-1]
            take = min(len(buf) - pos, n - got)
            piece = buf[pos:pos + take]
            digest.update(piece)
            _pwrite(fds[k], piece, at + got)
            got += take
            pos += take
            if got == n:
                _landed(remote, key, todo.pop(), digest.intdigest(), fds, told)
                digest.reset()
                got = 0
    for chunk in todo[::-1]:  # the answer ended before them: each is read again on its own
        _landed(remote, key, chunk, _EMPTY if chunk[1] == 0 else None, fds, told)


def _landed(remote: "RemoteBase", key: str, chunk: Chunk, digest: int | None, fds: list[int],
            told: Callable[[int, int, int], None] | None) -> None:
    """A chunk whose last byte is in its file: read again and written over when `digest` is not its
    checksum; its writeback started, then `told`."""
    off, n, k, at, checksum = chunk
    if digest != checksum:
        _pwrite(fds[k], _again(remote, key, off, n, checksum), at)
    _start_writeback(fds[k], at, n)
    if told is not None:
        told(k, at, n)


def _again(remote: "RemoteBase", key: str, off: int, n: int, checksum: int) -> memoryview:
    """A chunk that did not match its checksum, read once more; :class:`RemoteCorruptError` if it still does not."""
    (buf,) = remote.client.get_ranges(key, [off], [off + n])
    if len(buf) != n or xxhash.xxh3_64_intdigest(buf) != checksum:
        err = RemoteCorruptError(f"object {remote.settings.url}/{key} is damaged: bytes {off}..{off + n - 1} do not "
                                 "match the checksum its manifest records (read twice); `cachestore push` from a node "
                                 "that holds the generation publishes it again after a `cachestore prune`")
        err.key = key
        raise err
    log.warning("bytes %d..%d of %s did not match their checksum once; read again, they do", off, off + n - 1, key)
    return buf


def _libc_sync_file_range() -> Callable[[int, int, int, int], int] | None:
    try:
        fn = ctypes.CDLL(None, use_errno=True).sync_file_range
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
    return fn


_SYNC_FILE_RANGE = _libc_sync_file_range() if sys.platform.startswith("linux") else None


def _start_writeback(fd: int, offset: int, n: int) -> None:
    """Start writing `n` bytes at `offset` to disk now (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``,
    which does not wait), so that the fsync before the install finds little left to write: the disk
    works while the next chunks are downloaded. Best effort: nothing happens where it is missing."""
    if _SYNC_FILE_RANGE is not None:
        _SYNC_FILE_RANGE(fd, offset, n, 2)  # SYNC_FILE_RANGE_WRITE


def _pwrite(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def chunk_errors(remote: "RemoteBase", generation: int) -> list[CacheStoreError]:
    """What a pull of `generation` would refuse, found without writing anything: objects missing or
    of another size than the manifest says, chunks that do not match their checksums (each read once
    more, as a pull does). ``inspect --verify`` reports these beside the records' own checksums, so
    it never says OK of a generation a pull refuses."""
    bad: list[CacheStoreError] = []
    for fs in remote.manifest(generation).sets:
        try:
            object_sizes(remote, generation, fs)
        except CacheStoreError as exc:
            bad.append(exc)
            continue
        prefix = layout.data_prefix(remote.key, generation, fs.name)
        for f in fs.files:
            for obj, off, n, c in zip(f.objects.tolist(), f.offsets.tolist(), f.lengths.tolist(),
                                      f.checksums.tolist()):
                key = f"{prefix}/{fs.objects[obj][0]}"
                (buf,) = remote.client.get_ranges(key, [off], [off + n])
                if len(buf) != n or xxhash.xxh3_64_intdigest(buf) != c:
                    try:
                        _again(remote, key, off, n, c)
                    except RemoteCorruptError as exc:
                        bad.append(exc)
    return bad
