"""No name the store owns is ever followed: a symlink planted there never gets its target written.

Every test points a store-owned name at a sentinel outside the store, does what
a user would (write, prune, inspect, read), and checks the sentinel byte for byte.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from cachestore import CacheStoreError, open_store
from cachestore.cli import main
from cachestore.guard import safefs
from cachestore.guard.locking import lock_holder
from loader.epochs.windows import DiskWindow

from .helpers import check_generation, fixed_sample, write_generation

CONTENT = b"a user's precious file\n"


@pytest.fixture
def sentinel(tmp_path) -> Path:
    path = tmp_path / "outside" / "precious.txt"
    path.parent.mkdir()
    path.write_bytes(CONTENT)
    return path


def intact(sentinel: Path) -> bool:
    return not sentinel.is_symlink() and sentinel.read_bytes() == CONTENT


def test_lock_symlink_is_never_written_through(disk_backend, store_path, sentinel, capsys):
    store = open_store(store_path, disk_backend)
    write_generation(store, 0, 4)
    lock = Path(store_path) / "writer.lock"
    lock.symlink_to(sentinel)
    assert lock_holder(store_path) is None  # a link is nobody's lock

    assert main(["inspect", store_path]) == 0
    assert main(["prune", store_path, "--keep", "0"]) == 0, capsys.readouterr().err
    assert intact(sentinel)
    assert not os.path.lexists(lock)  # the link itself went with the prune

    lock.symlink_to(sentinel)
    write_generation(store, 1, 4)  # a writer takes the lock without writing its pid into the target
    assert intact(sentinel)
    assert not os.path.lexists(lock)
    check_generation(store.reader(), 1, 4)
    store.close()


def test_store_json_symlink_is_refused(disk_backend, store_path, sentinel, capsys):
    write_generation(open_store(store_path, disk_backend), 0, 2)
    meta = Path(store_path) / "store.json"
    sentinel.write_bytes(meta.read_bytes())  # a valid document: following it would "work"
    content = sentinel.read_bytes()
    meta.unlink()
    meta.symlink_to(sentinel)
    for readonly in (False, True):
        with pytest.raises(CacheStoreError, match="store.json.*symlink"):
            open_store(store_path, readonly=readonly)
    assert main(["inspect", store_path]) == 1
    assert "symlink" in capsys.readouterr().err
    assert main(["prune", store_path, "--keep", "0"]) == 1
    assert sentinel.read_bytes() == content and meta.is_symlink()
    assert (Path(store_path) / "gen-000000").is_dir()  # nothing pruned through a store we cannot trust


def test_staging_dir_swapped_for_a_symlink_is_not_written_through(disk_backend, store_path, sentinel):
    store = open_store(store_path, disk_backend)
    write_generation(store, 0, 3)
    writer = store.writer(1, 4)
    staging = Path(writer.token.path)
    shutil.rmtree(staging)
    staging.symlink_to(sentinel.parent, target_is_directory=True)
    with pytest.raises(CacheStoreError, match="symlink"):
        writer.put(0, fixed_sample(1, 0))
    with pytest.raises(CacheStoreError, match="symlink"):
        writer.shard_spec().open("worker-0")
    writer.abort()
    assert os.listdir(sentinel.parent) == ["precious.txt"] and intact(sentinel)
    assert not os.path.lexists(staging)  # abort unlinked the link, not the directory it named
    check_generation(store.reader(), 0, 3)
    write_generation(store, 1, 4)  # the lock was released
    store.close()


def test_commit_of_a_staging_dir_swapped_for_a_symlink_is_refused(disk_backend, store_path, sentinel):
    store = open_store(store_path, disk_backend)
    writer = store.writer(0, 2)
    for i in range(2):
        writer.put(i, fixed_sample(0, i))
    writer._shard.close()
    staging = Path(writer.token.path)
    moved = sentinel.parent / "moved"
    staging.rename(moved)
    staging.symlink_to(moved, target_is_directory=True)
    before = sorted(os.listdir(moved))
    with pytest.raises(CacheStoreError, match="symlink"):
        writer.commit()
    assert sorted(os.listdir(moved)) == before  # nothing finalized into the target
    assert not os.path.lexists(Path(store_path) / "gen-000000")
    assert store.latest() is None and intact(sentinel)
    store.close()


def test_temp_file_symlink_is_replaced_not_followed(disk_backend, store_path, sentinel, monkeypatch):
    store = open_store(store_path, disk_backend)
    monkeypatch.setattr(safefs.secrets, "token_hex", lambda n: "0badf00d")
    tmp = Path(store_path) / f".store.json.{os.getpid()}.0badf00d.tmp"
    tmp.symlink_to(sentinel)
    store.backend.write_meta({**store.meta, "note": "rewritten"})
    assert intact(sentinel)
    assert not os.path.lexists(tmp)
    assert open_store(store_path, readonly=True).meta["note"] == "rewritten"
    store.close()


def test_schema_temp_file_symlink_is_replaced_not_followed(store_path, sentinel):
    store = open_store(store_path, "memmap")
    writer = store.writer(0, 3)
    (Path(writer.token.path) / f".schema-owner-{os.getpid()}.tmp").symlink_to(sentinel)
    for i in range(3):
        writer.put(i, fixed_sample(0, i))
    writer.commit()
    assert intact(sentinel)
    check_generation(store.reader(), 0, 3)
    store.close()


def test_rotation_slot_symlink_is_replaced_not_followed(tmp_path, sentinel):
    window = DiskWindow(str(tmp_path / "prefix"), slots=2)
    try:
        window._file(0).symlink_to(sentinel)
        window.put(0, fixed_sample(0, 7))
        assert intact(sentinel)
        assert window.get(0)["label"] == 7
        window._file(1).symlink_to(sentinel)
        with pytest.raises(CacheStoreError, match="symlink"):
            window.get(1)  # never read through either
    finally:
        window.close()
    assert intact(sentinel)


def test_generation_dir_and_manifest_symlinks_are_never_followed(disk_backend, store_path, sentinel, capsys):
    store = open_store(store_path, disk_backend)
    for g in range(3):
        write_generation(store, g, 4)
    root = Path(store_path)
    (root / "gen-000001" / "manifest.json").unlink()
    (root / "gen-000001" / "manifest.json").symlink_to(sentinel)
    shutil.rmtree(root / "gen-000000")
    (root / "gen-000000").symlink_to(sentinel.parent, target_is_directory=True)
    assert [(g.id, g.committed) for g in store.generations()] == [(0, False), (1, False), (2, True)]
    assert all("symlink" in g.damaged for g in store.generations()[:2])
    for g in (0, 1):
        with pytest.raises(CacheStoreError, match="symlink"):
            store.reader(g)
    write_generation(store, 1, 4)  # the writer replaces the link, not what it points at
    check_generation(store.reader(1), 1, 4)
    assert main(["prune", store_path, "--keep", "5"]) == 0, capsys.readouterr().err
    assert not os.path.lexists(root / "gen-000000")
    assert os.listdir(sentinel.parent) == ["precious.txt"] and intact(sentinel)
    store.close()
