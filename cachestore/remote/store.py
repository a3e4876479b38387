"""A store on a remote: its key below the root, its documents, its generations.

:func:`open_remote` finds the store (from a local store's fingerprint, a fingerprint, an
explicit key, or the only store under the root) and returns a :class:`RemoteStore`. It is
read-only as a :class:`~cachestore.Store` (``generations()``, ``latest()``, ``reader()``,
``prune()``), and the remote tier's verbs live on it as thin methods over their modules:
:meth:`~RemoteStore.publish` (:mod:`.publish`), :meth:`~RemoteStore.fetch` (:mod:`.fetch`),
:meth:`~RemoteStore.claim_part`, :meth:`~RemoteStore.publish_part`,
:meth:`~RemoteStore.fetch_parts` (:mod:`.parts`), :meth:`~RemoteStore.prune` (:mod:`.pruning`).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any, Callable, Mapping

import xxhash

from ..backends.base import GenerationInfo
from ..errors import CacheStoreError, GenerationNotFoundError, NotAStoreError
from ..store import Store
from . import layout
from .client import Client
from .errors import ObjectNotFoundError, RemoteConfigError
from .manifest import KIND_STORE, GenerationManifest, encode, parse_generation, parse_store
from .settings import RemoteSettings, remote_settings
from .url import RemoteURL, parse_url

if TYPE_CHECKING:
    from ..pruning import Removed
    from ..reader import Reader
    from ..writer import GenerationWriter
    from .manifest import PartManifest
    from .parts import Claim, RemoteGeneration
    from .publish import PublishHandle


def fingerprint_hash(fingerprint: object) -> str:
    """The hash a store's fingerprint is known by (the one ``Store.staging_record`` gives)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(fingerprint, sort_keys=True, default=str).encode())


def local_key(store: Store) -> str:
    """The remote key of the local `store`: its backend and the hash of its fingerprint."""
    if store.fingerprint is None:
        raise CacheStoreError(f"{store.path} has no fingerprint: a remote keys stores by what produced them, so "
                              "that stores of different datasets never mix; open it with fingerprint=... "
                              "(the loader always records one)")
    return layout.store_key(store.backend_name, fingerprint_hash(store.fingerprint))


class RemoteStore(Store):
    """One store on a remote root (see the module docstring); pickles without credentials."""

    def __init__(self, settings: RemoteSettings, key: str, *, allow_pickle: bool = False, verify: bool = True) -> None:
        if not layout.STORE_KEY.match(key):
            raise RemoteConfigError(f"{key!r} is not a store key (<backend>-<16 hex digits>)")
        self.settings = settings
        self.key = key
        self.path = f"{str(settings.url).rstrip('/')}/{key}"
        self.backend_name = key.split("-", 1)[0]
        self.allow_pickle = allow_pickle
        self.verify_reads = verify
        self.readonly = True
        self._client: Client | None = None
        self._pid = os.getpid()
        self._doc: dict[str, Any] | None = None
        self._manifests: dict[int, GenerationManifest] = {}

    def __reduce__(self) -> tuple[Callable[..., RemoteStore], tuple[object, ...]]:  # type: ignore[override]
        return (_reopen, (self.settings, self.key, self.allow_pickle, self.verify_reads))

    @property
    def client(self) -> Client:
        """This process's client (a new one after a fork: a client's connections never cross one)."""
        if self._client is None or self._pid != os.getpid():
            self._client = Client(self.settings)
            self._pid = os.getpid()
        return self._client

    # documents --------------------------------------------------------------
    def doc(self) -> dict[str, Any]:
        """The remote ``store.json`` (parsed strictly); :class:`NotAStoreError` when there is none."""
        if self._doc is None:
            key = layout.store_doc(self.key)
            try:
                data = self.client.get(key)
            except ObjectNotFoundError:
                raise NotAStoreError(f"{self.path} holds no store (no {layout.STORE_DOC}); nothing was published "
                                     "there for this dataset yet") from None
            self._doc = parse_store(data, f"{self.path}/{layout.STORE_DOC}", self.key)
        return self._doc

    def ensure_doc(self, local: Store) -> None:
        """Write the remote ``store.json`` from `local`'s (once: a conditional create), or check the one there."""
        fp_hash = self.key.split("-", 1)[1]
        doc = {"kind": KIND_STORE, "backend": self.backend_name, "fingerprint_hash": fp_hash,
               "compression": local.compression if local.compression in (None, "zstd") else None,
               "fingerprint": local.fingerprint, "producer": local.meta.get("producer"),
               "store_format": _int(local.meta.get("format")), "created": time.time()}
        data = encode(json.loads(json.dumps(doc, default=str)))
        self.client.put_new(layout.store_doc(self.key), data)
        self.doc()

    @property
    def fingerprint(self) -> dict[str, object] | None:
        fp = self.doc().get("fingerprint")
        return fp if isinstance(fp, dict) else None

    @property
    def meta(self) -> dict[str, object]:  # type: ignore[override]
        return dict(self.doc())

    @property
    def compression(self) -> str | None:  # type: ignore[override]
        value = self.doc().get("compression")
        return value if isinstance(value, str) else None

    def manifest(self, generation: int) -> GenerationManifest:
        """Generation `generation`'s manifest (parsed strictly, cached: a manifest never changes)."""
        found = self._manifests.get(generation)
        if found is None:
            key = layout.generation_manifest(self.key, generation)
            try:
                data = self.client.get(key)
            except ObjectNotFoundError:
                raise GenerationNotFoundError(f"generation {generation} is not published on {self.path} (or not "
                                              "complete yet: its manifest is written last)") from None
            found = parse_generation(data, f"{self.path}/generations/{generation:06d}.json", self.key, generation)
            self._manifests[generation] = found
        return found

    # the read side of a Store --------------------------------------------------
    def generation_ids(self) -> list[int]:
        """Ids of the complete generations, oldest first (a listing, no manifest read)."""
        ids = [layout.parse_generation_manifest(info.key.rsplit("/", 1)[-1])
               for info in self.client.list_objects(layout.generations_prefix(self.key))]
        return sorted(i for i in ids if i is not None)

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

    def latest(self) -> int | None:
        ids = self.generation_ids()
        return ids[-1] if ids else None

    def reader(self, generation: int | None = None) -> "Reader":
        """A map-style dataset over a published generation (the newest when ``None``), read straight
        from the remote: one ranged read per run of consecutive records (:mod:`.reader`)."""
        from .reader import RemoteReader

        if generation is None:
            generation = self.latest()
            if generation is None:
                raise GenerationNotFoundError(f"{self.path} has no complete generation yet")
        return RemoteReader(self, generation)

    def verify(self) -> list[Any]:
        """Check every record of every published generation (reads all of them)."""
        bad = []
        for g in self.generation_ids():
            with self.reader(g) as reader:
                bad.extend(reader.verify())
        return bad

    def usage(self) -> int:
        return sum(g.nbytes for g in self.generations())

    def prune(self, keep: int = 1, dry_run: bool = False, max_bytes: int | str | None = None,
              partial: bool = False) -> list["Removed"]:
        """Remove published generations beyond the newest `keep` (never one with a live reader lease), and
        data no manifest names (an interrupted publish, older than a day, or any with `partial`)."""
        from .pruning import prune_remote

        if max_bytes is not None:
            raise CacheStoreError("prune of a remote store takes --keep, not --max-bytes")
        return prune_remote(self, keep, dry_run, partial)

    def writer(self, generation: int, num_samples: int | None = None, resume: bool = False) -> "GenerationWriter":
        raise CacheStoreError(f"{self.path} is a remote store: write a local store and publish it "
                              "(RemoteStore.publish, or `cachestore push PREFIX URL`)")

    def join(self, generation: int, num_samples: int) -> Any:
        return self.writer(generation, num_samples)

    def lock_holder(self) -> int | None:
        return None

    def close(self) -> None:
        self._client = None

    def __repr__(self) -> str:
        return f"RemoteStore({self.path!r})"

    # the remote tier's verbs -------------------------------------------------
    def publish(self, local: Store, generation: int | None = None, *, background: bool = True,
                progress: Callable[[int, int], None] | None = None) -> "PublishHandle":
        """Publish committed `generation` of `local` (the newest by default); see :func:`.publish.publish`."""
        from .publish import publish

        return publish(self, local, generation, background=background, progress=progress)

    def fetch(self, local: Store, generation: int | None = None) -> GenerationInfo:
        """Download published `generation` (the newest by default) into `local`; see :func:`.fetch.fetch`."""
        from .fetch import fetch

        return fetch(self, local, generation)

    def claim_part(self, generation: int, part: int, nparts: int, *, node: str | None = None,
                   timeout: float | None = None) -> "Claim | None":
        from .parts import claim_part

        return claim_part(self, generation, part, nparts, node=node, timeout=timeout)

    def publish_part(self, local: Store, staging: str, generation: int, num_samples: int, part: int,
                     nparts: int, *, node: str | None = None) -> "PartManifest":
        from .parts import publish_part

        return publish_part(self, local, staging, generation, num_samples, part, nparts, node=node)

    def fetch_parts(self, local: Store, generation: int, nparts: int, *, into: str | None = None,
                    parts: list[int] | None = None) -> list[int]:
        from .parts import fetch_parts

        return fetch_parts(self, local, generation, nparts, into=into, parts=parts)

    def remote_generations(self) -> list["RemoteGeneration"]:
        from .parts import remote_generations

        return remote_generations(self)


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0


def _reopen(settings: RemoteSettings, key: str, allow_pickle: bool, verify: bool) -> RemoteStore:
    return RemoteStore(settings, key, allow_pickle=allow_pickle, verify=verify)


def open_remote(url: str | RemoteURL, storage_options: Mapping[str, object] | None = None, *,
                local: Store | None = None, fingerprint: object = None, backend: str = "memmap",
                key: str | None = None, allow_pickle: bool = False, verify: bool = True,
                start_timeout: float | None = None) -> RemoteStore:
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
    return RemoteStore(settings, key, allow_pickle=allow_pickle, verify=verify)
