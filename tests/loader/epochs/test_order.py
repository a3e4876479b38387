"""Shuffle and batching: permutations per epoch, seeds, nearby shuffle, drop_last, len."""

from __future__ import annotations

import numpy as np
import pytest

from loader import CachedLoader

from ..datasets import ArangeDataset

pytestmark = pytest.mark.timeout(60)


def orders(loader, epochs: int) -> list[list[int]]:
    return [[y for batch in loader for y in batch["y"].tolist()] for _ in range(epochs)]


@pytest.mark.parametrize("cache", [False, True])
def test_every_epoch_is_a_new_permutation_and_seed_reproduces(tmp_path, cache):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": 10} if cache else None
    kwargs = dict(batch_size=7, nb_worker=2, seed=42, cache_setting=setting)
    with CachedLoader(ArangeDataset, {"n": 50}, **kwargs) as loader:
        first = orders(loader, 4)
    for order in first:
        assert sorted(order) == list(range(50))
    assert len({tuple(o) for o in first}) == 4, "cached epochs must be reshuffled too"
    setting2 = {"prefix": str(tmp_path / "c2"), "update_frequency": 10} if cache else None
    with CachedLoader(ArangeDataset, {"n": 50}, **{**kwargs, "cache_setting": setting2}) as loader:
        assert orders(loader, 4) == first
    with CachedLoader(ArangeDataset, {"n": 50}, batch_size=7, nb_worker=0, seed=43) as loader:
        assert orders(loader, 1)[0] != first[0]


def test_shuffle_false_gives_index_order(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 23}, batch_size=5, nb_worker=2, shuffle=False,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for order in orders(loader, 3):
            assert order == list(range(23))


def test_nearby_shuffle_keeps_samples_near_their_index():
    window = 5
    with CachedLoader(ArangeDataset, {"n": 200}, batch_size=16, nb_worker=0, nearby_shuffle=window,
                      seed=1) as loader:
        for order in orders(loader, 3):
            assert sorted(order) == list(range(200))
            assert order != list(range(200))
            assert max(abs(pos - idx) for pos, idx in enumerate(order)) < window


@pytest.mark.parametrize("drop_last,expected", [(False, [4, 4, 2]), (True, [4, 4])])
def test_len_and_drop_last(drop_last, expected):
    with CachedLoader(ArangeDataset, {"n": 10}, batch_size=4, nb_worker=1, drop_last=drop_last) as loader:
        sizes = [len(batch["y"]) for batch in loader]
        assert sizes == expected
        assert len(loader) == len(expected)


def test_last_batch_of_one_sample_is_stacked(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 5, "shape": (2, 3)}, batch_size=4, nb_worker=2, shuffle=False,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for _ in range(2):  # generate, then read
            batches = list(loader)
            last = batches[-1]
            assert last["x"].shape == (1, 2, 3)
            assert isinstance(last["y"], np.ndarray) and last["y"].shape == (1,)
            del batches, last
