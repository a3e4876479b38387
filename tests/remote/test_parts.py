"""Generations made of parts: claims, publishing parts from staging areas, assembling them."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from cachestore import GenerationNotFoundError, open_store
from cachestore.remote import open_remote
from cachestore.remote.parts import conditional_puts, part_range

from .conftest import options, same

FP = {"dataset": "parts"}


def _sample(i):
    if i % 5 == 0:  # a few samples of another structure: records beside the columns
        return {"x": np.full(i % 7 + 1, i, np.float32), "y": i}
    return {"x": np.full((2, 3), i, np.float32), "y": i}


def test_part_range_tiles():
    for n, m in ((10, 3), (7, 7), (100, 1), (5, 8)):
        ranges = [part_range(n, k, m) for k in range(m)]
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))


def test_two_nodes_each_compute_one_part_and_hold_the_whole_generation(tmp_path, weed, remote_url):
    n, m = 47, 2
    stores = [open_store(tmp_path / f"node{k}", fingerprint=FP) for k in range(m)]
    remotes = [open_remote(remote_url, options(weed), local=s) for s in stores]
    writers = [s.writer(0, n) for s in stores]
    computed = []
    for k, (store, remote, w) in enumerate(zip(stores, remotes, writers)):
        claim = remote.claim_part(0, k, m)
        assert claim is not None and remote.claim_part(0, k, m) is None  # claimed once
        start, stop = part_range(n, k, m)
        for i in range(start, stop):
            w.put(i, _sample(i))
            computed.append(i)
        w._shard.close()  # as a loader's workers close their shards before anything is published
        w._shard = None
        remote.publish_part(store, w.token.path, 0, n, k, m)
    assert sorted(computed) == list(range(n))  # each sample computed once across the nodes
    assert remotes[0].generation_ids() == [0]  # the last part completed it
    for k, (store, remote, w) in enumerate(zip(stores, remotes, writers)):
        others = [j for j in range(m) if j != k]
        assert remote.fetch_parts(store, 0, m, into=w.token.path, parts=others) == others
        w.commit()
        reader = store.reader(0)
        assert all(same(reader[i], _sample(i)) for i in range(n))
    # A third node fetches the parted generation like any other, and reads it directly.
    third = open_store(tmp_path / "third", fingerprint=FP)
    open_remote(remote_url, options(weed), local=third).fetch(third)
    assert all(same(third.reader()[i], _sample(i)) for i in range(n))
    direct = open_remote(remote_url, options(weed), local=third).reader(0)
    assert all(same(direct[i], _sample(i)) for i in range(n))
    direct.close()


def test_fetch_parts_waits_for_missing_parts(tmp_path, weed, remote_url):
    store = open_store(tmp_path / "a", fingerprint=FP)
    remote = open_remote(remote_url, options(weed), local=store)
    with store.writer(0, 10) as w:
        for i in range(5):
            w.put(i, _sample(i))
        w._shard.close()
        w._shard = None
        remote.publish_part(store, w.token.path, 0, 10, 0, 2)
        w.abort()
    assert remote.generation_ids() == []
    gens = remote.remote_generations()
    assert [(g.id, g.complete, g.published) for g in gens] == [(0, False, (0,))]
    with pytest.raises(GenerationNotFoundError, match=r"parts \[1\]"):
        remote.fetch_parts(store, 0, 2)


def test_an_incomplete_part_is_not_published(tmp_path, weed, remote_url):
    store = open_store(tmp_path / "a", fingerprint=FP)
    remote = open_remote(remote_url, options(weed), local=store)
    w = store.writer(0, 10)
    w.put(0, _sample(0))
    w._shard.close()
    w._shard = None
    with pytest.raises(Exception, match="incomplete"):
        remote.publish_part(store, w.token.path, 0, 10, 0, 2)
    w.abort()


@pytest.mark.parametrize("conditional", [True, False])
def test_concurrent_claims_have_one_winner(tmp_path, weed, remote_url, conditional):
    store = open_store(tmp_path / "a", fingerprint=FP)
    remotes = [open_remote(remote_url, options(weed, conditional_put=conditional), local=store) for _ in range(4)]
    if conditional:
        assert conditional_puts(remotes[0])  # SeaweedFS honours If-None-Match
    wins, barrier = [], threading.Barrier(4)

    def claim(r):
        barrier.wait(timeout=30)
        if r.claim_part(3, 1, 4, node=f"n{id(r)}") is not None:
            wins.append(r)
    threads = [threading.Thread(target=claim, args=(r,)) for r in remotes]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert len(wins) == 1


def test_a_stale_claim_is_taken_over_once(tmp_path, weed, remote_url):
    store = open_store(tmp_path / "a", fingerprint=FP)
    remote = open_remote(remote_url, options(weed), local=store)
    first = remote.claim_part(0, 0, 2, node="a")
    assert first is not None and first.attempt == 0
    assert remote.claim_part(0, 0, 2, node="b", timeout=3600) is None  # still fresh
    taken = remote.claim_part(0, 0, 2, node="b", timeout=0.0)
    assert taken is not None and taken.attempt == 1
