"""A bucket others write to: what they put there is bounded before it costs memory or disk.

A document larger than a manifest may be is refused from its size (a HEAD), before its bytes
travel; chunks that hold more of an object than it takes are refused before anything is written;
``inspect --verify`` refuses what a pull refuses.
"""

from __future__ import annotations

import os
import tracemalloc

import pytest

from cachestore import open_store
from cachestore.cli import main
from cachestore.remote import RemoteManifestError, layout, open_remote
from cachestore.remote import base as remote_base
from cachestore.remote.errors import RemoteCorruptError

from .conftest import make_store, options
from .test_remote import forge

pytestmark = pytest.mark.timeout(120)


def test_a_huge_manifest_is_refused_before_it_is_fetched(tmp_path, weed, remote_url, monkeypatch):
    local = make_store(tmp_path / "a", n=4)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()
    key = layout.generation_manifest(remote.key, 0)
    huge = b" " * (8 << 20)
    remote.client.put(key, huge)
    monkeypatch.setattr(remote_base, "MAX_DOC_BYTES", 1 << 20)  # as a 1 GiB one against the real 64 MiB
    fresh = open_remote(remote_url, options(weed), local=local)
    tracemalloc.start()
    try:
        with pytest.raises(RemoteManifestError, match=f"{8 << 20} bytes, more than a document"):
            fresh.manifest(0)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 4 << 20, f"{peak} bytes held refusing a document of {8 << 20}"


def test_chunks_repeating_an_object_are_refused_before_anything_is_written(tmp_path, weed, remote_url):
    local = make_store(tmp_path / "a", n=4, records=True)
    remote = open_remote(remote_url, options(weed), local=local)
    remote.publish(local, background=False).wait()

    def repeat(doc):
        entry = doc["sets"][0]["files"][0]
        one = entry["chunks"][0]
        entry["chunks"] = [one] * 300
        entry["size"] = one[2] * 300

    forge(remote, 0, repeat)
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    with pytest.raises(RemoteManifestError, match="a publish never repeats"):
        open_remote(remote_url, options(weed), local=other).fetch(other)
    written = sum(f.stat().st_size for f in (tmp_path / "b").rglob("*") if f.is_file() and f.name != "store.json")
    assert written == 0 and other.latest() is None
    assert not [e for e in os.listdir(tmp_path / "b") if e.startswith(".staging")]


def test_inspect_verify_refuses_what_pull_refuses(tmp_path, s3_env, remote_url, capsys):
    local = make_store(tmp_path / "a", n=4)
    remote = open_remote(remote_url, local=local)
    remote.publish(local, background=False).wait()
    assert main(["inspect", remote_url, "--verify"]) == 0
    forge(remote, 0, lambda doc: doc["sets"][0]["files"][0]["chunks"][0].__setitem__(3, "0" * 16))
    capsys.readouterr()
    other = open_store(tmp_path / "b", fingerprint=local.fingerprint)
    with pytest.raises(RemoteCorruptError, match="checksum"):
        open_remote(remote_url, local=other).fetch(other)
    assert main(["inspect", remote_url, "--verify"]) == 1
    assert "do not match the checksum its manifest records" in capsys.readouterr().out
