"""A cached loader on a backend plugged in through ``register_backend`` (tests/plain_backend.py): the
loader asks it for its capabilities, as it asks the built-in backends, and serves what it computed."""

from __future__ import annotations

import numpy as np
import pytest

import loader.cache.controller as controller
from cachestore import open_store
from loader import CachedLoader

from ...plain_backend import PlainArange, PlainFilesBackend, PlainStreamingBackend

pytestmark = pytest.mark.timeout(90)


# Spawned workers register the backend from the store's spec before they open it, whether or not they
# have imported the module that registers it (a worker builds its dataset only when it computes).
@pytest.mark.parametrize("start_method", ["auto", "spawn"])
def test_a_registered_backend_serves_a_cached_run(no_leaks, start_method):
    prefix = str(no_leaks / "cache")
    n, k = 24, 2
    with CachedLoader(PlainArange, {"n": n, "augment": True}, batch_size=5, nb_worker=2, seed=1,
                      start_method=start_method,
                      cache_setting={"prefix": prefix, "update_frequency": k, "backend": PlainFilesBackend.name,
                                     "background_refresh": False}) as loader:
        # memmap's stores are shared by a node's ranks; this one says it cannot be written together.
        assert loader.cache.scope == "rank"
        epochs = []
        for _ in range(4):
            served = {}
            for batch in loader:
                for y, x in zip(batch["y"].tolist(), batch["x"]):
                    served[y] = np.array(x)
            assert sorted(served) == list(range(n))
            epochs.append(served)
        assert [s.mode for s in loader.epoch_stats] == ["generate", "read", "generate", "read"]
    for e in (1, 3):
        assert all(np.array_equal(epochs[e][i], epochs[e - 1][i]) for i in range(n)), f"epoch {e} differs"
    assert not all(np.array_equal(epochs[0][i], epochs[2][i]) for i in range(n))
    with open_store(prefix, readonly=True) as store:
        assert store.backend_name == PlainFilesBackend.name
        committed = [g.id for g in store.generations() if g.committed]
        assert committed
        assert store.verify() == []


@pytest.mark.parametrize("backend", [PlainFilesBackend, PlainStreamingBackend])
def test_a_generation_larger_than_memory_streams_where_the_backend_says_it_can(tmp_path, monkeypatch, backend):
    monkeypatch.setattr(controller, "fits", lambda nbytes, fraction=0.5: False)
    with CachedLoader(PlainArange(60, shape=(3, 16, 16)), batch_size=8, nb_worker=0, seed=1,
                      cache_setting={"prefix": str(tmp_path / "c"), "backend": backend.name}) as loader:
        for _ in range(2):
            assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(60))
        gathered = loader.epoch_stats[1].extra.get("gather")
    assert (gathered == "stream") == backend.supports_streaming
