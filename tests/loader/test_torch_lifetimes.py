"""A loader used as torch's is: referenced only by its iterator, workers started by the first iter()."""

from __future__ import annotations

import gc

import psutil
import pytest

from loader import CachedLoader

from .conftest import live_children
from .datasets import ArangeDataset

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
