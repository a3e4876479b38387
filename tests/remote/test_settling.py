"""A fetched generation is installed before its files are fsynced, marked with the boot; a restart
before they settle makes it damage, fetched again (cachestore/backends/settling.py)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from cachestore import CorruptSampleError, open_store
from cachestore.backends import settling
from cachestore.remote import open_remote

from .conftest import make_store, same

pytest.importorskip("obstore")
#: The mark dates a fetch by the boot; where the system names none, a fetch syncs first (the last test).
dated = pytest.mark.skipif(settling.boot_id() is None, reason="this system names no boot (/proc/sys/kernel/random/boot_id)")


@pytest.fixture
def published(tmp_path):
    local = make_store(tmp_path / "a", n=20)
    url = f"file://{tmp_path / 'shared'}"
    open_remote(url, local=local).publish(local, background=False).wait()
    return local, url


@pytest.fixture
def unsettled(monkeypatch):
    """Fetches leave their mark: the settling thread is not started (its gen dirs are listed instead)."""
    later: list[Path] = []
    monkeypatch.setattr(settling, "settle_later", later.append)
    return later


def _fetch(url, path, fingerprint):
    store = open_store(path, fingerprint=fingerprint)
    return store, open_remote(url, local=store).fetch(store)


def _same_samples(a, b, n=20):
    ra, rb = a.reader(), b.reader()
    assert len(rb) == n and all(same(ra[i], rb[i]) for i in range(n))


@dated
def test_a_fetch_installs_before_syncing_then_settles(tmp_path, published, unsettled, monkeypatch):
    local, url = published
    synced = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (synced.append(os.readlink(f"/proc/self/fd/{fd}")), real(fd)))
    other, info = _fetch(url, tmp_path / "b", local.fingerprint)
    assert [p for p in synced if p.endswith(".bin") or p.endswith(".npy")] == []  # only the mark and directories
    gen_dir = Path(info.path)
    assert unsettled == [gen_dir]
    assert (gen_dir / settling.UNSYNCED).read_text() == settling.boot_id()
    assert [(g.id, g.committed) for g in other.generations()] == [(0, True)]
    _same_samples(local, other)
    settling.settle(gen_dir)
    assert not (gen_dir / settling.UNSYNCED).exists()
    assert other.verify() == []


@dated
def test_the_settling_thread_removes_the_mark(tmp_path, published, monkeypatch):
    local, url = published
    threads = []
    real = settling.settle_later
    monkeypatch.setattr(settling, "settle_later", lambda gen_dir: threads.append(real(gen_dir)))
    _, info = _fetch(url, tmp_path / "b", local.fingerprint)
    (thread,) = threads
    thread.join(30)
    assert not thread.is_alive()
    assert not (Path(info.path) / settling.UNSYNCED).exists()


@dated
def test_a_generation_fetched_before_a_restart_is_damage_and_fetched_again(tmp_path, published, unsettled,
                                                                          monkeypatch):
    local, url = published
    other, info = _fetch(url, tmp_path / "b", local.fingerprint)
    monkeypatch.setattr(settling, "boot_id", lambda: "a-later-boot")  # the machine restarted
    (gen,) = other.generations()
    assert not gen.committed and "restarted since" in gen.damaged
    with pytest.raises(CorruptSampleError, match="restarted since"):
        other.reader(0)
    again = open_remote(url, local=other).fetch(other)  # the damaged one is replaced
    assert again.committed and (Path(again.path) / settling.UNSYNCED).read_text() == "a-later-boot"
    _same_samples(local, other)


@dated
def test_publishing_a_fetched_generation_leaves_the_mark_out(tmp_path, published, unsettled):
    local, url = published
    other, _ = _fetch(url, tmp_path / "b", local.fingerprint)
    onward = f"file://{tmp_path / 'onward'}"
    open_remote(onward, local=other).publish(other, background=False).wait()
    names = [f["name"] for s in json.loads(next((tmp_path / "onward").rglob("000000.json")).read_text())["sets"]
             for f in s["files"]]
    assert settling.UNSYNCED not in names
    third, _ = _fetch(onward, tmp_path / "c", local.fingerprint)
    _same_samples(local, third)


def test_without_a_boot_id_a_fetch_syncs_first_and_leaves_no_mark(tmp_path, published, unsettled, monkeypatch):
    local, url = published
    monkeypatch.setattr(settling, "boot_id", lambda: None)
    synced = []
    real = settling.safefs.fsync_file
    monkeypatch.setattr(settling.safefs, "fsync_file", lambda p: (synced.append(Path(p).name), real(p)))
    other, info = _fetch(url, tmp_path / "b", local.fingerprint)
    assert unsettled == [] and not (Path(info.path) / settling.UNSYNCED).exists()
    assert "col-0.bin" in synced
    assert [(g.id, g.committed) for g in other.generations()] == [(0, True)]
