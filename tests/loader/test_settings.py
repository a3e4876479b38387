"""Bad settings fail at construction with a ValueError naming the key."""

from __future__ import annotations

import dataclasses
import inspect
import math

import pytest

from loader import CachedLoader
from loader.arguments import Arguments

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
    ({"nb_worker": 2, "start_method": "thread"}, "start_method"),
    ({"nb_worker": 2, "multiprocessing_context": "auto"}, "multiprocessing_context"),
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


@pytest.mark.parametrize("key", ["verify", "background_refresh", "allow_pickle"])
@pytest.mark.parametrize("value", ["no", "false", "False", "True", 0, 1, None, 1.0])
def test_boolean_settings_accept_booleans_only(tmp_path, key, value):
    # bool("no") is True: a string (or an int) must be refused, not read as a truth value.
    with pytest.raises(ValueError, match=key) as info:
        CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, nb_worker=0,
                     cache_setting={"prefix": str(tmp_path / "c"), key: value})
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("value", [True, False])
def test_boolean_settings_take_true_and_false(tmp_path, value):
    from loader.settings import CacheSettings

    setting = {"prefix": str(tmp_path / "c"), "verify": value, "background_refresh": value, "allow_pickle": value}
    parsed = CacheSettings.parse(setting)
    assert (parsed.verify, parsed.background_refresh, parsed.allow_pickle) == (value, value, value)
    defaults = CacheSettings.parse({"prefix": str(tmp_path / "c")})
    assert (defaults.verify, defaults.background_refresh, defaults.allow_pickle) == (True, "auto", False)


@pytest.mark.parametrize("name, value", [("batch_size", 64), ("read_transform", lambda s, rng: s),
                                         ("worker_init_fn", print), ("shuffle", False)])
def test_settings_are_fixed_once_built(name, value):
    # An assignment would otherwise be taken and ignored by the running loader.
    with CachedLoader(ArangeDataset(8), batch_size=4, nb_worker=0) as loader:
        with pytest.raises(AttributeError, match=f"{name} is a setting of this loader"):
            setattr(loader, name, value)


def test_every_constructor_argument_flows_into_the_arguments_by_its_name():
    # The constructor hands each argument to Arguments by name: the two lists are one.
    params = [p.name for p in inspect.signature(CachedLoader).parameters.values()
              if p.kind is not inspect.Parameter.VAR_KEYWORD]
    assert [f.name for f in dataclasses.fields(Arguments)] == params
