"""A store's place on a remote: its key, its client, its documents.

:class:`RemoteBase` is what every verb of the remote tier works on (:mod:`.publish`,
:mod:`.fetch`, :mod:`.parts`, :mod:`.reader`, :mod:`.leases`, :mod:`.pruning`): the settings,
the store's key and URL, this process's client, ``store.json`` and the generations'
manifests. :class:`~.store.RemoteStore` adds the :class:`~cachestore.ReadableStore` interface and the
verbs on top, so the verbs' modules never import the store's (no import circle).
"""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import xxhash

from ..errors import CacheStoreError, GenerationNotFoundError, NotAStoreError
from . import layout
from .client import Client
from .errors import ObjectNotFoundError, RemoteConfigError
from .manifest import KIND_STORE, MAX_DOC_BYTES, GenerationManifest, encode, parse_generation, parse_store
from .settings import RemoteSettings

if TYPE_CHECKING:
    from ..store import Store


def fingerprint_hash(fingerprint: object) -> str:
    """The hash a store's fingerprint is known by (the one ``Store.staging_record`` gives)."""
    return xxhash.xxh3_64_hexdigest(json.dumps(fingerprint, sort_keys=True, default=str).encode())


def local_key(store: "Store") -> str:
    """The remote key of the local `store`: its backend and the hash of its fingerprint."""
    if store.fingerprint is None:
        raise CacheStoreError(f"{store.path} has no fingerprint: a remote keys stores by what produced them, so "
                              "that stores of different datasets never mix; open it with fingerprint=... "
                              "(the loader always records one)")
    return layout.store_key(store.backend_name, fingerprint_hash(store.fingerprint))


class RemoteBase:
    """One store's key on a remote root, with its client and documents (see the module docstring)."""

    def __init__(self, settings: RemoteSettings, key: str, *, allow_pickle: bool = False, verify: bool = True,
                 max_sample_bytes: int | None = None) -> None:
        if not layout.STORE_KEY.match(key):
            raise RemoteConfigError(f"{key!r} is not a store key (<backend>-<16 hex digits>)")
        self.settings = settings
        self.key = key
        self.path = f"{str(settings.url).rstrip('/')}/{key}"
        self.backend_name = key.split("-", 1)[0]
        self.allow_pickle = allow_pickle
        self.verify_reads = verify
        #: What one sample read from here may take (``max_sample_bytes``; ``None``: the default bound).
        self.max_sample_bytes = max_sample_bytes
        self.readonly = True
        self._client: Client | None = None
        self._pid = os.getpid()
        self._doc: dict[str, Any] | None = None
        self._manifests: dict[int, GenerationManifest] = {}

    @property
    def client(self) -> Client:
        """This process's client (a new one after a fork: a client's connections never cross one)."""
        if self._client is None or self._pid != os.getpid():
            self._client = Client(self.settings)
            self._pid = os.getpid()
        return self._client

    def doc(self) -> dict[str, Any]:
        """The remote ``store.json`` (parsed strictly); :class:`NotAStoreError` when there is none."""
        if self._doc is None:
            key = layout.store_doc(self.key)
            try:
                data = self.client.get_document(key, MAX_DOC_BYTES)
            except ObjectNotFoundError:
                raise NotAStoreError(f"{self.path} holds no store (no {layout.STORE_DOC}); nothing was published "
                                     "there for this dataset yet") from None
            self._doc = parse_store(data, f"{self.path}/{layout.STORE_DOC}", self.key)
        return self._doc

    def ensure_doc(self, local: "Store") -> None:
        """Write the remote ``store.json`` from `local`'s (once: a conditional create), or check the one there."""
        fp_hash = self.key.split("-", 1)[1]
        doc = {"kind": KIND_STORE, "backend": self.backend_name, "fingerprint_hash": fp_hash,
               "compression": local.compression if local.compression in (None, "zstd") else None,
               "fingerprint": local.fingerprint, "producer": local.meta.get("producer"),
               "store_format": _int(local.meta.get("format")), "created": time.time()}
        data = encode(json.loads(json.dumps(doc, default=str)))
        self.client.put_new(layout.store_doc(self.key), data)
        self.doc()

    def manifest(self, generation: int) -> GenerationManifest:
        """Generation `generation`'s manifest (parsed strictly, cached: a manifest never changes)."""
        found = self._manifests.get(generation)
        if found is None:
            key = layout.generation_manifest(self.key, generation)
            try:
                data = self.client.get_document(key, MAX_DOC_BYTES)
            except ObjectNotFoundError:
                raise GenerationNotFoundError(f"generation {generation} is not published on {self.path} (or not "
                                              "complete yet: its manifest is written last)") from None
            found = parse_generation(data, f"{self.path}/generations/{generation:06d}.json", self.key, generation)
            self._manifests[generation] = found
        return found

    def generation_ids(self) -> list[int]:
        """Ids of the complete generations, oldest first (a listing, no manifest read)."""
        ids = [layout.parse_generation_manifest(info.key.rsplit("/", 1)[-1])
               for info in self.client.list_objects(layout.generations_prefix(self.key))]
        return sorted(i for i in ids if i is not None)

    def latest(self) -> int | None:
        """The newest complete generation, or ``None``."""
        ids = self.generation_ids()
        return ids[-1] if ids else None


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) and not isinstance(value, bool) else 0
