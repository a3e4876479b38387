"""Bad settings fail at construction with a ValueError naming the key."""

from __future__ import annotations

import math

import pytest

from loader import CachedLoader

from .datasets import ArangeDataset


@pytest.mark.parametrize("kwargs,key", [
    ({"cache_setting": {"prefix": "x", "update_frequency": 1}}, "update_frequency"),
    ({"cache_setting": {"prefix": "x", "update_frequency": 2.5}}, "update_frequency"),
    ({"cache_setting": {"update_frequency": 3}}, "prefix"),
    ({"cache_setting": {"prefix": "x", "backend": "tape"}}, "backend"),
    ({"cache_setting": {"prefix": "x", "colour": "red"}}, "colour"),
    ({"cache_setting": {"prefix": "x", "on_budget_exceeded": "panic"}}, "on_budget_exceeded"),
    ({"cache_setting": {"prefix": "x", "disk_budget": "lots"}}, "disk_budget"),
    ({"cache_setting": {"prefix": "x", "compression": "gzip"}}, "compression"),
    ({"batch_size": 0}, "batch_size"),
    ({"nb_worker": -1}, "nb_worker"),
    ({"nb_worker": 2, "gpu_indices": [0]}, "gpu_indices"),
    ({"max_queue_size": 0}, "max_queue_size"),
])
def test_bad_settings_name_the_key(tmp_path, kwargs, key):
    if "cache_setting" in kwargs and "prefix" in kwargs["cache_setting"]:
        kwargs["cache_setting"]["prefix"] = str(tmp_path / "c")
    with pytest.raises(ValueError, match=key):
        CachedLoader(ArangeDataset, {"n": 4}, **{"batch_size": 2, "nb_worker": 0, **kwargs})


def test_dataset_kwargs_alias_and_inf(tmp_path):
    with CachedLoader(ArangeDataset, dataset_kwargs={"n": 6}, batch_size=3, nb_worker=0,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": math.inf}) as loader:
        assert len(loader) == 2
    with pytest.raises(ValueError, match="dataset_kwargs"):
        CachedLoader(ArangeDataset, {"n": 6}, dataset_kwargs={"n": 6})
