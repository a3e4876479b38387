"""Opening a store by its address: a local path, or the URL of a store on a remote.

:func:`open_store` is the one entry point; it sits above both tiers, so the local store never
imports the remote one (docs/ARCHITECTURE.md, "Layers"), and the remote tier (with its optional
``remote`` extra) is imported only when a URL is opened.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Iterable

from .store import Fingerprint, Store, open_local, sample_bytes

if TYPE_CHECKING:
    from .remote.store import RemoteStore


def open_store(path: str | os.PathLike[str], backend: str | None = None, *, compression: str | None = None,
               disk_budget: int | str | None = None, allow_pickle: bool = False, readonly: bool = False,
               fingerprint: Fingerprint | None = None, producer: dict[str, object] | None = None,
               verify: bool = True, trusted_uids: Iterable[int] | None = None,
               trusted_gids: Iterable[int] | None = None, max_sample_bytes: int | str | None = None
               ) -> Store | RemoteStore:
    """Open the store at `path`: a local one (created if missing), or one on a remote.

    Parameters
    ----------
    path
        A local store's directory (see :func:`cachestore.store.open_local`, whose parameters the
        others are), or the URL of a store on a remote: ``s3://bucket/path`` or ``file:///path``,
        the root under which the remote tier keys stores (the one of `fingerprint` and `backend`,
        or the only one there), or the store itself (``<root>/<key>``).
    backend, compression, disk_budget, allow_pickle, readonly, fingerprint, producer
        As :func:`~cachestore.store.open_local` (a remote store takes `fingerprint` and `backend`,
        which name it under a root; it is never written).
    verify, trusted_uids, trusted_gids, max_sample_bytes
        As :func:`~cachestore.store.open_local` (a remote store takes `verify` and `max_sample_bytes`).

    Returns
    -------
    Store or RemoteStore
        For an ``s3://`` or ``file://`` URL, a read-only :class:`cachestore.remote.RemoteStore`
        (``reader()`` reads straight from the remote; endpoint and credentials from the
        ``AWS_*`` environment variables; needs the ``remote`` extra).
    """
    # The schemes of cachestore.remote.url.SCHEMES, named here: importing that package for every
    # local path would load the remote tier into every loader.
    if isinstance(path, str) and "://" in path and path.split("://", 1)[0] in ("s3", "file"):
        from .remote.store import open_remote

        return open_remote(path, fingerprint=fingerprint, backend=backend or "memmap", allow_pickle=allow_pickle,
                           verify=verify, max_sample_bytes=sample_bytes(max_sample_bytes))
    return open_local(path, backend, compression=compression, disk_budget=disk_budget, allow_pickle=allow_pickle,
                      readonly=readonly, fingerprint=fingerprint, producer=producer, verify=verify,
                      trusted_uids=trusted_uids, trusted_gids=trusted_gids, max_sample_bytes=max_sample_bytes)
