"""Nothing is left behind: no temp, staging or lock files on disk; no arrays in RAM after close."""

from __future__ import annotations

import gc
import os
import weakref

import pytest

from .helpers import check_generation, fixed_sample, leftovers, store_files, variable_sample, write_generation

SAMPLES = {"fixed": fixed_sample, "variable": variable_sample}


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("kind", list(SAMPLES))
def test_commit_leaves_nothing_behind(make_store, disk_backend, store_path, kind, compression):
    store = make_store(disk_backend, compression=compression)
    write_generation(store, 0, 10, SAMPLES[kind])
    assert sorted(os.listdir(store_path)) == ["gen-000000", "store.json"]
    assert leftovers(store_path) == []
    reader = store.reader()
    check_generation(reader, 0, 10, SAMPLES[kind])
    reader.close()
    store.close()
    assert leftovers(store_path) == []  # readers and close add no lock file either


def test_abort_leaves_nothing_behind(disk_store, store_path):
    write_generation(disk_store, 0, 4)
    before = store_files(store_path)
    writer = disk_store.writer(1, 4)
    writer.put(0, fixed_sample(1, 0))
    writer.put(2, fixed_sample(1, 2))
    assert leftovers(store_path)  # the staging area and the lock exist while it writes...
    writer.abort()
    assert store_files(store_path) == before  # ...and are gone with the abort
    with pytest.raises(ValueError):
        with disk_store.writer(1, 4) as writer:
            writer.put(0, fixed_sample(1, 0))
            raise ValueError("the dataset failed")
    assert store_files(store_path) == before


def test_shard_writers_leave_nothing_behind(disk_store, store_path):
    # Several shard writers in one process (as threaded workers would use them), then commit.
    with disk_store.writer(0, 12) as writer:
        spec = writer.shard_spec()
        shards = [spec.open(f"worker-{k}") for k in range(3)]
        for i in range(12):
            shards[i % 3].put(i, fixed_sample(0, i))
        for shard in shards:
            shard.close()
    assert leftovers(store_path) == []
    check_generation(disk_store.reader(), 0, 12)


def test_prune_leaves_nothing_behind(disk_store, store_path):
    for g in range(3):
        write_generation(disk_store, g, 3)
    disk_store.prune(keep=0)
    assert os.listdir(store_path) == ["store.json"]


def test_memory_store_frees_arrays_on_close(make_store):
    store = make_store("memory")
    write_generation(store, 0, 8)  # stored in columns
    write_generation(store, 1, 8, variable_sample)  # stored per sample
    reader = store.reader(0)
    column = weakref.ref(reader.data.columns[0])
    records = store.reader(1)
    leaf = weakref.ref(records.data.samples[3][1][0])
    view = reader.get(2, copy=False)  # a zero-copy view of the column
    store.close()
    gc.collect()
    assert column() is not None and leaf() is not None  # readers still use them
    check_generation(reader, 0, 8)
    check_generation(records, 1, 8, variable_sample)
    del reader, records
    gc.collect()
    assert leaf() is None
    assert column() is not None  # the view handed out keeps its column...
    del view
    gc.collect()
    assert column() is None  # ...and nothing else does


def test_memory_store_frees_pruned_generations(make_store):
    store = make_store("memory")
    write_generation(store, 0, 4)
    write_generation(store, 1, 4)
    old = weakref.ref(store.reader(0).data.columns[0])
    new = weakref.ref(store.reader(1).data.columns[0])
    gc.collect()
    assert old() is not None and new() is not None  # the store itself holds its generations
    store.prune(keep=1)
    gc.collect()
    assert old() is None and new() is not None
    store.close()
    gc.collect()
    assert new() is None


def test_a_writer_does_not_commit_into_a_prefix_made_again_as_another_backend(tmp_path):
    # The prefix removed (rm -rf) while an lmdb writer wrote, and made again by another process as a
    # memmap store: the lmdb generation would be unreadable there.
    import shutil

    import numpy as np

    from cachestore import CacheStoreError, open_store

    store = open_store(tmp_path / "s", "lmdb")
    writer = store.writer(0, num_samples=1)
    writer.put(0, {"x": np.zeros(2)})
    shutil.rmtree(tmp_path / "s")
    open_store(tmp_path / "s").close()  # memmap, the default
    with pytest.raises(CacheStoreError, match="now holds a memmap store"):
        writer.commit()
    store.close()
