"""What batches look like and how they travel: collate, devices, shared memory."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from loader import CachedLoader, default_collate
from loader.settings import EpochMode
from loader.executors.process.shm import is_segment_path

from .datasets import ArangeDataset, BigSampleDataset, MixedDataset

pytestmark = pytest.mark.timeout(60)


def _shm_ranges() -> list[tuple[int, int]]:
    ranges = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and is_segment_path(parts[5]):
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                ranges.append((lo, hi))
    return ranges


@pytest.mark.parametrize("cache", [False, True])
def test_batches_are_views_of_shared_memory(tmp_path, cache):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": 5} if cache else None
    with CachedLoader(ArangeDataset, {"n": 16, "shape": (8, 8)}, batch_size=4, nb_worker=2,
                      cache_setting=setting) as loader:
        for epoch in range(2):
            for number, batch in enumerate(loader):
                if number in (0, len(loader) - 1) and loader.epoch_stats[-1].mode != EpochMode.READ:
                    continue  # an epoch's first and last computed batches come in parts, joined (test below)
                address = batch["x"].__array_interface__["data"][0]
                assert any(lo <= address < hi for lo, hi in _shm_ranges()), "batch was not carried in shared memory"
                assert batch["x"].flags.writeable


@pytest.mark.parametrize("cache", [False, True])
def test_the_first_and_last_computed_batches_are_shared_by_the_workers(tmp_path, cache):
    """The loop waits for an epoch's first batch while every worker is idle: each computes a part
    (the last batch too, so the workers' shares stay even)."""
    counter = tmp_path / "calls"
    counter.mkdir()
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": 5} if cache else None
    with CachedLoader(ArangeDataset, {"n": 32, "counter_dir": str(counter)}, batch_size=8, nb_worker=2,
                      shuffle=False, cache_setting=setting) as loader:
        batches = list(loader)
    for k, batch in enumerate(batches):
        np.testing.assert_array_equal(batch["y"], np.arange(8 * k, 8 * k + 8))
        np.testing.assert_array_equal(batch["x"][:, 0], np.arange(8 * k, 8 * k + 8, dtype=np.float32))
    by_worker = [[int(line) for line in path.read_text().split()] for path in counter.iterdir()]
    assert sorted(i for calls in by_worker for i in calls) == list(range(32))
    for lo in (0, 24):  # the first batch and the last: half each
        assert sorted(sum(lo <= i < lo + 8 for i in calls) for calls in by_worker) == [4, 4], by_worker


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_batch_larger_than_slot_arrives(tmp_path, backend):
    with CachedLoader(BigSampleDataset, {"n": 6, "mib": 2.0}, batch_size=3, nb_worker=2, shuffle=False,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 3,
                                     "backend": backend}) as loader:
        for _ in range(2):
            seen = []
            for batch in loader:
                assert batch["x"].nbytes > 4 << 20
                for y, x in zip(batch["y"].tolist(), batch["x"]):
                    assert (x == y).all()
                    seen.append(y)
            assert seen == list(range(6))


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_default_collate_keeps_kinds(tmp_path, nb_worker):
    with CachedLoader(MixedDataset, {"n": 6}, batch_size=4, nb_worker=nb_worker, shuffle=False,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for _ in range(2):
            batch = next(iter(loader))
            assert isinstance(batch["img"], np.ndarray) and batch["img"].shape == (4, 2, 3)
            assert isinstance(batch["t"], torch.Tensor) and batch["t"].shape == (4, 3)
            assert batch["pair"][0].tolist() == [0, 1, 2, 3] and batch["pair"][0].dtype == np.int64
            assert batch["pair"][1].dtype == np.float64
            assert batch["flag"].tolist() == [True, False, True, False]
            assert batch["name"] == ["s0", "s1", "s2", "s3"]


def test_default_collate_function():
    batch = default_collate([{"a": np.zeros(2), "b": (1, "x")}, {"a": np.ones(2), "b": (2, "y")}])
    assert batch["a"].shape == (2, 2)
    assert batch["b"][0].tolist() == [1, 2] and batch["b"][1] == ["x", "y"]


def test_namedtuple_samples_collate_into_a_namedtuple_of_batches():
    from .datasets import Pair

    samples = [Pair(np.full(2, i, np.float32), i) for i in range(3)]
    batch = default_collate(samples)
    theirs = torch.utils.data.default_collate([Pair(torch.from_numpy(x), y) for x, y in samples])
    assert type(batch) is type(theirs) is Pair
    assert batch.x.shape == tuple(theirs.x.shape) == (3, 2) and batch.y.tolist() == theirs.y.tolist() == [0, 1, 2]


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_a_namedtuple_dataset_serves_namedtuples_of_tensors(nb_worker):
    from .datasets import NamedTupleDataset, Pair

    with CachedLoader(NamedTupleDataset(6), batch_size=4, nb_worker=nb_worker, shuffle=False, device="cpu") as loader:
        batches = list(loader)
    assert [type(b) for b in batches] == [Pair, Pair]
    assert all(isinstance(b.x, torch.Tensor) and isinstance(b.y, torch.Tensor) for b in batches)
    assert torch.cat([b.y for b in batches]).tolist() == list(range(6))


def test_custom_collate_fn_and_device(tmp_path):
    def collate(samples):  # noqa: ANN001 - a plain function pickles by reference
        return [s["y"] for s in samples]

    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0, shuffle=False,
                      collate_fn=collate) as loader:
        assert list(loader) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=2, shuffle=False, device="cpu",
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for _ in range(2):
            batch = next(iter(loader))
            assert isinstance(batch["x"], torch.Tensor) and batch["x"].device.type == "cpu"
            assert batch["y"].tolist() == [0, 1, 2, 3]


def test_pin_memory_without_cuda_still_delivers():
    with CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, nb_worker=1, shuffle=False, pin_memory=True) as loader:
        batches = list(loader)
    assert all(isinstance(b["x"], torch.Tensor) for b in batches)


def test_threads_and_minibatches(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 30}, batch_size=8, nb_worker=2, use_threading=True, seed=0,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for _ in range(2):
            assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(30))
    with CachedLoader(ArangeDataset, {"n": 30}, batch_size=8, nb_worker=2, max_minibatch_length=3,
                      shuffle=False) as loader:
        batches = list(loader)
        assert [len(b["y"]) for b in batches] == [8, 8, 8, 6]
        assert [y for b in batches for y in b["y"].tolist()] == list(range(30))
        assert all((b["x"][:, 0] == b["y"]).all() for b in batches)


def test_prefetch_time_fills_queue_first():
    with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=2, prefetch_time=5.0) as loader:
        assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(12))
