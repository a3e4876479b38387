"""What is served is never stale or foreign: fingerprints by value, damaged generations, runs side by side."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from cachestore.errors import FingerprintMismatchError
from loader import CachedLoader

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(90)


class TableDataset(ArangeDataset):
    """Sample i is {"x": table[i % len(table)] + i, "y": i}: the parameters decide the values."""

    def __init__(self, table: np.ndarray, n: int = 12, **kwargs) -> None:
        super().__init__(n=n, **kwargs)
        self.table = table

    def __getitem__(self, index: int) -> dict:
        sample = super().__getitem__(index)
        sample["x"] = sample["x"] + self.table[index % len(self.table)]
        return sample


def values(loader) -> dict[int, float]:
    return {int(y): float(np.asarray(x).ravel()[0]) for b in loader for y, x in zip(b["y"], b["x"])}


def test_a_changed_array_element_is_a_mismatch_naming_the_parameters(no_leaks):
    table = np.zeros(5000, dtype=np.float32)  # large: its repr elides the middle
    prefix = str(no_leaks / "c")
    with CachedLoader(TableDataset, {"table": table}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": prefix}) as loader:
        list(loader)
    changed = table.copy()
    changed[2500] = 1.0
    with CachedLoader(TableDataset, {"table": changed}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": prefix}) as loader:
        with pytest.raises(FingerprintMismatchError) as info:
            iter(loader)
    message = str(info.value)
    assert "parameters changed" in message and "on_mismatch" in message and "prefix" in message


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_on_mismatch_regenerate_replaces_the_old_samples(no_leaks, caplog, nb_worker):
    prefix = str(no_leaks / "c")
    with CachedLoader(TableDataset, {"table": np.zeros(3, np.float32)}, batch_size=4, nb_worker=nb_worker,
                      cache_setting={"prefix": prefix}) as loader:
        list(loader)
    caplog.set_level(logging.WARNING, logger="loader")
    with CachedLoader(TableDataset, {"table": np.full(3, 100, np.float32)}, batch_size=4, nb_worker=nb_worker,
                      cache_setting={"prefix": prefix, "on_mismatch": "regenerate"}) as loader:
        assert values(loader) == {i: i + 100.0 for i in range(12)}
        assert loader.epoch_stats[0].mode == "generate"
        assert values(loader) == {i: i + 100.0 for i in range(12)}
        assert [g.id for g in loader.store.generations() if g.committed] == [0]
    assert any("on_mismatch='regenerate'" in r.getMessage() for r in caplog.records)


def test_an_explicit_fingerprint_names_the_data(no_leaks):
    prefix = str(no_leaks / "c")
    calls = no_leaks / "calls"
    calls.mkdir()
    setting = {"prefix": prefix, "fingerprint": "labels-v3"}
    with CachedLoader(ArangeDataset, {"n": 8, "counter_dir": str(calls)}, batch_size=4, nb_worker=0,
                      cache_setting=setting) as loader:
        list(loader)
    # Another description of the same data (here: another delay), the same name: the cache is reused.
    with CachedLoader(ArangeDataset, {"n": 8, "counter_dir": str(calls), "delay": 0.001}, batch_size=4,
                      nb_worker=0, cache_setting=setting) as loader:
        list(loader)
        assert loader.epoch_stats[0].mode == "read"
    assert len(read_calls(str(calls))) == 8


DAMAGE = {
    "manifest deleted": lambda gen: (gen / "manifest.json").unlink(),
    "manifest garbage": lambda gen: (gen / "manifest.json").write_text("{not json"),
    "data truncated": lambda gen: os.truncate(next(gen.glob("col-0.bin")), 16),
}


@pytest.mark.parametrize("damage", list(DAMAGE))
@pytest.mark.parametrize("nb_worker", [0, 2])
def test_a_damaged_generation_is_written_again(no_leaks, caplog, damage, nb_worker):
    prefix = no_leaks / "c"
    setting = {"prefix": str(prefix), "update_frequency": 3, "background_refresh": False}
    with CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=nb_worker, cache_setting=setting) as loader:
        list(loader)
    DAMAGE[damage](prefix / "gen-000000")
    caplog.set_level(logging.WARNING, logger="loader")
    with CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=nb_worker, cache_setting=setting) as loader:
        for _ in range(2):
            assert values(loader) == {i: float(i) for i in range(20)}
        first, second = loader.epoch_stats
        assert (first.mode, first.committed, second.mode) == ("generate", True, "read")
        assert "damaged" in first.extra
        assert not loader.store.verify()
    assert any("damaged" in r.getMessage() for r in caplog.records)


def test_a_run_follows_another_run_that_moved_ahead(no_leaks, caplog):
    prefix = str(no_leaks / "c")
    setting = {"prefix": prefix, "update_frequency": 2, "background_refresh": False}
    with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=0, cache_setting=setting) as a:
        list(a)  # generation 0
        b = CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=0, cache_setting=setting)
        iter(b)  # started (the store opened) now, while generation 0 is the newest
        for _ in range(3):
            list(a)  # epochs 1-3: generation 1 committed, generation 0 pruned
        writing = iter(a)
        next(writing)  # epoch 4: A writes generation 2 and holds the writer lock
        caplog.set_level(logging.INFO, logger="loader")
        with b:
            assert sorted(y for batch in b for y in batch["y"].tolist()) == list(range(12))
            assert (b.epoch_stats[0].mode, b.epoch_stats[0].generation) == ("read", 1)
        del writing
    assert any("moved ahead" in r.getMessage() for r in caplog.records)
