"""A store's address: what any process needs to reach it, small and picklable."""

from __future__ import annotations

from dataclasses import dataclass

from . import backend_origin, get_backend
from ..guard.trust import OWN, Trust
from .base import Backend


@dataclass(frozen=True)
class StoreSpec:
    """Where a store lives and how its records are encoded and checked.

    A spec travels inside tasks, readers and shard tickets (it pickles as a few
    plain values) and opens the backend again in whatever process it lands in.

    Parameters
    ----------
    path
        The store's directory (for the ``memory`` backend only a name).
    backend
        A name from :func:`cachestore.available_backends`.
    compression
        ``None`` or ``"zstd"`` for what is written.
    allow_pickle
        Store otherwise unsupported sample types with pickle.
    verify
        Check each record's checksum when it is read.
    origin
        ``"module:Class"`` of a backend plugged in with :func:`cachestore.register_backend`
        (:func:`~cachestore.backends.backend_origin`): a process that has not registered it (a
        spawned worker) registers it from there. Taken from the process that made the spec,
        never from a store's files.
    trust
        Whose generations and staging areas besides this user's are read (:mod:`cachestore.guard.trust`).
    max_sample_bytes
        The most bytes one sample may take when read back (decompressed, or by its schema).
    """

    path: str
    backend: str
    compression: str | None = None
    allow_pickle: bool = False
    verify: bool = True
    origin: str | None = None
    trust: Trust = OWN
    max_sample_bytes: int | None = None

    @classmethod
    def of(cls, path: str, backend: str, compression: str | None = None, allow_pickle: bool = False,
           verify: bool = True, trust: Trust = OWN, max_sample_bytes: int | None = None) -> StoreSpec:
        """The spec of a store of `backend`, with the backend's origin where it was plugged in."""
        return cls(path, backend, compression, allow_pickle, verify, backend_origin(backend), trust,
                   max_sample_bytes)

    @property
    def persistent(self) -> bool:
        """Whether the data lives in files other processes can open (not in one process's RAM)."""
        return get_backend(self.backend, self.origin).persistent

    def open_backend(self) -> Backend:
        """A fresh backend object for this store, in this process."""
        backend = get_backend(self.backend, self.origin)(self.path, compression=self.compression,
                                                         allow_pickle=self.allow_pickle, verify=self.verify)
        # Not constructor arguments: backends plugged in keep their signature.
        backend.trust, backend.max_sample_bytes = self.trust, self.max_sample_bytes
        return backend
