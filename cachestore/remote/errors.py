"""The remote tier's errors: each a :class:`~cachestore.errors.CacheStoreError`, and the builtin a
caller would catch (a server that cannot be reached is an ``OSError``, a bad manifest a ``ValueError``)."""

from __future__ import annotations

from ..errors import CacheStoreError, CorruptSampleError


class RemoteError(CacheStoreError, OSError):
    """The remote could not be reached, or refused a request (after the retries)."""


class RemoteConfigError(CacheStoreError, ValueError):
    """A remote URL or ``storage_options`` that cannot work (bad scheme, bucket, option)."""


class RemoteManifestError(CacheStoreError, ValueError):
    """A manifest, ``store.json`` or index on the remote is malformed or names something it may not
    (a path outside the local prefix, an object beyond its real size): the remote is untrusted input."""


class RemoteCorruptError(CorruptSampleError):
    """An object's bytes do not match the checksum its manifest records (after one new download).
    ``key`` names the object."""

    key: str | None = None


class RemoteForkError(CacheStoreError, RuntimeError):
    """A remote used in a process forked from one that had used it already: the client's runtime does
    not survive a fork (start such processes with spawn or forkserver)."""


class ExtraMissingError(CacheStoreError, ImportError):
    """The remote tier needs its optional dependency: ``pip install 'cachestore[remote]'``."""


class ObjectNotFoundError(RemoteError, FileNotFoundError):
    """The object a request named is not on the remote (``key`` names it)."""

    key: str | None = None
