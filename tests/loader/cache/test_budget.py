"""The disk budget seen from the loader: refuse early, or stream uncached."""

from __future__ import annotations

import logging
import os

import pytest

from cachestore.errors import BudgetExceededError
from loader import CachedLoader

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(60)


def _store_files(prefix: str) -> list[str]:
    return sorted(os.listdir(prefix)) if os.path.isdir(prefix) else []


@pytest.mark.parametrize("backend,nb_worker", [("memmap", 2), ("lmdb", 2), ("memory", 2), ("memmap", 0)])
def test_budget_error_is_raised_early_and_leaves_nothing(no_leaks, backend, nb_worker):
    prefix = str(no_leaks / "c")
    calls_dir = no_leaks / "calls"
    calls_dir.mkdir()
    # 200 samples of 16 KiB: ~3 MiB; the budget is 256 KiB.
    loader = CachedLoader(ArangeDataset, {"n": 200, "shape": (64, 64), "counter_dir": str(calls_dir)},
                          batch_size=8, nb_worker=nb_worker, max_queue_size=2,
                          cache_setting={"prefix": prefix, "update_frequency": 2, "backend": backend,
                                         "disk_budget": "256KiB"})
    delivered = 0
    with pytest.raises(BudgetExceededError) as info:
        for _ in loader:
            delivered += 1
    message = str(info.value)
    assert "needs about" in message and "available" in message and "rotation window of about" in message
    assert delivered <= 3, "the budget error must come within the first batches"
    assert len(read_calls(str(calls_dir))) < 100
    loader.close()
    assert _store_files(prefix) in ([], ["store.json"])


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_budget_stream_serves_uncached_with_a_warning(no_leaks, caplog, nb_worker):
    prefix = str(no_leaks / "c")
    calls_dir = no_leaks / "calls"
    calls_dir.mkdir()
    with caplog.at_level(logging.WARNING):
        with CachedLoader(ArangeDataset, {"n": 120, "shape": (64, 64), "counter_dir": str(calls_dir)},
                          batch_size=8, nb_worker=nb_worker,
                          cache_setting={"prefix": prefix, "update_frequency": 5, "disk_budget": "256KiB",
                                         "on_budget_exceeded": "stream"}) as loader:
            for _ in range(2):
                assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(120))
            assert [s.mode for s in loader.epoch_stats] == ["generate", "compute"]
            assert loader.store.latest() is None
    assert any("cache disabled" in r.getMessage() for r in caplog.records)
    assert len(read_calls(str(calls_dir))) == 240
    assert _store_files(prefix) == ["store.json"]
