"""What a reader of a store needs, whichever tier holds it: the :class:`ReadableStore` interface.

Two stores implement it: :class:`cachestore.Store`, a directory (or an in-RAM store) this
process may also write, and :class:`cachestore.remote.RemoteStore`, generations published on
an object store, read over ranged requests. Callers ask the capability flags
(:attr:`~ReadableStore.writable`), never a class's name: a remote store is written by
publishing a local one, so it has no ``writer()`` to raise from.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Sequence, TypeVar

from ..backends.base import GenerationInfo
from ..errors import CacheStoreError
from .reader import Reader

_Store = TypeVar("_Store", bound="ReadableStore")


class ReadableStore(ABC):
    """Generations of samples under one path or URL, as their readers see them.

    Attributes
    ----------
    path
        The store's directory, or its URL on a remote.
    """

    path: str

    @property
    @abstractmethod
    def writable(self) -> bool:
        """Whether generations can be written here (``writer()``, ``join()``): a local store not
        opened ``readonly``."""

    @property
    @abstractmethod
    def fingerprint(self) -> dict[str, object] | None:
        """What produced the samples, as the store records it (``None``: not recorded)."""

    @abstractmethod
    def generations(self) -> list[GenerationInfo]:
        """The generations, oldest first; only the committed ones are served."""

    def latest(self) -> int | None:
        """Id of the newest committed generation, ``None`` when there is none."""
        committed = [g.id for g in self.generations() if g.committed]
        return max(committed) if committed else None

    @abstractmethod
    def reader(self, generation: int | None = None) -> Reader:
        """A map-style dataset over committed `generation` (the newest when ``None``).

        Raises
        ------
        GenerationNotFoundError
            There is no such generation (or none committed yet).
        """

    @abstractmethod
    def verify(self) -> Sequence[CacheStoreError]:
        """Check every checksum of every committed generation: one error per bad sample, and one
        per damaged generation (a local store's are :class:`~cachestore.CorruptSampleError`; a
        remote's also name the objects a download would refuse)."""

    @abstractmethod
    def close(self) -> None:
        """Release what the store holds in this process."""

    def __enter__(self: _Store) -> _Store:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
