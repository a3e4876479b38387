"""Exceptions of the loader; like the store's, they derive from :class:`cachestore.CacheStoreError`."""

from __future__ import annotations

from cachestore.errors import CacheStoreError


class WorkerError(CacheStoreError, RuntimeError):
    """A loader worker died repeatedly, could not be started, or failed outside the dataset."""

__all__ = ["WorkerError"]
