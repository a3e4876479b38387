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


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_second_job_fetches_instead_of_computing(tmp_path, weed, remote_url, backend):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls-a", backend=backend) as first:
        served = _epoch(first)
        assert first.epoch_stats[-1].mode.value == "generate"
    assert len(read_calls(str(tmp_path / "calls-a"))) == 40
    assert open_remote(remote_url, options(weed), local=first.store).generation_ids() == [0]  # published by close()
    with _loader(tmp_path / "b", remote_url, weed, tmp_path / "calls-b", backend=backend) as second:
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
    with pytest.raises(OSError, match="did not answer within 2 s") as info:  # the store opens at iter()
        next(iter(CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=0, cache_setting=setting)))
    assert "s3cr3t" not in str(info.value)


def test_a_generation_too_large_for_the_budget_is_read_from_the_remote(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls-a") as first:
        served = _epoch(first)
    with _loader(tmp_path / "b", remote_url, weed, tmp_path / "calls-b", disk_budget=2048) as second:
        again = _epoch(second)
        stats = second.epoch_stats[-1]
        assert stats.extra.get("direct") == 0 and stats.extra.get("gather") == "remote"
        assert stats.extra.get("read_order") == "block"
        assert second.store.generations() == []  # nothing was written locally
    assert read_calls(str(tmp_path / "calls-b")) == []
    assert sorted(again) == list(range(40)) and all(np.array_equal(again[i], served[i]) for i in range(40))


def test_server_stopped_mid_publish_leaves_nothing_visible_and_the_next_run_finishes_it(
        tmp_path, weed, remote_url, monkeypatch, caplog):
    from cachestore.remote import client, packing

    monkeypatch.setattr(packing, "PACK_BYTES", 64 << 10)
    monkeypatch.setattr(packing, "CHUNK_BYTES", 16 << 10)
    put, stopped = client.Client.put, []

    def put_then_stop(self, key, data):
        put(self, key, data)
        if "/data/" in key and not stopped:
            stopped.append(key)
            weed.stop()  # in the publisher's thread, after its first object
    monkeypatch.setattr(client.Client, "put", put_then_stop)
    short = {"retry_timeout": 2.0, "max_retries": 2}
    setting = {"prefix": str(tmp_path / "a"), "remote": remote_url, "storage_options": {**options(weed), **short},
               "fingerprint": "big-remote"}
    try:
        with caplog.at_level(logging.WARNING, logger="loader.cache.remote"):
            with CachedLoader(ArangeDataset, {"n": 200, "shape": (3, 32, 32)}, batch_size=16, nb_worker=0,
                              cache_setting=setting) as loader:
                assert len(_epoch(loader)) == 200
        assert stopped and any("was not published" in r.getMessage() for r in caplog.records)
    finally:
        if weed.proc is None:
            weed.start()
    monkeypatch.setattr(client.Client, "put", put)
    remote = open_remote(remote_url, options(weed), local=loader.store)
    assert remote.generation_ids() == []  # no manifest: nothing visible
    with CachedLoader(ArangeDataset, {"n": 200, "shape": (3, 32, 32)}, batch_size=16, nb_worker=0,
                      cache_setting=setting) as again:
        assert len(_epoch(again)) == 200  # the store opens at the first iter()
        assert again.epoch_stats[0].mode == "read" and again.store.latest() == 0
    assert remote.generation_ids() == [0]  # published by the next run's start, waited for by its close()


@pytest.mark.parametrize("setting, match", [
    ({"remote": "ftp://host/x"}, "remote"),
    ({"remote": 3}, "URL string"),
    ({"remote": "s3://bucket/x", "backend": "memory"}, "memory"),
    ({"remote": "s3://bucket/x", "storage_options": "key=1"}, "storage_options"),
    ({"remote": "s3://bucket/x", "part_timeout": 0}, "part_timeout"),
    ({"remote": "s3://bucket/x", "start_timeout": -1}, "start_timeout"),
    ({"remote": "s3://bucket/x", "remote_required": "yes"}, "remote_required"),
    ({"nb_node": 2}, "go together"),
    ({"nb_node": 2, "node_rank": 2}, "must be <"),
    ({"nb_node": 0, "node_rank": 0}, "nb_node"),
])
def test_remote_settings_are_checked_at_construction(tmp_path, setting, match):
    with pytest.raises(ValueError, match=match):
        CachedLoader(ArangeDataset, {"n": 8}, batch_size=2, nb_worker=0,
                     cache_setting={"prefix": str(tmp_path), **setting})


def test_credentials_stay_out_of_the_settings_and_the_state(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls") as loader:
        _epoch(loader)
        assert "s3cr3t" not in repr(loader.settings) and "s3cr3t" not in repr(loader.cache)
        assert "s3cr3t" not in repr(loader.state_dict())


def test_a_loader_without_a_remote_never_imports_the_remote_tier(tmp_path):
    import subprocess
    import sys

    code = ("import sys; from loader import CachedLoader; from tests.loader.datasets import ArangeDataset; "
            f"l = CachedLoader(ArangeDataset, {{'n': 8}}, batch_size=2, nb_worker=0, "
            f"cache_setting={{'prefix': {str(tmp_path)!r}}}); [b for b in l]; l.close(); "
            "print(sorted(m for m in sys.modules if m.startswith(('obstore', 'cachestore.remote', 'loader.cache.remote'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip().splitlines()[-1] == "[]"


def test_the_remote_keeps_as_many_generations_as_the_local_store(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "calls", n=16, update_frequency=2) as loader:
        for _ in range(6):  # generations 0, 1, 2, each published after its commit
            _epoch(loader)
        assert [g.id for g in loader.store.generations()] == [2]
    assert open_remote(remote_url, options(weed), local=loader.store).generation_ids() == [2]


def test_a_node_of_several_resumes_its_cached_epoch_where_the_state_says(tmp_path):
    dead = {"endpoint": "http://127.0.0.1:9", "access_key_id": "k", "secret_access_key": "s"}

    def node1():  # node 1 of 2, its remote unreachable: it computes everything, then deals the whole dataset
        return CachedLoader(ArangeDataset, {"n": 40}, batch_size=4, nb_worker=0, seed=5, nb_consumer=2,
                            consumer_index=1, cache_setting={"prefix": str(tmp_path), "remote": "s3://bucket/x",
                                                             "storage_options": dead, "start_timeout": 1,
                                                             "nb_node": 2, "node_rank": 1, "fingerprint": "f"})
    with node1() as first:
        assert len([b for b in first]) == 5  # its part, 20 samples, as many as a cached epoch deals it
        batches = iter(first)
        head = [next(batches), next(batches)]
        state = first.state_dict()
        rest = [int(y) for b in batches for y in b["y"]]
    with node1() as again:
        again.load_state_dict(state)
        assert [int(y) for b in again for y in b["y"]] == rest
    assert len(head) + len(rest) // 4 == 5
