from __future__ import annotations

from cachestore import open_store
from cachestore.remote import open_remote

from .conftest import make_store, options, same


def test_publish_fetch_read(tmp_path, weed, remote_url):
    local = make_store(tmp_path / "a")
    remote = open_remote(remote_url, options(weed), local=local)
    info = remote.publish(local, 0).wait(60)
    assert info.num_samples == 64
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    remote2 = open_remote(remote_url, options(weed), local=other)
    remote2.fetch(other, 0)
    r1, r2 = local.reader(0), other.reader(0)
    assert all(same(r1[i], r2[i]) for i in range(64))
    direct = remote2.reader(0)
    assert all(same(r1[i], direct[i]) for i in range(64))
    assert same(r1.get_batch([5, 6, 7, 1]), direct.get_batch([5, 6, 7, 1]))
    direct.close()
