"""The loader with a remote: fetch instead of compute, publish in the background, an unreachable remote."""

from __future__ import annotations

import logging
import os

import numpy as np
import pytest

from cachestore.remote import open_remote
from loader import CachedLoader
from tests.loader.datasets import ArangeDataset, read_calls

from .conftest import options

pytestmark = pytest.mark.timeout(180)


def _loader(prefix, remote_url, server, calls, n=40, **cache):
    os.makedirs(calls, exist_ok=True)
    setting = {"prefix": str(prefix), "remote": remote_url, "storage_options": options(server),
               "fingerprint": "arange-remote", **cache}
    return CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls)}, batch_size=8, nb_worker=0, seed=3,
                        cache_setting=setting)


def _epoch(loader):
    return {int(y): x.copy() for batch in loader for x, y in zip(batch["x"], batch["y"])}


def test_a_second_job_fetches_instead_of_computing(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls-a") as first:
        served = _epoch(first)
        assert first.epoch_stats[-1].mode.value == "generate"
    assert len(read_calls(str(tmp_path / "calls-a"))) == 40
    assert open_remote(remote_url, options(weed), local=first.store).generation_ids() == [0]  # published by close()
    with _loader(tmp_path / "b", remote_url, weed, tmp_path / "calls-b") as second:
        again = _epoch(second)
        assert second.epoch_stats[-1].extra.get("fetched") == 0
    assert read_calls(str(tmp_path / "calls-b")) == []  # the dataset was never called
    assert sorted(again) == list(range(40))
    assert all(np.array_equal(again[i], served[i]) for i in range(40))


def test_an_unreachable_remote_computes_locally_and_publishes_later(tmp_path, weed, remote_url, caplog):
    dead = {**options(weed), "endpoint": "http://127.0.0.1:9"}  # nothing listens there
    setting = {"prefix": str(tmp_path / "a"), "remote": remote_url, "storage_options": dead,
               "fingerprint": "arange-remote", "start_timeout": 2.0}
    os.makedirs(tmp_path / "calls", exist_ok=True)
    with caplog.at_level(logging.WARNING, logger="loader.cache.remote"):
        with CachedLoader(ArangeDataset, {"n": 20, "counter_dir": str(tmp_path / "calls")}, batch_size=4,
                          nb_worker=0, cache_setting=setting) as loader:
            assert len(_epoch(loader)) == 20
    warnings = [r for r in caplog.records if "cannot be reached" in r.getMessage()]
    assert len(warnings) == 1 and "s3cr3t" not in warnings[0].getMessage()
    # The next run reaches it: what the first computed is published at its start.
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls", n=20) as loader:
        _epoch(loader)
    assert open_remote(remote_url, options(weed), local=loader.store).generation_ids() == [0]


def test_remote_required_fails_within_start_timeout(tmp_path, weed, remote_url):
    dead = {**options(weed), "endpoint": "http://127.0.0.1:9"}
    setting = {"prefix": str(tmp_path / "a"), "remote": remote_url, "storage_options": dead,
               "remote_required": True, "start_timeout": 2.0}
    with pytest.raises(OSError, match="did not answer within 2 s") as info:
        CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=0, cache_setting=setting)
    assert "s3cr3t" not in str(info.value)
