"""Background refresh: the next generation is computed during the cached epochs before it."""

from __future__ import annotations

import logging
import math

import numpy as np
import pytest

from loader import CachedLoader

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(90)


def served(loader) -> dict[int, np.ndarray]:
    return {y: np.array(x) for b in loader for y, x in zip(b["y"].tolist(), b["x"])}


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_refresh_epochs_read_a_generation_computed_in_the_background(no_leaks, backend):
    calls = no_leaks / "calls"
    calls.mkdir()
    n, k = 48, 3
    with CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls), "augment": True}, batch_size=8,
                      nb_worker=2, seed=1, cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": k,
                                                          "backend": backend, "background_refresh": True}) as loader:
        epochs = [served(loader) for _ in range(7)]
        modes = [s.mode for s in loader.epoch_stats]
        gens = [s.generation for s in loader.epoch_stats]
    assert modes == ["generate"] + ["read"] * 6, "refresh epochs read what the background wrote"
    assert gens == [0, 0, 0, 1, 1, 1, 2]
    # Generations 0-2 whole; generation 3 started in the background when epoch 6 began.
    assert 3 * n <= len(read_calls(str(calls))) <= 4 * n
    for e in range(7):
        assert sorted(epochs[e]) == list(range(n))
        ref = epochs[e - e % k]
        assert all(np.array_equal(epochs[e][i], ref[i]) for i in range(n))
    assert not all(np.array_equal(epochs[0][i], epochs[3][i]) for i in range(n))


def test_refresh_survives_a_broken_off_epoch_and_close_aborts_it(no_leaks):
    prefix = no_leaks / "c"
    with CachedLoader(ArangeDataset, {"n": 40}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(prefix), "update_frequency": 2,
                                     "background_refresh": True}) as loader:
        list(loader)
        for step, _ in enumerate(loader):  # a read epoch that starts the refresh, broken off
            if step == 2:
                break
        assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(40))
        assert loader.epoch_stats[-1].mode == "read" and loader.epoch_stats[-1].generation == 1
        it = iter(loader)  # epoch 3 starts generation 2 in the background; close aborts it
        next(it)
        del it
    assert [p.name for p in prefix.iterdir() if p.name.startswith("gen-")] == ["gen-000001"]


def test_background_refresh_is_on_by_default_when_it_can_be(no_leaks, caplog):
    prefix = str(no_leaks / "c")
    with CachedLoader(ArangeDataset, {"n": 24}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": prefix, "update_frequency": 2}) as loader:
        for _ in range(4):
            assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(24))
        modes = [(s.mode, s.generation) for s in loader.epoch_stats]
    assert modes == [("generate", 0), ("read", 0), ("read", 1), ("read", 1)]


@pytest.mark.parametrize("setting,why", [
    ({"update_frequency": math.inf}, "math.inf"),
    ({"update_frequency": 2, "backend": "memory"}, "memory"),
])
def test_auto_refresh_says_once_why_it_is_off(no_leaks, caplog, setting, why):
    caplog.set_level(logging.INFO, logger="loader")
    with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(no_leaks / "c"), **setting}) as loader:
        for _ in range(3):
            list(loader)
    lines = [r.getMessage() for r in caplog.records if "background refresh is off" in r.getMessage()]
    assert len(lines) == 1 and why in lines[0]


@pytest.mark.parametrize("setting,nb_worker,why", [
    ({"update_frequency": math.inf}, 2, "math.inf"),
    ({"update_frequency": 2, "backend": "memory"}, 2, "memory"),
    ({"update_frequency": 2}, 0, "nb_worker=0"),
])
def test_background_refresh_true_insists(tmp_path, setting, nb_worker, why):
    with pytest.raises(ValueError, match=why):
        CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=nb_worker,
                     cache_setting={"prefix": str(tmp_path / "c"), "background_refresh": True, **setting})


def test_background_refresh_true_without_room_is_an_error(no_leaks):
    from cachestore.errors import BudgetExceededError

    with CachedLoader(ArangeDataset, {"n": 40, "shape": (64, 64)}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": 2,
                                     "background_refresh": True, "disk_budget": "1MiB"}) as loader:
        list(loader)  # generation 0 (about 650 KiB) fits, a second one does not
        with pytest.raises(BudgetExceededError, match="second generation"):
            list(loader)


class _Build:
    """What BackgroundRefresh needs of a GenerationBuild, recording what it is handed."""

    generation, active, in_workers = 1, True, True

    def __init__(self) -> None:
        self.accepted = 0

    def missing(self, positions: np.ndarray) -> np.ndarray:
        return positions

    def write_part(self, positions=None, written=None, here=False):
        from loader.executors import messages as m

        return m.WritePart(shard=None)  # records sent back (nothing is written in this test)

    def accept(self, msg) -> int:
        self.accepted += 1
        return 0


class _Executor:
    nb_worker = 2

    def __init__(self) -> None:
        self.submitted, self.flushes = [], 0

    def submit(self, task) -> None:
        self.submitted.append(task)

    def start_flush(self) -> None:
        self.flushes += 1


def test_a_completed_refresh_has_the_workers_close_their_shards_at_once():
    """Once every chunk is in, the workers close (and sync) their shards in their idle time, so the
    refresh epoch does not wait for it; a flush error is kept for the commit to refuse."""
    from loader.executors import messages as m
    from loader.cache.refresh import BackgroundRefresh

    build, executor = _Build(), _Executor()
    refresh = BackgroundRefresh(build, np.arange(6), chunk=3, nb_worker=2)
    refresh.pump(executor)
    assert len(executor.submitted) == 2 and executor.flushes == 0, "chunks in flight: nothing to flush yet"
    for task in executor.submitted:
        assert refresh.handle(m.BatchDone(task.epoch, task.seq, task.part, 0, None))
        refresh.pump(executor)
    assert refresh.done and executor.flushes == 1
    refresh.pump(executor)
    assert executor.flushes == 1, "asked once"
    assert refresh.handle(m.ShardFlushed(0)) and refresh.handle(m.ShardFlushed(1, error="OSError: disk full"))
    assert refresh.flush_errors == ["OSError: disk full"]


def test_the_last_epoch_of_a_generation_commits_the_refresh_as_it_ends(no_leaks):
    """Every chunk of generation 1 is handed out in epoch 1 (8 samples, 8 chunks in flight): epoch 2, the last of
    generation 0, commits it in the `next()` that ends it, so epoch 3's first batch waits only for its reads.
    Generation 0 goes at epoch 3 (the loop might have gone back to one of its epochs: see
    tests/loader/test_accidents.py, ``set_epoch``)."""
    prefix = no_leaks / "c"
    gens = lambda: sorted(p.name for p in prefix.iterdir() if p.name.startswith("gen-"))  # noqa: E731
    with CachedLoader(ArangeDataset, {"n": 8, "augment": True}, batch_size=4, nb_worker=2, seed=1,
                      cache_setting={"prefix": str(prefix), "update_frequency": 3,
                                     "background_refresh": True}) as loader:
        epochs = [served(loader) for _ in range(2)]
        assert gens() == ["gen-000000"]
        it = iter(loader)
        epochs.append(served_from(it, 2))
        assert gens() == ["gen-000000"], "read while its last batch is in the loop"
        with pytest.raises(StopIteration):
            next(it)
        assert gens() == ["gen-000000", "gen-000001"], "committed as epoch 2 ended; generation 0 kept"
        epochs.append(served(loader))
        assert gens() == ["gen-000001"], "pruned at generation 1's first epoch"
        stats = loader.epoch_stats
    assert [s.mode for s in stats] == ["generate", "read", "read", "read"]
    assert [s.generation for s in stats] == [0, 0, 0, 1]
    assert all(sorted(e) == list(range(8)) for e in epochs)
    assert not all(np.array_equal(epochs[0][i], epochs[3][i]) for i in range(8)), "epoch 3 reads the refresh"


def served_from(it, batches: int) -> dict[int, np.ndarray]:
    """The samples of the next `batches` batches of the epoch `it` iterates."""
    out = {}
    for _ in range(batches):
        b = next(it)
        out.update({y: np.array(x) for y, x in zip(b["y"].tolist(), b["x"])})
    return out
