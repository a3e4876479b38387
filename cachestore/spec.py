"""A store's address: what any process needs to reach it, small and picklable."""

from __future__ import annotations

from dataclasses import dataclass

from .backends import get_backend
from .backends.base import Backend


@dataclass(frozen=True)
class StoreSpec:
    """Where a store lives and how its records are encoded and checked.

    A spec travels inside tasks, readers and shard tickets (it pickles as five
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
    """

    path: str
    backend: str
    compression: str | None = None
    allow_pickle: bool = False
    verify: bool = True

    @property
    def persistent(self) -> bool:
        """Whether the data lives in files other processes can open (not in one process's RAM)."""
        return get_backend(self.backend).persistent

    def open_backend(self) -> Backend:
        """A fresh backend object for this store, in this process."""
        return get_backend(self.backend)(self.path, compression=self.compression,
                                         allow_pickle=self.allow_pickle, verify=self.verify)
