"""Exceptions of the loader; like the store's, they derive from :class:`cachestore.CacheStoreError`."""

from __future__ import annotations

from cachestore.errors import CacheStoreError


class WorkerError(CacheStoreError, RuntimeError):
    """A loader worker died repeatedly, could not be started, or failed outside the dataset."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``.

    ``indices`` are the dataset indices the stuck worker was computing, ``pid``
    its process id and ``stack`` its Python stack when the timeout expired.
    """

    indices: list[int] | None = None
    pid: int | None = None
    stack: str | None = None



class MissingDependencyError(CacheStoreError, ImportError):
    """An optional extra the settings ask for is not installed (the message says what to install)."""


__all__ = ["MissingDependencyError", "WorkerError", "WorkerTimeoutError"]
