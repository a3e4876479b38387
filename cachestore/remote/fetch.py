"""Fetching a published generation into a local store, every byte and record verified.

The download (:func:`download_set`) writes each file of a set into a directory the
caller made for it (a staging area), by parallel ranged reads: the chunks of one object
that lie side by side travel in one request of up to :data:`REQUEST_BYTES`, several
requests in flight. Each chunk's xxh3 is checked against the manifest as it arrives; one
that does not match is read again once, then the object is reported damaged
(:class:`~.errors.RemoteCorruptError` naming it). File names come from the manifest,
checked to be plain names, and every file is created new (``O_EXCL | O_NOFOLLOW``) in the
staging area, so nothing is ever written outside it.

:func:`fetch` then checks the generation as a commit would have left it and every record
with the store's checksums (:mod:`.verify`), and installs it: the staging area is renamed
``gen-NNNNNN`` under the store's writer lease, as a commit does. A generation published as
parts is assembled from them instead (:mod:`.parts`).
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import xxhash

from .. import safefs
from ..backends.base import GenerationInfo
from ..errors import CacheStoreError, GenerationNotFoundError
from ..store import Store
from . import layout
from .errors import RemoteCorruptError
from .leases import ReaderLease
from .manifest import FileSet, check_sizes
from .verify import verify_generation

if TYPE_CHECKING:
    from .store import RemoteStore

log = logging.getLogger(__name__)

#: Bytes of one ranged request (consecutive chunks of one object).
REQUEST_BYTES = 32 << 20


def object_sizes(remote: "RemoteStore", generation: int, fs: FileSet) -> None:
    """Compare the objects of `fs` with their real sizes on the remote (:func:`.manifest.check_sizes`)."""
    prefix = layout.data_prefix(remote.key, generation, fs.name)
    real = {info.key.rsplit("/", 1)[-1]: info.size for info in remote.client.list_objects(prefix)}
    check_sizes(fs, real, f"{remote.path}/generations/{generation:06d}.json")


#: Where a downloaded file goes: ``(path, offset of its first byte there, created new)``. A file
#: created new is made with ``O_EXCL``; another (a part's column slice, placed into the staging
#: area's full column) is opened as it is, never truncated (other writers may be writing it).
Placement = Callable[[str], tuple[Path, int, bool]]


def download_set(remote: "RemoteStore", generation: int, fs: FileSet, dest: Path,
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

        with ThreadPoolExecutor(max_workers=remote.settings.concurrency, thread_name_prefix="cachestore-fetch") as pool:
            for future in [pool.submit(one, r) for r in requests]:
                future.result()
        for fd in fds:
            os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)


def _again(remote: "RemoteStore", key: str, off: int, n: int, checksum: int) -> memoryview:
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


def _pwrite(fd: int, buf: memoryview, offset: int) -> None:
    done = 0
    while done < len(buf):
        done += os.pwrite(fd, buf[done:], offset + done)


def fetch(remote: "RemoteStore", local: Store, generation: int | None = None) -> GenerationInfo:
    """Download published `generation` (the newest when ``None``) of `remote` into the local store `local`.

    The local store becomes as if it had committed the generation itself. Nothing is
    computed; the dataset is never called.

    Raises
    ------
    GenerationNotFoundError
        The remote has no such complete generation.
    BudgetExceededError
        The generation does not fit the local store's budget (read it with ``remote.reader()``).
    RemoteCorruptError, RemoteManifestError, CorruptSampleError
        The remote's copy is damaged or malformed; nothing is left in `local`.
    """
    if generation is None:
        generation = remote.latest()
        if generation is None:
            raise GenerationNotFoundError(f"{remote.path} has no complete generation to fetch")
    existing = next((g for g in local.generations() if g.id == generation and g.committed), None)
    if existing is not None:
        return existing
    m = remote.manifest(generation)
    if m.backend != local.backend_name:
        raise CacheStoreError(f"generation {generation} on {remote.path} is a {m.backend} generation; "
                              f"{local.path} is a {local.backend_name} store")
    if m.layout == "parts":
        from .parts import fetch_parts

        fetch_parts(remote, local, generation, len(m.sets))
        return next(g for g in local.generations() if g.id == generation and g.committed)
    fs = m.sets[0]
    with ReaderLease(remote, generation):
        object_sizes(remote, generation, fs)
        writer = local.writer(generation, m.num_samples)
        try:
            total = sum(f.size for f in fs.files)
            if m.num_samples:
                writer.token.write_budget().check_projection(generation, total / m.num_samples, m.num_samples)
            staging = Path(writer.token.path)
            download_set(remote, generation, fs, staging)
            verify_generation(local.backend, staging, generation, m.num_samples, local.allow_pickle,
                              f"generation {generation} from {remote.path}")
            return writer.install()
        except BaseException:
            writer.abort()
            raise
