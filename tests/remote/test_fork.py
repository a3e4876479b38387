"""A remote store's reader in worker processes: forked ones refuse it with an error naming spawn (the
client's runtime does not survive a fork), spawned ones read it, and CachedLoader spawns its own."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
from torch.utils.data import DataLoader

from cachestore.remote import RemoteForkError, open_remote
from loader import CachedLoader

from .conftest import make_store

pytestmark = pytest.mark.timeout(150)


@pytest.fixture
def reader(tmp_path, s3_env, remote_url):
    """A published generation's reader, used in this process (as a user looks at a sample first)."""
    store = make_store(tmp_path / "local", n=24, shape=(4,))
    open_remote(remote_url, local=store).publish(store).wait()
    with open_remote(remote_url).reader() as reader:
        assert int(reader[0]["y"]) == 0
        yield reader


def _ids(batches):
    return sorted(int(y) for batch in batches for y in batch["y"])


def test_torch_forked_workers_refuse_a_used_remote_reader_naming_spawn(reader):
    loader = DataLoader(reader, batch_size=4, num_workers=2, multiprocessing_context=mp.get_context("fork"),
                        timeout=60)
    with pytest.raises(RemoteForkError, match="spawn"):
        _ids(loader)


def test_torch_spawned_workers_read_a_remote_reader(reader):
    loader = DataLoader(reader, batch_size=4, num_workers=2, multiprocessing_context="spawn", timeout=60)
    assert _ids(loader) == list(range(24))


def test_cached_loader_workers_read_a_remote_reader(reader):
    with CachedLoader(reader, batch_size=4, num_workers=2, shuffle=False, timeout=60) as loader:
        batches = list(loader)
        assert _ids(batches) == list(range(24))
        assert all(np.array_equal(b["x"][0], reader[int(b["y"][0])]["x"]) for b in batches)
