"""A loader used as torch's is: referenced only by its iterator, workers started by the first iter()."""

from __future__ import annotations

import gc

import psutil
import pytest

from cachestore import FingerprintMismatchError
from loader import CachedLoader

from .conftest import live_children
from .datasets import ArangeDataset, OffsetDataset

pytestmark = pytest.mark.timeout(120)


def assert_no_workers_left() -> None:
    gc.collect()
    _, alive = psutil.wait_procs(live_children(), timeout=30)
    assert not alive, f"worker processes left running: {alive}"


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("committed", [False, True], ids=["computed", "committed"])
def test_a_loader_referenced_only_by_its_loop(workers, committed, tmp_path):
    cache = {"prefix": str(tmp_path / "c")}
    if committed:
        with CachedLoader(ArangeDataset(20), batch_size=4, nb_worker=workers, cache_setting=cache) as loader:
            assert sum(len(b["y"]) for b in loader) == 20
    ys = sorted(int(y) for b in CachedLoader(ArangeDataset(20), batch_size=4, nb_worker=workers,
                                             cache_setting=cache) for y in b["y"])
    assert ys == list(range(20))
    assert_no_workers_left()


@pytest.mark.parametrize("workers", [0, 2])
def test_the_iterator_keeps_its_loader_alive(workers):
    loader = CachedLoader(ArangeDataset(12), batch_size=4, nb_worker=workers, shuffle=False)
    it = iter(loader)
    del loader
    gc.collect()
    assert [int(y) for b in it for y in b["y"]] == list(range(12))
    del it
    assert_no_workers_left()


def test_a_dropped_iterator_half_way_stops_the_workers():
    it = iter(CachedLoader(ArangeDataset(40), batch_size=2, nb_worker=2, shuffle=False))
    next(it)
    del it
    assert_no_workers_left()


# ---------------------------------------------------------------------------- workers start at the first iter()
def test_nothing_starts_before_the_first_iter_and_the_workers_get_the_dataset_as_it_is_then():
    ds = OffsetDataset(8)
    with CachedLoader(ds, batch_size=4, nb_worker=2, shuffle=False) as loader:
        assert not live_children() and loader.worker_pids() == []
        ds.offset = 100.0  # as torch's workers, ours copy the dataset at the first iter()
        xs = [float(x) for b in loader for x in b["x"][:, 0]]
        assert len(loader.worker_pids()) == 2
    assert xs == [100.0 + i for i in range(8)]


def test_more_workers_than_cores_warn_as_torch_and_start_nothing():
    with pytest.warns(UserWarning, match="excessive worker creation might get DataLoader running slow"):
        loader = CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=1000)
    try:
        assert not live_children()
    finally:
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_changed_before_iterating_is_filed_under_its_new_fingerprint(workers, tmp_path):
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}
    changed = OffsetDataset(8)
    with CachedLoader(changed, batch_size=4, nb_worker=workers, shuffle=False, cache_setting=cache) as loader:
        changed.offset = 100.0
        assert [float(x) for b in loader for x in b["x"][:, 0]] == [100.0 + i for i in range(8)]
    # A later run with the dataset as it was built is another dataset to that store, never served its values.
    with CachedLoader(OffsetDataset(8), batch_size=4, nb_worker=workers, shuffle=False,
                      cache_setting=cache) as loader:
        with pytest.raises(FingerprintMismatchError, match="state"):
            iter(loader)
    with CachedLoader(OffsetDataset(8), batch_size=4, nb_worker=workers, shuffle=False,
                      cache_setting={**cache, "on_mismatch": "regenerate"}) as loader:
        assert [float(x) for b in loader for x in b["x"][:, 0]] == [float(i) for i in range(8)]
