"""The disk under the cache prefix fills up: a clear error or the promised fallback, nothing locked.

On a real 4 MiB tmpfs. Each ``on_budget_exceeded`` policy, with and without
workers, for a disk that is full before the generate epoch (``full``), one
that has not even an inode left for the writer lock (``no-inodes``), and one
that fills during the epoch (``fills``). Afterwards nothing is left (no
``writer.lock``, no staging) and, once there is room again, a new loader on
the same prefix caches.
"""

from __future__ import annotations


import pytest

from cachestore.errors import BudgetExceededError
from loader import CachedLoader

from ...fullfs import fill, free, mounted_tmpfs
from ..conftest import leftovers
from ..faulty_datasets import DiskFillingDataset

pytestmark = pytest.mark.timeout(90)

N = 48  # samples of 16 KiB: 768 KiB, well inside the 4 MiB file system


@pytest.fixture
def small_fs(no_leaks):
    with mounted_tmpfs(no_leaks / "fs", "4m") as mount_point:
        yield mount_point


def _loader(prefix, policy, nb_worker, backend, fill_dir=None, fill_at=None) -> CachedLoader:
    return CachedLoader(DiskFillingDataset, {"n": N, "fill_dir": fill_dir, "fill_at": fill_at}, batch_size=4,
                        nb_worker=nb_worker, seed=0, max_queue_size=4,
                        cache_setting={"prefix": str(prefix), "update_frequency": 2, "backend": backend,
                                       "on_budget_exceeded": policy})


def _ys(batches) -> list[int]:
    return sorted(y for b in batches for y in b["y"].tolist())


def _caches_once_there_is_room(prefix, mount_point, nb_worker, backend) -> None:
    """After the filler is removed: a new loader on the prefix writes, commits and reads its cache."""
    free(mount_point)
    assert leftovers(str(prefix)) == [], "a lock or staging area outlived the full disk"
    # Same dataset parameters (the fingerprint); the dataset fills the disk once per test only.
    with _loader(prefix, "error", nb_worker, backend, str(mount_point), N // 2) as loader:
        assert _ys(loader) == list(range(N))
        assert _ys(loader) == list(range(N))
        assert loader.epoch_stats[-1].mode == "read"
        assert not loader.store.verify()
    assert leftovers(str(prefix)) == []


WHEN = ["full", "no-inodes", "fills"]
CASES = [(backend, nb_worker) for backend in ("memmap", "lmdb") for nb_worker in (0, 2)]


def _run(small_fs, policy, when, backend, nb_worker):
    prefix = small_fs / "cache"
    if when != "fills":
        (small_fs.parent / "filled-once").touch()  # the dataset leaves the disk alone
    loader = _loader(prefix, policy, nb_worker, backend, str(small_fs), N // 2)
    iter(loader)  # the store is made at the first iter() (an iterator that serves nothing takes no epoch)
    if when != "fills":
        # After the store was created: the generate epoch finds no room at all.
        fill(small_fs, inodes=when == "no-inodes")
    return prefix, loader


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("backend,nb_worker", CASES)
def test_error_policy_raises_budget_error_and_unlocks(small_fs, when, backend, nb_worker):
    prefix, loader = _run(small_fs, "error", when, backend, nb_worker)
    with loader:
        with pytest.raises(BudgetExceededError, match="disk full|no room|over the 0 B available"):
            list(loader)
        assert leftovers(str(prefix)) == []
        if when == "fills":
            free(small_fs)
            # The same loader: its next epoch writes the generation again, now that it fits.
            assert _ys(loader) == list(range(N))
            assert loader.epoch_stats[-1].committed
    _caches_once_there_is_room(prefix, small_fs, nb_worker, backend)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("backend,nb_worker", CASES)
def test_stream_policy_serves_every_sample(small_fs, when, backend, nb_worker):
    prefix, loader = _run(small_fs, "stream", when, backend, nb_worker)
    with loader:
        for _ in range(2):
            assert _ys(loader) == list(range(N))
        assert loader.store.latest() is None
        assert leftovers(str(prefix)) == []
    _caches_once_there_is_room(prefix, small_fs, nb_worker, backend)


@pytest.mark.parametrize("when", WHEN)
@pytest.mark.parametrize("backend,nb_worker", CASES)
def test_rotate_policy_keeps_serving(small_fs, when, backend, nb_worker):
    prefix, loader = _run(small_fs, "rotate", when, backend, nb_worker)
    with loader:
        for _ in range(3):
            ys = _ys(loader)
            assert set(ys) == set(range(N)) and len(ys) % N == 0, "every sample, as often as every other"
        assert loader.store.latest() is None
    assert leftovers(str(prefix)) == []
    _caches_once_there_is_room(prefix, small_fs, nb_worker, backend)
