"""Worker errors, worker deaths, abandoned loaders: errors surface, nothing hangs or stays."""

from __future__ import annotations

import gc
import multiprocessing as mp
import os
import signal
import time
import traceback
from pathlib import Path

import numpy as np
import pytest

from cachestore import open_store
from loader.errors import WorkerError
from loader import CachedLoader

from ...conftest import kept_partial, leftovers, live_children, my_segments, partials
from ...datasets import ArangeDataset, FailingInit, KillSelfDataset, read_calls

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("cache", [False, True])
def test_getitem_error_reraises_with_index_type_and_traceback(no_leaks, cache):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": 2} if cache else None
    loader = CachedLoader(ArangeDataset, {"n": 40, "fail_at": 17}, batch_size=4, nb_worker=2, cache_setting=setting)
    start = time.monotonic()
    with pytest.raises(KeyError) as info:
        for _ in loader:
            pass
    assert time.monotonic() - start < 20
    # The exception is the dataset's own (its message unchanged); where it happened and the
    # worker's traceback are notes, printed under it.
    assert str(info.value) == repr("sample 17 is broken")
    text = "".join(traceback.format_exception(info.value))
    assert "sample 17" in text and "sample 17 is broken" in text and "Worker traceback" in text
    assert "__getitem__" in text
    # The loader is usable again afterwards (new workers), and close leaves nothing.
    if not cache:
        with pytest.raises(KeyError):
            list(loader)
    loader.close()


def test_constructor_failure_raises_at_construction(no_leaks):
    with pytest.raises(RuntimeError, match="cannot open the dataset files"):
        CachedLoader(FailingInit, {"n": 3}, batch_size=2, nb_worker=2)


@pytest.mark.parametrize("cache", [None, "memmap", "lmdb"])
def test_killed_worker_is_replaced_and_epoch_is_complete(no_leaks, cache):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": 3, "backend": cache} if cache else None
    with CachedLoader(ArangeDataset, {"n": 60, "delay": 0.005}, batch_size=4, nb_worker=2, seed=0,
                      max_queue_size=4, cache_setting=setting) as loader:
        seen: list[int] = []
        values = {}
        for step, batch in enumerate(loader):
            if step == 2:
                os.kill(loader.worker_pids()[0], signal.SIGKILL)
            for y, x in zip(batch["y"].tolist(), batch["x"]):
                seen.append(y)
                values[y] = np.array(x)
        assert sorted(seen) == list(range(60)), "every index exactly once despite the death"
        if cache:
            # The generation written around the death is complete and correct.
            assert loader.epoch_stats[0].committed
            for batch in loader:
                for y, x in zip(batch["y"].tolist(), batch["x"]):
                    assert np.array_equal(x, values[y])
            assert loader.epoch_stats[1].mode == "read"
            assert not loader.store.verify()


def test_repeated_deaths_end_in_clear_error(no_leaks):
    loader = CachedLoader(KillSelfDataset, {"kill_at": 5, "n": 20}, batch_size=4, nb_worker=2,
                          max_worker_restarts=2)
    start = time.monotonic()
    with pytest.raises(WorkerError, match="max_worker_restarts=2"):
        list(loader)
    assert time.monotonic() - start < 60
    loader.close()


def test_break_close_twice_and_gc_leave_nothing(no_leaks):
    prefix = str(no_leaks / "c")
    loader = CachedLoader(ArangeDataset, {"n": 200, "delay": 0.002}, batch_size=4, nb_worker=2,
                          cache_setting={"prefix": prefix, "update_frequency": 2})
    for step, batch in enumerate(loader):
        if step == 3:
            break
    del batch  # a batch still referenced keeps its slot's memory mapped, by design
    assert loader.store.latest() is None, "a broken-off epoch commits nothing"
    loader.close()
    loader.close()
    # What the epoch wrote is kept as a partial generation for the next run (not debris), nothing else.
    assert not leftovers(prefix)
    assert [kept_partial(p) for p in partials(prefix)] == [True]
    # Garbage collection without close().
    loader = CachedLoader(ArangeDataset, {"n": 50}, batch_size=4, nb_worker=2,
                          cache_setting={"prefix": prefix + "2", "update_frequency": 2})
    it = iter(loader)
    next(it)
    assert live_children() and my_segments()
    del it, loader
    gc.collect()
    assert not live_children()
    assert not my_segments()


def _refresh_forever(prefix: str, calls_dir: str, conn) -> None:
    with CachedLoader(ArangeDataset, {"n": 40, "counter_dir": calls_dir}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": prefix, "update_frequency": 2,
                                     "background_refresh": False}) as loader:
        for epoch in range(10):
            for step, _ in enumerate(loader):
                if epoch == 2 and step == 3:
                    conn.send("refreshing")  # mid-way through the second refresh epoch
                    conn.recv()  # never comes: the parent kills us here


def test_process_killed_during_refresh_leaves_previous_generation(no_leaks):
    prefix = str(no_leaks / "c")
    calls_dir = no_leaks / "calls"
    calls_dir.mkdir()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_refresh_forever, args=(prefix, str(calls_dir), child))
    proc.start()
    assert parent.poll(60), "child never reached the refresh epoch"
    assert parent.recv() == "refreshing"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(10)
    # Its workers notice the parent is gone and exit by themselves.
    deadline = time.monotonic() + 15
    while live_children() and time.monotonic() < deadline:
        live_children()[0].wait(timeout=1)
    store = open_store(prefix, readonly=True)
    assert store.latest() == 0
    assert any(not g.committed for g in store.generations()), "the crash left its staging"
    before = len(read_calls(str(calls_dir)))
    with CachedLoader(ArangeDataset, {"n": 40, "counter_dir": str(calls_dir)}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": prefix, "update_frequency": 2,
                                     "background_refresh": False}) as loader:
        assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(40))
        assert loader.epoch_stats[0].mode == "read"
        assert not loader.store.verify()
    assert len(read_calls(str(calls_dir))) == before
    # Staging left by the crash is this producer's partial generation 1: prune keeps it for the next
    # writer of generation 1 to adopt; prune(partial=True) (or a writer of another generation) removes it.
    open_store(prefix).prune()
    assert len(partials(prefix, 1)) == 1
    open_store(prefix).prune(partial=True)
    assert not leftovers(prefix)


def test_inline_getitem_error_is_the_original_exception():
    loader = CachedLoader(ArangeDataset, {"n": 10, "fail_at": 3}, batch_size=4, nb_worker=0, shuffle=False)
    with pytest.raises(KeyError, match="sample 3 is broken") as info:
        list(loader)
    assert any("sample 3" in note for note in info.value.__notes__)
    loader.close()


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_corrupt_cached_sample_is_recomputed(no_leaks, nb_worker):
    prefix = no_leaks / "c"
    calls = no_leaks / "calls"
    calls.mkdir()
    with CachedLoader(ArangeDataset, {"n": 24, "counter_dir": str(calls)}, batch_size=6, nb_worker=nb_worker,
                      cache_setting={"prefix": str(prefix), "update_frequency": 5,
                                     "background_refresh": False}) as loader:
        list(loader)
        column = next(prefix.glob("gen-*/col-0.bin"))
        data = bytearray(column.read_bytes())
        data[5 * 16 + 1] ^= 0xFF  # a byte of sample 5's x
        column.write_bytes(bytes(data))
        ys = sorted(y for b in loader for y in b["y"].tolist())
        assert ys == list(range(24))
        assert len(read_calls(str(calls))) == 24 + 6, "only the batch holding the bad record is recomputed"
