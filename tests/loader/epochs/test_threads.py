"""Cached epochs gathered by threads of the training process (loader/gather_threads.py).

The place is forced through the recorded choice (which place wins is the
machine's business, see test_gather_place.py); these tests check what the
threads serve and what they leave behind.
"""

from __future__ import annotations

import gc
import threading

import numpy as np
import pytest

from loader import CachedLoader
from loader.epochs.reads.threads import THREAD_PREFIX, BatchBuffers

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(120)


def force(loader, place: str) -> None:
    """Later read epochs of the generation just written gather at `place`."""
    generation = loader.epoch_stats[-1].generation
    key = (loader.store.path, generation, loader.batch_size)
    loader._runner.ctx.reads.placement.choices[key] = (place, {})


def gather_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def check(batch) -> list[int]:
    """The labels of `batch`, each sample checked: every element of its x is its label."""
    y = np.asarray(batch["y"])
    x = np.asarray(batch["x"]).reshape(len(y), -1)
    assert np.array_equal(x, np.repeat(y.astype(np.float32)[:, None], x.shape[1], axis=1))
    return y.tolist()


def test_threads_serve_every_sample_once_per_epoch_in_the_sampler_order(no_leaks):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": float("inf")}
    orders = {}
    for place in ("threads", "workers"):
        with CachedLoader(ArangeDataset, {"n": 90, "shape": (32, 32)}, batch_size=8, nb_worker=2, seed=3,
                          cache_setting=setting) as loader:
            list(loader)
            force(loader, place)
            orders[place] = [[y for b in loader for y in check(b)] for _ in range(3)]
            assert all(s.extra["gather"] == place and s.read == 90 for s in loader.epoch_stats[-3:])
    assert orders["threads"] == orders["workers"] and sorted(orders["threads"][0]) == list(range(90))
    assert orders["threads"][0] != orders["threads"][1]
    assert not gather_threads()


def test_batches_held_by_the_loop_stay_intact_and_dropped_ones_are_reused(no_leaks):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": float("inf")}
    with CachedLoader(ArangeDataset, {"n": 64, "shape": (16, 16)}, batch_size=4, nb_worker=2,
                      cache_setting=setting) as loader:
        list(loader)
        force(loader, "threads")
        held = [b for _ in range(2) for b in loader]  # two epochs' batches, all alive at once
        assert sorted(y for b in held for y in check(b)) == sorted(list(range(64)) * 2)
        buffers = loader._runner.ctx.res.threads.buffers
        assert buffers.free_buffers() == 0
        del held
        gc.collect()
        assert buffers.free_buffers() == buffers.keep
        for batch in loader:
            check(batch)
        allocated = buffers.allocated
        for _ in range(2):  # steady epochs take their buffers from the free ones
            for batch in loader:
                check(batch)
        assert buffers.allocated == allocated and buffers.free_buffers() > 0
        force(loader, "workers")
        list(loader)
        assert buffers.free_buffers() == 0, "an epoch without threads lets their buffers go"
    assert not gather_threads()


def test_a_corrupt_record_gathered_by_a_thread_is_recomputed_in_the_training_process(no_leaks):
    prefix, calls = no_leaks / "c", no_leaks / "calls"
    calls.mkdir()
    with CachedLoader(ArangeDataset, {"n": 24, "counter_dir": str(calls)}, batch_size=6, nb_worker=2,
                      cache_setting={"prefix": str(prefix), "update_frequency": float("inf"),
                                     "background_refresh": False}) as loader:
        list(loader)
        force(loader, "threads")
        column = next(prefix.glob("gen-*/col-0.bin"))
        data = bytearray(column.read_bytes())
        data[5 * 16 + 1] ^= 0xFF  # a byte of sample 5's x
        column.write_bytes(bytes(data))
        ys = sorted(y for b in loader for y in check(b))
        assert ys == list(range(24)) and loader.epoch_stats[-1].extra["gather"] == "threads"
        assert len(read_calls(str(calls))) == 24 + 6, "only the batch holding the bad record is recomputed"


def test_a_broken_off_epoch_waits_for_its_gathers_and_close_stops_the_threads(no_leaks):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": float("inf")}
    loader = CachedLoader(ArangeDataset, {"n": 200, "shape": (64, 64)}, batch_size=4, nb_worker=2,
                          cache_setting=setting)
    list(loader)
    force(loader, "threads")
    it = iter(loader)
    check(next(it))
    del it  # broken off with gathers queued ahead
    assert sorted(y for b in loader for y in check(b)) == list(range(200))
    assert gather_threads()
    loader.close()
    assert not gather_threads()


def test_buffers_return_when_the_last_array_of_a_batch_dies():
    buffers = BatchBuffers(keep=2)
    specs = [(np.dtype(np.float32), (4, 8)), (np.dtype(np.int64), (4,))]
    x, y = buffers.arrays(specs)
    x[:] = 1.5
    y[:] = 7
    view = x[1:]
    del x, y
    gc.collect()
    assert buffers.free_buffers() == 0, "a view of the batch still holds its buffer"
    address = view.__array_interface__["data"][0] - view.strides[0]
    del view
    gc.collect()
    assert buffers.free_buffers() == 1
    again, _ = buffers.arrays(specs)
    assert again.__array_interface__["data"][0] == address and buffers.free_buffers() == 0
    others = [buffers.arrays(specs) for _ in range(4)]
    del again, others
    gc.collect()
    assert buffers.free_buffers() == 2, "at most `keep` free buffers are kept"
    buffers.close()
    assert buffers.free_buffers() == 0


def test_a_buffer_coming_back_while_its_pool_is_locked_does_not_deadlock():
    """A garbage collection that an allocation inside ``arrays()`` triggers runs the finalizers
    there, with the lock held by that very thread."""
    buffers = BatchBuffers(keep=2)
    (x,) = buffers.arrays([(np.dtype(np.uint8), (4,))])
    with buffers._lock:
        del x
        gc.collect()
    assert buffers.free_buffers() == 1


def test_a_state_taken_in_a_threaded_epoch_resumes_the_rest_of_it(no_leaks):
    def build():
        return CachedLoader(ArangeDataset, {"n": 60, "shape": (8, 8)}, batch_size=4, nb_worker=2, seed=5,
                            cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": float("inf")})

    with build() as loader:
        list(loader)
        force(loader, "threads")
        it = iter(loader)
        served = [y for _, b in zip(range(5), it) for y in check(b)]
        state = loader.state_dict()
        rest_expected = [y for b in it for y in check(b)]
        assert loader.epoch_stats[-1].extra["gather"] == "threads"
    with build() as resumed:
        resumed.load_state_dict(state)
        rest = [y for b in resumed for y in check(b)]
    assert rest == rest_expected and sorted(served + rest) == list(range(60))


def _stack_collate(samples):
    return {"x": np.stack([s["x"] for s in samples]), "y": np.array([s["y"] for s in samples])}


def test_a_custom_collate_is_never_run_by_the_gather_threads(no_leaks):
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": float("inf")}
    with CachedLoader(ArangeDataset, {"n": 96, "shape": (8, 8)}, batch_size=4, nb_worker=2,
                      collate_fn=_stack_collate, cache_setting=setting) as loader:
        for _ in range(4):
            assert sorted(y for b in loader for y in check(b)) == list(range(96))
        assert "threads" not in loader.epoch_stats[-1].extra.get("gather_costs", {})
        assert loader.epoch_stats[-1].extra["gather"] in ("main", "workers")
    assert not gather_threads()
