"""A store on a remote: its key below the root, its documents, its generations.

:func:`open_remote` finds the store (from a local store's fingerprint, a fingerprint, an
explicit key, or the only store under the root) and returns a :class:`RemoteStore`. It is a
:class:`~cachestore.ReadableStore` (``generations()``, ``latest()``, ``reader()``, ``verify()``;
not ``writable``: a local store is written, then published) with ``prune()``, and the remote
tier's verbs live on it as thin methods over their modules:
:meth:`~RemoteStore.publish` (:mod:`.publish`), :meth:`~RemoteStore.fetch` (:mod:`.fetch`),
:meth:`~RemoteStore.claim_part`, :meth:`~RemoteStore.publish_part`,
:meth:`~RemoteStore.fetch_parts` (:mod:`.parts`), :meth:`~RemoteStore.prune` (:mod:`.pruning`).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Mapping

from ..backends.base import GenerationInfo
from ..errors import CacheStoreError, GenerationNotFoundError
from ..read.readable import ReadableStore
from ..store import Store
from . import layout
from .base import RemoteBase, fingerprint_hash, local_key
from .client import Client
from .errors import RemoteConfigError
from .download import chunk_errors
from .fetch import fetch
from .parts import Claim, RemoteGeneration, claim_part, fetch_parts, publish_part, remote_generations
from .pruning import prune_remote
from .publish import PublishHandle, publish
from .reader import RemoteReader
from .settings import RemoteSettings, remote_settings
from .url import RemoteURL

if TYPE_CHECKING:
    from ..pruning import Removed
    from .manifest import PartManifest

__all__ = ["RemoteStore", "fingerprint_hash", "local_key", "open_remote"]


class RemoteStore(RemoteBase, ReadableStore):
    """One store on a remote root (see the module docstring); pickles without credentials."""

    #: Written by publishing a local store (:meth:`publish`), never through a writer of its own.
    writable = False

    def __reduce__(self) -> tuple[Callable[..., RemoteStore], tuple[object, ...]]:
        return (_reopen, (self.settings, self.key, self.allow_pickle, self.verify_reads, self.max_sample_bytes))

    @property
    def fingerprint(self) -> dict[str, object] | None:
        fp = self.doc().get("fingerprint")
        return fp if isinstance(fp, dict) else None

    # the ReadableStore interface ------------------------------------------------
    def generations(self) -> list[GenerationInfo]:
        infos = []
        for g in self.generation_ids():
            m = self.manifest(g)
            infos.append(GenerationInfo(id=g, num_samples=m.num_samples, nbytes=m.nbytes, committed=True,
                                        created=m.created, path=f"{self.path}/generations/{g:06d}.json",
                                        layout=m.layout, stored_bytes=m.nbytes,
                                        extra={"remote_layout": m.layout, "objects": sum(len(s.objects)
                                                                                         for s in m.sets)}))
        return infos

    def reader(self, generation: int | None = None) -> "RemoteReader":
        """A map-style dataset over a published generation (the newest when ``None``), read straight
        from the remote: one ranged read per run of consecutive records (:mod:`.reader`)."""
        if generation is None:
            generation = self.latest()
            if generation is None:
                raise GenerationNotFoundError(f"{self.path} has no complete generation yet")
        return RemoteReader(self, generation)

    def verify(self) -> list[CacheStoreError]:
        """Check every chunk and record of every published generation (reads all of them twice): what a
        pull would refuse (objects, chunk checksums), then the records' own checksums."""
        bad: list[CacheStoreError] = []
        for g in self.generation_ids():
            bad.extend(chunk_errors(self, g))  # what a pull checks: reading alone never looks at chunks
            with self.reader(g) as reader:
                bad.extend(reader.verify())
        return bad

    def usage(self) -> int:
        return sum(g.nbytes for g in self.generations())

    def prune(self, keep: int = 1, dry_run: bool = False, max_bytes: int | str | None = None,
              partial: bool = False) -> list["Removed"]:
        """Remove published generations beyond the newest `keep` (never one with a live reader lease), and
        data no manifest names (an interrupted publish, older than a day, or any with `partial`)."""
        if max_bytes is not None:
            raise CacheStoreError("prune of a remote store takes --keep, not --max-bytes")
        return prune_remote(self, keep, dry_run, partial)

    def close(self) -> None:
        self._client = None

    def __repr__(self) -> str:
        return f"RemoteStore({self.path!r})"

    # the remote tier's verbs -------------------------------------------------
    def publish(self, local: Store, generation: int | None = None, *, background: bool = True,
                progress: Callable[[int, int], None] | None = None) -> PublishHandle:
        """Publish committed `generation` of `local` (the newest by default); see :func:`.publish.publish`."""
        return publish(self, local, generation, background=background, progress=progress)

    def fetch(self, local: Store, generation: int | None = None) -> GenerationInfo:
        """Download published `generation` (the newest by default) into `local`; see :func:`.fetch.fetch`."""
        return fetch(self, local, generation)

    def claim_part(self, generation: int, part: int, nparts: int, *, node: str | None = None,
                   timeout: float | None = None) -> Claim | None:
        return claim_part(self, generation, part, nparts, node=node, timeout=timeout)

    def publish_part(self, local: Store, staging: str, generation: int, num_samples: int, part: int,
                     nparts: int, *, node: str | None = None) -> "PartManifest":
        return publish_part(self, local, staging, generation, num_samples, part, nparts, node=node)

    def fetch_parts(self, local: Store, generation: int, nparts: int, *, into: str | None = None,
                    parts: list[int] | None = None) -> list[int]:
        return fetch_parts(self, local, generation, nparts, into=into, parts=parts)

    def remote_generations(self) -> list[RemoteGeneration]:
        return remote_generations(self)


def _reopen(settings: RemoteSettings, key: str, allow_pickle: bool, verify: bool,
            max_sample_bytes: int | None = None) -> RemoteStore:
    return RemoteStore(settings, key, allow_pickle=allow_pickle, verify=verify, max_sample_bytes=max_sample_bytes)


def open_remote(url: str | RemoteURL, storage_options: Mapping[str, object] | None = None, *,
                local: Store | None = None, fingerprint: object = None, backend: str = "memmap",
                key: str | None = None, allow_pickle: bool = False, verify: bool = True,
                start_timeout: float | None = None, max_sample_bytes: int | None = None) -> RemoteStore:
    """The store under the remote root `url` that `local` (or `fingerprint`, or `key`) names.

    Parameters
    ----------
    url
        ``s3://bucket/path`` or ``file:///shared/path``: the root; or the store itself
        (``s3://bucket/path/<key>``).
    storage_options
        Endpoint, region, credentials and client options (see :mod:`.settings`); the
        environment's ``AWS_*`` variables otherwise.
    local
        A local store: the remote store is the one of its fingerprint and backend.
    fingerprint, backend
        Without `local`: the producer's fingerprint (as the loader records it) and backend.
    key
        Without either: the store's key; without any of them, the root must hold one store.
    allow_pickle
        Let readers load pickled leaves (never, by default: a remote is untrusted input).
    verify
        Check every record's checksum when reading.
    start_timeout
        Seconds to wait for the remote to answer at all; :class:`RemoteError` after them.
    max_sample_bytes
        Bytes one sample read from the remote may take (a record declaring more is damage); default
        :func:`cachestore.space.room.sample_limit`.

    Raises
    ------
    RemoteError
        The remote did not answer within `start_timeout`.
    RemoteConfigError
        The URL or options are invalid, or the root holds several stores and nothing chose one.
    """
    settings = remote_settings(url, storage_options)
    root = settings.url
    tail = (root.prefix if root.scheme == "s3" else root.path).rstrip("/").rsplit("/", 1)[-1]
    if layout.STORE_KEY.match(tail) and key is None and local is None and fingerprint is None:
        parent = root.prefix.rsplit("/", 1)[0] if root.scheme == "s3" and "/" in root.prefix else ""
        root = (RemoteURL("s3", root.bucket, parent) if root.scheme == "s3"
                else RemoteURL("file", path=root.path.rstrip("/").rsplit("/", 1)[0] or "/"))
        settings, key = settings.for_url(root), tail
    if start_timeout is not None:
        Client(settings, retry_timeout=start_timeout).list_dirs()
    if local is not None:
        key = local_key(local)
    elif fingerprint is not None:
        key = layout.store_key(backend, fingerprint_hash(fingerprint))
    elif key is None:
        found = [name for name in Client(settings).list_dirs() if layout.STORE_KEY.match(name)]
        if len(found) != 1:
            raise RemoteConfigError(f"{root} holds {len(found)} stores{': ' + ', '.join(found) if found else ''}; "
                                    f"name one: {root}/<key>" if found else f"{root} holds no store yet")
        key = found[0]
    return RemoteStore(settings, key, allow_pickle=allow_pickle, verify=verify, max_sample_bytes=max_sample_bytes)
