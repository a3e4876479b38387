"""The remote tier against a real S3 server (SeaweedFS): publish, fetch, direct reads, faults."""

from __future__ import annotations

import json
import os
import pickle
import time

import numpy as np
import pytest

from cachestore import CorruptSampleError, GenerationNotFoundError, ReadableStore, Store, open_store
from cachestore.remote import RemoteError, RemoteManifestError, open_remote
from cachestore.remote import layout, packing
from cachestore.remote.errors import RemoteCorruptError
from cachestore.remote.manifest import encode, load
from cachestore.space.room import sample_limit

from .conftest import KEY, SECRET, make_store, options, same
from .proxy import FaultProxy
from .server import free_port


def _equal_stores(a, b, n):
    ra, rb = a.reader(), b.reader()
    assert len(ra) == len(rb) == n
    assert all(same(ra[i], rb[i]) for i in range(n))


@pytest.mark.parametrize("backend,records", [("memmap", False), ("memmap", True), ("lmdb", False), ("lmdb", True)])
def test_publish_then_fetch_into_another_prefix(tmp_path, weed, remote_url, backend, records):
    local = make_store(tmp_path / "a", n=50, backend=backend, records=records)
    remote = open_remote(remote_url, options(weed), local=local)
    handle = remote.publish(local)
    info = handle.wait(60)
    assert (info.id, info.num_samples, handle.progress()) == (0, 50, 1.0)
    assert remote.generation_ids() == [0]
    other = open_store(tmp_path / "b", backend, fingerprint=local.fingerprint)
    got = open_remote(remote_url, options(weed), local=other).fetch(other)
    assert got.committed and got.id == 0
    _equal_stores(local, other, 50)
    assert not [e for e in os.listdir(tmp_path / "b") if e.startswith(".staging")]
    assert other.verify() == []


def test_a_generation_another_process_fetched_meanwhile_is_taken_as_fetched(tmp_path, weed, remote_url, monkeypatch):
    """The ranks of a node fetch into its one store: one that finds the generation committed by another
    as it opens its staging area returns the committed one instead of failing."""
    from cachestore.remote import fetch as fetching

    local = make_store(tmp_path / "a", n=20)
    open_remote(remote_url, options(weed), local=local).publish(local, background=False).wait()
    other = open_store(tmp_path / "b", "memmap", fingerprint=local.fingerprint)
    remote = open_remote(remote_url, options(weed), local=other)
    manifest = remote.manifest

    def meanwhile(generation):  # the other rank's whole fetch, between the look and the writer
        monkeypatch.setattr(remote, "manifest", manifest)
        fetching.fetch(remote, open_store(tmp_path / "b", "memmap"), 0)
        return manifest(generation)

    monkeypatch.setattr(remote, "manifest", meanwhile)
    got = remote.fetch(other, 0)
    assert got.committed and got.id == 0
    _equal_stores(local, other, 20)
    assert not [e for e in os.listdir(tmp_path / "b") if e.startswith(".staging")]


def test_both_tiers_are_readable_stores_and_only_the_local_one_is_writable(tmp_path, s3_env, remote_url):
    local = make_store(tmp_path / "a", n=4)
    open_remote(remote_url, local=local).publish(local, background=False).wait()
    with open_store(remote_url) as remote:
        assert isinstance(remote, ReadableStore) and not isinstance(remote, Store)
        assert (remote.writable, local.writable) == (False, True)
        assert not hasattr(remote, "writer") and not hasattr(remote, "join")
        assert remote.fingerprint == local.fingerprint and remote.latest() == local.latest() == 0
        assert [g.id for g in remote.generations()] == [0] and remote.verify() == []
    assert not open_store(tmp_path / "a", readonly=True).writable


def test_direct_reader_is_a_map_style_dataset(tmp_path, s3_env, remote_url):
    torch = pytest.importorskip("torch")
    local = make_store(tmp_path / "a", n=40)
    open_remote(remote_url, local=local).publish(local, background=False).wait()
    store = open_store(remote_url)  # the only store under the root; env credentials
    reader = store.reader()
    ref = local.reader()
    assert len(reader) == 40 and all(same(reader[i], ref[i]) for i in range(40))
    idx = [3, 4, 5, 6, 20, 21, 39, 0]
    assert same(reader.get_batch(idx), ref.get_batch(idx))
    out = [np.empty((8, 3, 8, 8), np.float32), np.empty(8, np.int64)]
    reader.get_batch(idx, out=out)
    assert np.array_equal(out[0], ref.get_batch(idx)["x"])
    loader = torch.utils.data.DataLoader(reader, batch_size=10, num_workers=2,
                                         multiprocessing_context="spawn", timeout=60)
    ys = torch.cat([b["y"] for b in loader])
    assert sorted(ys.tolist()) == list(range(40))
    reader.close()


def test_file_remote(tmp_path):
    pytest.importorskip("obstore")
    local = make_store(tmp_path / "a", n=20, records=True)
    url = f"file://{tmp_path / 'shared'}"
    open_remote(url, local=local).publish(local, background=False).wait()
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    open_remote(url, local=other).fetch(other)
    _equal_stores(local, other, 20)


def test_a_remote_reader_bounds_each_sample_by_max_sample_bytes(tmp_path):
    pytest.importorskip("obstore")
    local = make_store(tmp_path / "a", n=20, records=True)
    url = f"file://{tmp_path / 'shared'}"
    open_remote(url, local=local).publish(local, background=False).wait()
    remote = open_store(url, max_sample_bytes="1KiB")
    reader = remote.reader(0)
    assert reader.data.max_sample_bytes == 1024 and pickle.loads(pickle.dumps(remote)).max_sample_bytes == 1024
    reader.close()
    reader = open_store(url).reader(0)  # by default, the bound a local store has without a budget
    default = sample_limit(None)  # (the memory room moves a little as other processes run)
    assert abs(reader.data.max_sample_bytes - default) < default // 4
    reader.close()


def test_interrupted_publish_leaves_nothing_visible_and_is_finished_later(tmp_path, weed, remote_url, monkeypatch):
    monkeypatch.setattr(packing, "PACK_BYTES", 64 << 10)
    monkeypatch.setattr(packing, "CHUNK_BYTES", 16 << 10)
    local = make_store(tmp_path / "a", n=200, shape=(3, 32, 32))  # ~2.4 MB: dozens of objects
    remote = open_remote(remote_url, options(weed, retry_timeout=2.0, max_retries=2), local=local)
    remote.ensure_doc(local)
    stopped = []

    def stop_server(done, total):
        if not stopped:
            stopped.append(done)
            weed.stop()

    try:
        handle = remote.publish(local, progress=stop_server)
        with pytest.raises(RemoteError):
            handle.wait(120)
    finally:
        weed.start()
    fresh = open_remote(remote_url, options(weed), local=local)
    assert fresh.generation_ids() == []  # no manifest: nothing visible
    handle = fresh.publish(local, background=False)
    handle.wait()
    assert handle.skipped_bytes > 0 and fresh.generation_ids() == [0]
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    open_remote(remote_url, options(weed), local=other).fetch(other)
    _equal_stores(local, other, 200)


def test_unreachable_remote_is_a_clear_error_within_the_timeout(tmp_path):
    pytest.importorskip("obstore")
    dead = {"endpoint": f"http://127.0.0.1:{free_port()}", "access_key_id": KEY, "secret_access_key": SECRET}
    t0 = time.monotonic()
    with pytest.raises(RemoteError, match="127.0.0.1"):
        open_remote("s3://bucket/path", dead, start_timeout=2.0, key="memmap-0123456789abcdef")
    assert time.monotonic() - t0 < 30


def test_damaged_object_is_named_and_read_again_once(tmp_path, weed, remote_url, monkeypatch):
    local = make_store(tmp_path / "a", n=30)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()
    (obj,) = remote.manifest(0).sets[0].objects
    key = layout.data_object(remote.key, 0, "whole", obj[0])
    good = remote.client.get(key)
    # A transient flip (one bad read): read again, it matches.
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    r2 = open_remote(remote_url, options(weed), local=other)
    real, flips = r2.client.stream_range, []

    def flaky(k, start, end, piece):
        for buf in real(k, start, end, piece):
            if not flips:
                flips.append(k)
                buf = memoryview(bytes([buf[0] ^ 1]) + bytes(buf[1:]))
            yield buf
    monkeypatch.setattr(r2.client, "stream_range", flaky)
    r2.fetch(other)
    assert flips and other.latest() == 0
    _equal_stores(local, other, 30)
    # An answer that ends early: the chunks it did not bring are read again on their own.
    fourth = open_store(tmp_path / "d", fingerprint=local.fingerprint)
    r4 = open_remote(remote_url, options(weed), local=fourth)
    cut = []

    def short(k, start, end, piece):
        for buf in real(k, start, end, piece):
            cut.append(k)
            yield buf[:len(buf) // 2]
            return
    monkeypatch.setattr(r4.client, "stream_range", short)
    r4.fetch(fourth)
    assert cut and fourth.latest() == 0
    _equal_stores(local, fourth, 30)
    # Damaged for good: a checksum error naming the object, nothing left locally.
    bad = bytearray(good)
    bad[len(bad) // 2] ^= 0xFF
    remote.client.put(key, bytes(bad))
    third = open_store(tmp_path / "c", fingerprint=local.fingerprint)
    with pytest.raises(RemoteCorruptError, match=obj[0]) as err:
        open_remote(remote_url, options(weed), local=third).fetch(third)
    assert err.value.key == key
    assert third.latest() is None and not [e for e in os.listdir(tmp_path / "c") if e.startswith(".staging")]


@pytest.mark.parametrize("records", [False, True])
def test_fetch_in_small_chunks_and_requests_checks_every_record_as_it_lands(tmp_path, weed, remote_url, monkeypatch,
                                                                          records):
    # Chunks, objects, requests and the blocks checked as they land all much smaller than a sample's
    # rows, so every boundary falls inside a row; then a sample damaged before it was published (its
    # chunks' checksums match the damage) is refused, naming it, and nothing is left.
    from cachestore.remote import download, verify

    monkeypatch.setattr(packing, "CHUNK_BYTES", 1000)
    monkeypatch.setattr(packing, "PACK_BYTES", 3000)
    monkeypatch.setattr(download, "REQUEST_BYTES", 3000)
    monkeypatch.setattr(download, "PIECE_BYTES", 700)
    monkeypatch.setattr(verify, "LANDING_BYTES", 2000)
    local = make_store(tmp_path / "a", n=40, records=records)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()
    assert len(remote.manifest(0).sets[0].objects) > 2
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    open_remote(remote_url, options(weed), local=other).fetch(other)
    _equal_stores(local, other, 40)
    gen = tmp_path / "a" / "gen-000000"
    data = gen / ("col-0.bin" if not records else next(p.name for p in gen.iterdir() if p.suffix == ".seg"))
    raw = bytearray(data.read_bytes())
    raw[len(raw) * 3 // 4] ^= 0xFF
    os.chmod(data, 0o644)
    data.write_bytes(bytes(raw))
    damaged = open_remote(f"{remote_url.rstrip('/')}-damaged", options(weed), local=local)
    damaged.publish(local, background=False).wait()
    third = open_store(tmp_path / "c", fingerprint=local.fingerprint)
    with pytest.raises(CorruptSampleError, match="fails its checksum"):
        open_remote(f"{remote_url.rstrip('/')}-damaged", options(weed), local=third).fetch(third)
    assert third.latest() is None and not [e for e in os.listdir(tmp_path / "c") if e.startswith(".staging")]


def test_slowdown_and_dropped_connections_are_retried(tmp_path, weed, remote_url):
    proxy = FaultProxy(weed.ports["s3.port"], slowdown_every=3, drop_every=5)
    try:
        via = {**options(weed), "endpoint": f"http://127.0.0.1:{proxy.port}"}
        local = make_store(tmp_path / "a", n=60, records=True)
        remote = open_remote(remote_url, via, local=local)
        remote.publish(local, background=False).wait()
        other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
        open_remote(remote_url, via, local=other).fetch(other)
        _equal_stores(local, other, 60)
        reader = open_remote(remote_url, via, local=other).reader(0)
        assert all(same(reader[i], local.reader()[i]) for i in range(0, 60, 7))
        reader.close()
        assert proxy.slowdowns > 0 and proxy.drops > 0
    finally:
        proxy.close()


def forge(remote, generation, mutate):
    """Rewrite generation `generation`'s manifest with `mutate(doc)` applied (checksum made right)."""
    key = layout.generation_manifest(remote.key, generation)
    doc = json.loads(remote.client.get(key))
    mutate(doc)
    doc.pop("checksum")
    doc.pop("format")
    remote.client.put(key, encode(doc))
    remote._manifests.clear()


@pytest.mark.parametrize("mutate,match", [
    (lambda d: d["sets"][0]["files"][0].update(name="../../escape"), "not an allowed name"),
    (lambda d: d["sets"][0]["files"][0].update(name="/etc/passwd"), "not an allowed name"),
    (lambda d: d["sets"][0]["objects"][0].update(name="../other/pack-00000-0000000000000000.bin"), "allowed name"),
    (lambda d: d["sets"][0]["files"][0]["chunks"][0].__setitem__(1, 1 << 40), "outside object"),
    (lambda d: d["sets"][0]["objects"][0].update(size=d["sets"][0]["objects"][0]["size"] + 10), "bytes on the remote"),
    (lambda d: d["sets"][0]["files"][0].update(size=True), "must be an int"),
    (lambda d: d.update(num_samples=-1), "must be an int"),
    (lambda d: d.update(generation=5), "another store or generation"),
])
def test_malformed_manifest_is_a_clear_error_and_writes_nothing_outside(tmp_path, weed, remote_url, mutate, match):
    local = make_store(tmp_path / "a", n=10)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()
    forge(remote, 0, mutate)
    before = set(os.listdir(tmp_path))
    other = open_store(tmp_path / "b" / "c", fingerprint=local.fingerprint)
    with pytest.raises(RemoteManifestError, match=match):
        open_remote(remote_url, options(weed), local=other).fetch(other)
    assert set(os.listdir(tmp_path)) == before | {"b"}
    assert os.listdir(tmp_path / "b") == ["c"] and other.latest() is None
    assert not [e for e in os.listdir(tmp_path / "b" / "c") if e.startswith(".staging")]


def test_garbage_documents_are_clear_errors():
    with pytest.raises(RemoteManifestError, match="not valid JSON"):
        load(b"\x00garbage", "where", "cachestore-remote-generation")
    with pytest.raises(RemoteManifestError, match="checksum"):
        load(json.dumps({"kind": "cachestore-remote-generation", "format": 1, "checksum": "0"}).encode(), "w",
             "cachestore-remote-generation")
    with pytest.raises(RemoteManifestError, match="more than a manifest"):
        load(b" " * (65 << 20), "w", "cachestore-remote-generation")
    with pytest.raises(RemoteManifestError):
        load(b"[" * 100000, "w", "cachestore-remote-generation")


def test_pickled_leaves_are_never_loaded_from_a_remote_unless_allowed(tmp_path, weed, remote_url):
    store = open_store(tmp_path / "a", fingerprint={"d": "pickle"}, allow_pickle=True)
    with store.writer(0, 3) as w:
        for i in range(3):
            w.put(i, {"obj": {1, 2, i}})  # a set: stored with pickle
    open_remote(remote_url, options(weed), local=store).publish(store, background=False).wait()
    strict = open_store(tmp_path / "b", fingerprint=store.fingerprint)
    with pytest.raises(CorruptSampleError, match="pickled"):
        open_remote(remote_url, options(weed), local=strict).fetch(strict)
    assert strict.latest() is None
    reader = open_remote(remote_url, options(weed), local=strict).reader(0)
    with pytest.raises(CorruptSampleError, match="pickled"):
        reader[0]
    reader.close()
    trusting = open_store(tmp_path / "c", fingerprint=store.fingerprint, allow_pickle=True)
    open_remote(remote_url, options(weed), local=trusting, allow_pickle=True).fetch(trusting)
    assert trusting.reader()[2]["obj"] == {1, 2, 2}


def test_credentials_never_leak(tmp_path, weed, remote_url, caplog):
    caplog.set_level("DEBUG")
    local = make_store(tmp_path / "a", n=8)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()
    reader = remote.reader(0)
    shown = [repr(remote), str(remote), repr(remote.settings), repr(reader), repr(remote.client)]
    blobs = [pickle.dumps(remote), pickle.dumps(remote.settings), pickle.dumps(reader)]
    stored = b"".join(remote.client.get(o.key) for o in remote.client.list_objects(remote.key)
                      if o.key.endswith(".json"))
    for root, _, files in os.walk(tmp_path):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                assert SECRET.encode() not in f.read()
    wrong = options(weed, secret_access_key=SECRET + "-wrong", retry_timeout=1.0)
    with pytest.raises(RemoteError) as err:
        open_remote(remote_url, wrong, local=local).publish(local, background=False).wait()
    texts = shown + [str(err.value), caplog.text]
    for secret in (SECRET, SECRET + "-wrong"):
        assert not any(secret in t for t in texts)
        assert not any(secret.encode() in b for b in blobs + [stored])
    with pytest.raises(TypeError):
        pickle.dumps(remote.client)
    reader.close()
