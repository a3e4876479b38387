"""A stream's generations on the object store: published at their commit, fetched by the next job, which
serves them from its first epoch without iterating the stream."""

from __future__ import annotations

import pytest

from cachestore.remote import open_remote
from loader import CachedLoader
from tests.loader.streams.stream_datasets import Counting, iterations

from .conftest import options

pytestmark = pytest.mark.timeout(180)


def _loader(prefix, remote_url, server, log, n=48, workers=0, **cache):
    setting = {"prefix": str(prefix), "remote": remote_url, "storage_options": options(server),
               "fingerprint": "counting-remote", **cache}
    return CachedLoader(Counting(n, str(log)), batch_size=4, num_workers=workers, seed=3, timeout=60,
                        cache_setting=setting)


def _served(loader):
    return sorted(int(i) for batch in loader for i in batch["i"])


def test_a_second_job_serves_a_fetched_stream_generation_in_its_first_epoch(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "log-a") as first:
        assert _served(first) == list(range(48))
    with _loader(tmp_path / "b", remote_url, weed, tmp_path / "log-b") as second:
        batches = iter(second)
        served = sorted(int(i) for batch in batches for i in batch["i"])
        assert served == list(range(48)), "epoch 0 serves the fetched generation"
        assert len(second) == 12
        assert second.epoch_stats[-1].extra.get("fetched") == 0
        assert _served(second) == list(range(48))
    assert iterations(str(tmp_path / "log-b")) == 0, "the stream was never iterated"


def test_a_job_of_one_epoch_publishes_its_stream_generation(tmp_path, weed, remote_url):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "log-a") as loader:
        assert _served(loader) == list(range(48))
    assert open_remote(remote_url, options(weed), local=loader.store).generation_ids() == [0]


@pytest.mark.parametrize("refresh", [False, True], ids=["in-its-epoch", "background"])
def test_each_stream_generation_is_published_at_its_commit(tmp_path, weed, remote_url, refresh):
    with _loader(tmp_path / "a", remote_url, weed, tmp_path / "log-a", workers=2, update_frequency=2,
                 background_refresh=refresh) as loader:
        for _ in range(3):  # generation 1: epoch 2 writes it, or a refresh during epoch 1
            assert _served(loader) == list(range(48))
        modes = [stats.extra.get("stream_refresh") for stats in loader.epoch_stats]
        assert (modes[2] in ("ready", "waited")) == refresh, modes
        store = loader.store
    published = open_remote(remote_url, options(weed), local=store).generation_ids()
    # the newest committed (a refresh may have written generation 2 during epoch 2 as well)
    assert published and published[-1] >= 1 and published[-1] == store.latest(), published
