"""Downloading a set of files from the remote, every chunk verified as it arrives.

:func:`download_set` writes each file of a set into a directory the caller made for it (a
staging area), by parallel ranged reads: the chunks of one object that lie side by side
travel in one request of up to :data:`REQUEST_BYTES`, several requests in flight. Each
chunk's xxh3 is checked against the manifest as it arrives; one that does not match is read
again once, then the object is reported damaged (:class:`~.errors.RemoteCorruptError`
naming it). File names come from the manifest, checked to be plain names, and every file is
created new (``O_EXCL | O_NOFOLLOW``) in the staging area, so nothing is ever written
outside it. Used by :mod:`.fetch` (a whole generation) and :mod:`.placing` (a part).
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

#: Bytes of one ranged request (consecutive chunks of one object). One chunk (8 MiB) per request: a
#: generation of a few large objects is then read by as many requests in flight as the client allows
#: (measured with ``python -m benchmarks.remote``: 32 MiB requests left most of them idle).
REQUEST_BYTES = 8 << 20


def object_sizes(remote: "RemoteBase", generation: int, fs: FileSet) -> None:
    """Compare the objects of `fs` with their real sizes on the remote (:func:`.manifest.check_sizes`)."""
    prefix = layout.data_prefix(remote.key, generation, fs.name)
    real = {info.key.rsplit("/", 1)[-1]: info.size for info in remote.client.list_objects(prefix)}
    check_sizes(fs, real, f"{remote.path}/generations/{generation:06d}.json")


#: Where a downloaded file goes: ``(path, offset of its first byte there, created new)``. A file
#: created new is made with ``O_EXCL``; another (a part's column slice, placed into the staging
#: area's full column) is opened as it is, never truncated (other writers may be writing it).
Placement = Callable[[str], tuple[Path, int, bool]]


def download_set(remote: "RemoteBase", generation: int, fs: FileSet, dest: Path,
                 place: Placement | None = None) -> None:
    """Write every file of `fs` into the directory `dest` (or where `place` says), verified chunk by chunk."""
    safefs.require_real_dir(dest, "download directory")
    prefix = layout.data_prefix(remote.key, generation, fs.name)
    fds: list[int] = []
    try:
        tasks: dict[int, list[tuple[int, int, int, int, int]]] = {}
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
        requests = []
        for obj, chunks in tasks.items():
            chunks.sort()
            batch: list[tuple[int, int, int, int, int]] = []
            for chunk in chunks:
                if batch and sum(c[1] for c in batch) + chunk[1] > REQUEST_BYTES:
                    requests.append((obj, batch))
                    batch = []
                batch.append(chunk)
            if batch:
                requests.append((obj, batch))

        def one(request: tuple[int, list[tuple[int, int, int, int, int]]]) -> None:
            obj, batch = request
            key = f"{prefix}/{fs.objects[obj][0]}"
            bufs = remote.client.get_ranges(key, [c[0] for c in batch], [c[0] + c[1] for c in batch])
            for (off, n, k, start, checksum), buf in zip(batch, bufs):
                if len(buf) != n or xxhash.xxh3_64_intdigest(buf) != checksum:
                    buf = _again(remote, key, off, n, checksum)
                _pwrite(fds[k], buf, start)
                _start_writeback(fds[k], start, len(buf))

        with ThreadPoolExecutor(max_workers=remote.settings.concurrency, thread_name_prefix="cachestore-fetch") as pool:
            for future in [pool.submit(one, r) for r in requests]:
                future.result()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


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
