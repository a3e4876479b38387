"""What a stream's loader asks of its store before it starts an epoch: what is committed, who writes.

A stream's length is what its newest committed generation holds (``docs/ARCHITECTURE.md``,
"Streams"). Two jobs on one prefix with the same stream: the first to start its generate epoch
takes the store's writer lock and iterates the stream; the other waits until it is done, then
reads what it committed (or, when it committed nothing, writes it itself).
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Callable

from cachestore.store import open_local as open_store
from cachestore.errors import CacheStoreError

from ..dataset import DatasetSource
from ..distributed import ConsumerLayout
from ..settings import CacheSettings
from .fingerprint import dataset_fingerprint

if TYPE_CHECKING:
    from .controller import CacheController

log = logging.getLogger(__name__)

#: Longest pause between two looks at a store another job writes.
MAX_POLL = 0.5


def committed_length(settings: CacheSettings, layout: ConsumerLayout, dataset: DatasetSource,
                     remote: bool = False) -> int:
    """Samples in the newest generation a stream of this fingerprint committed under the prefix (0: none);
    with `remote`, where the prefix holds none, in the newest one ``cache_setting["remote"]`` published
    (the first epoch fetches it: its length is the loader's from that epoch on).

    The store is only looked at (opened read-only, nothing swept or created)."""
    def fingerprint() -> dict[str, object]:  # only where there is a store to compare with
        return dataset_fingerprint(dataset, layout.num_samples, layout.store_owner, settings.fingerprint)

    found = _local_length(settings, layout.store_path(settings.prefix), fingerprint)
    if found or not remote or settings.remote is None:
        return found
    from .remote import published_length  # the remote extra: imported only for a loader with a remote

    return published_length(settings, fingerprint())


def _local_length(settings: CacheSettings, path: str, fingerprint: Callable[[], dict[str, object]]) -> int:
    if settings.backend == "memory" or not os.path.isfile(os.path.join(path, "store.json")):
        return 0
    expected = fingerprint()
    try:
        with open_store(path, readonly=True) as store:
            if store.fingerprint != expected:
                return 0
            committed = [g for g in store.generations() if g.committed]
    except CacheStoreError:
        return 0
    return max(committed, key=lambda g: g.id).num_samples if committed else 0


def controller_length(cache: CacheController) -> int:
    """Samples in the newest generation the store of a started loader committed; where it holds none, in
    the newest its remote published (fetched by the epoch that needs it, not iterated again)."""
    committed = cache.committed()
    if committed:
        return committed[max(committed)].num_samples
    return cache.remote.published_length() if cache.remote is not None else 0


def wait_for_writer(settings: CacheSettings, layout: ConsumerLayout, timeout: float | None) -> None:
    """Wait while another process writes the store (another job iterating the same stream into it).

    Raises
    ------
    TimeoutError
        It still writes after `timeout` seconds (``None``: wait as long as it takes).
    """
    path = layout.store_path(settings.prefix)
    if settings.backend == "memory" or not os.path.isfile(os.path.join(path, "store.json")):
        return
    start, pause, told = time.monotonic(), 0.01, False
    with open_store(path, readonly=True) as store:
        while True:
            holder = store.lock_holder()
            if holder is None or holder == os.getpid():
                return
            if not told:
                log.info("%s is being written by process %s (another job iterating this stream?): waiting for its "
                         "generation", path, holder)
                told = True
            if timeout is not None and time.monotonic() - start > timeout:
                raise TimeoutError(f"{path} was still being written by process {holder} after {timeout} s")
            time.sleep(pause)  # a lock another process holds: nothing to wait on but its release
            pause = min(MAX_POLL, pause * 2)
