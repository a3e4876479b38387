"""Publishing a committed local generation: large objects first, the manifest last.

Steps, and the failure each guards against:

1. The remote ``store.json`` is created once (a conditional create) or checked: a root
   shared by several datasets keeps each under its own key (:mod:`.layout`).
2. The generation's files are packed (:mod:`.packing`); each object is read, hashed,
   named by its content and written, by a few threads at once. An object already there
   with its name and size is skipped: a publish interrupted by a kill, a Ctrl-C or a
   server that went away is finished by the next one (or ``cachestore push``).
3. The manifest goes last, as a conditional create: until it is there nothing reads the
   generation, and if another node published the same generation first, its manifest stays
   (our objects, unnamed, are removed by ``prune``).

:func:`publish` runs in a background thread by default and returns a
:class:`PublishHandle` (progress, ``wait()``, ``cancel()``). A cancelled or failed publish
writes no manifest.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from . import layout
from ..backends import settling
from ..backends.base import GenerationInfo
from ..errors import CacheStoreError, GenerationNotFoundError
from ..guard import safefs
from ..store import Store
from .manifest import FileSet, GenerationManifest, encode, generation_doc
from .packing import PackedObject, Source, file_set, plan, read_object

if TYPE_CHECKING:
    from .base import RemoteBase

log = logging.getLogger(__name__)

#: Objects read and written at once: each is held in memory while it is written (64-128 MiB).
PUBLISH_THREADS = 4


class Cancelled(CacheStoreError):
    """A publish stopped by :meth:`PublishHandle.cancel` (nothing of it is visible on the remote)."""


class PublishHandle:
    """A publish in progress (or done): ``progress()``, ``wait()``, ``cancel()``."""

    def __init__(self, what: str, total: int) -> None:
        self.what = what
        self.total_bytes = total
        self.done_bytes = 0
        self.skipped_bytes = 0
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._cancel = threading.Event()
        self._error: BaseException | None = None
        self.result: GenerationInfo | None = None
        self.thread: threading.Thread | None = None

    def progress(self) -> float:
        """The share of the bytes written (or found already there), 0..1."""
        return 1.0 if not self.total_bytes else min(1.0, self.done_bytes / self.total_bytes)

    def done(self) -> bool:
        return self._done.is_set()

    def cancel(self) -> None:
        """Stop after the objects being written now; no manifest is written."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def wait(self, timeout: float | None = None) -> GenerationInfo:
        """Wait for the publish; return what was published, or raise its error.

        Raises
        ------
        TimeoutError
            Not finished within `timeout` seconds (it goes on).
        """
        if not self._done.wait(timeout):
            raise TimeoutError(f"publishing {self.what} is still running ({self.progress():.0%} done)")
        if self._error is not None:
            raise self._error
        assert self.result is not None  # set before _done whenever _error is None
        return self.result

    def _advance(self, nbytes: int, skipped: bool) -> None:
        with self._lock:
            self.done_bytes += nbytes
            if skipped:
                self.skipped_bytes += nbytes

    def _finish(self, result: GenerationInfo | None, error: BaseException | None) -> None:
        self.result, self._error = result, error
        self._done.set()

    def __repr__(self) -> str:
        state = "done" if self.done() else f"{self.progress():.0%}"
        return f"PublishHandle({self.what}, {state})"


def generation_sources(gen_dir: Path) -> list[Source]:
    """The files of a committed generation directory, as sources (regular files only: a link is refused)."""
    sources = []
    for entry in sorted(gen_dir.iterdir(), key=lambda e: e.name):
        if entry.name == settling.UNSYNCED:
            continue  # this machine's note that the files are not known to be on its disk yet
        st = entry.lstat()
        if not stat.S_ISREG(st.st_mode):
            raise CacheStoreError(f"{entry} is {safefs.describe_entry(entry)}, not a file a generation holds: "
                                  "it is not published")
        sources.append(Source(entry.name, [(str(entry), 0, st.st_size)]))
    return sources


def upload_set(remote: "RemoteBase", generation: int, set_name: str, sources: list[Source],
               start: int, stop: int, handle: PublishHandle) -> FileSet:
    """Pack `sources`, write the objects missing from the remote, return the set's manifest entry."""
    objects = plan([s.size for s in sources])
    prefix = layout.data_prefix(remote.key, generation, set_name)
    there = {info.key.rsplit("/", 1)[-1]: info.size for info in remote.client.list_objects(prefix)}
    packed: dict[int, tuple[str, list[int]]] = {}

    def one(pieces: list) -> None:  # type: ignore[type-arg]
        if handle.cancelled:
            raise Cancelled(f"publishing {handle.what} was cancelled")
        obj: PackedObject = read_object(sources, pieces)
        size = len(obj.data)
        skipped = there.get(obj.name) == size
        if not skipped:
            remote.client.put(f"{prefix}/{obj.name}", obj.data)
        packed[obj.index] = (obj.name, obj.checksums)
        handle._advance(size, skipped)

    with ThreadPoolExecutor(max_workers=min(PUBLISH_THREADS, remote.settings.concurrency),
                            thread_name_prefix="cachestore-publish") as pool:
        for future in [pool.submit(one, pieces) for pieces in objects]:
            future.result()
    return file_set(set_name, start, stop, sources, objects, packed)


def _publish(remote: "RemoteBase", local: Store, generation: int, handle: PublishHandle) -> GenerationInfo:
    info = next((g for g in local.generations() if g.id == generation and g.committed), None)
    if info is None or info.path is None:
        raise GenerationNotFoundError(f"generation {generation} of {local.path} is not committed: nothing to publish")
    remote.ensure_doc(local)
    doc = remote.doc()
    if doc["backend"] != local.backend_name:
        raise CacheStoreError(f"{remote.path} holds a {doc['backend']} store, {local.path} is {local.backend_name}")
    key = layout.generation_manifest(remote.key, generation)
    if remote.client.head(key) is not None:
        handle._advance(handle.total_bytes, True)
        log.info("generation %d is already published on %s", generation, remote.path)
        return _info(remote, remote.manifest(generation))
    # Opening checks the generation like a reader would: damage is never published.
    local.backend.open_generation(generation).close()
    sources = generation_sources(Path(info.path))
    fs = upload_set(remote, generation, "whole", sources, 0, info.num_samples, handle)
    manifest = GenerationManifest(remote.key, generation, info.num_samples, local.backend_name, "whole", (fs,),
                                  time.time())
    if handle.cancelled:
        raise Cancelled(f"publishing {handle.what} was cancelled")
    if not remote.client.put_new(key, encode(generation_doc(manifest))):
        log.info("generation %d was published on %s by another node meanwhile; its copy stays", generation,
                 remote.path)
    return _info(remote, remote.manifest(generation))


def _info(remote: "RemoteBase", m: GenerationManifest) -> GenerationInfo:
    return GenerationInfo(id=m.generation, num_samples=m.num_samples, nbytes=m.nbytes, committed=True,
                          created=m.created, path=f"{remote.path}/generations/{m.generation:06d}.json",
                          layout=m.layout, stored_bytes=m.nbytes)


def publish(remote: "RemoteBase", local: Store, generation: int | None = None, *, background: bool = True,
            progress: Callable[[int, int], None] | None = None) -> PublishHandle:
    """Publish committed `generation` of `local` (the newest when ``None``) to `remote`.

    Parameters
    ----------
    remote
        The remote store of `local`'s fingerprint (``open_remote(url, local=local)``).
    local
        The local store holding the generation.
    background
        Run in a daemon thread and return at once (a kill leaves no manifest); else run here.
    progress
        Called with ``(bytes done, total bytes)`` after each object.

    Returns
    -------
    PublishHandle
        ``wait()`` returns the published generation's :class:`GenerationInfo` (its path is the
        manifest's URL) or raises what stopped it.
    """
    if generation is None:
        generation = local.latest()
        if generation is None:
            raise GenerationNotFoundError(f"{local.path} has no committed generation to publish")
    info = next((g for g in local.generations() if g.id == generation), None)
    total = 0 if info is None or info.path is None else sum(
        e.lstat().st_size for e in Path(info.path).iterdir() if e.name != settling.UNSYNCED) \
        if os.path.isdir(info.path) else 0
    handle = PublishHandle(f"generation {generation} of {local.path} to {remote.path}", total)

    def run() -> None:
        try:
            if progress is not None:
                original = handle._advance

                def advance(nbytes: int, skipped: bool) -> None:
                    original(nbytes, skipped)
                    progress(handle.done_bytes, handle.total_bytes)
                handle._advance = advance  # type: ignore[method-assign]
            handle._finish(_publish(remote, local, generation, handle), None)
        except BaseException as exc:  # handed to wait(), in the caller's thread
            handle._finish(None, exc)

    if background:
        handle.thread = threading.Thread(target=run, name="cachestore-publish", daemon=True)
        handle.thread.start()
    else:
        run()
    return handle
