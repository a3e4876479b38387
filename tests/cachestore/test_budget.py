"""Disk budget: early refusal, a real full disk, allocated (not apparent) sizes."""

from __future__ import annotations

import errno
import os
import re
import shutil

import numpy as np
import pytest

from cachestore import BudgetExceededError, open_store
from cachestore.backends.base import ShardWriter
from cachestore.space.disk import allocated_bytes

from ..fullfs import mounted_tmpfs
from .helpers import check_generation, fixed_sample, leftovers, write_generation

SIZE_RE = r"([\d.]+) (B|KiB|MiB|GiB)"
UNITS = {"B": 1, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30}


def big_sample(generation: int, index: int) -> dict:
    return {"x": np.full(4096, generation * 1000 + index, dtype=np.float32), "y": index}  # 16 KiB


def sizes_in(message: str) -> tuple[float, float]:
    """``(needed, available)`` bytes stated by a projection refusal."""
    needed = re.search(r"needs about " + SIZE_RE, message)
    available = re.search(r"only " + SIZE_RE + " is available", message)
    assert needed and available, message
    return (float(needed[1]) * UNITS[needed[2]], float(available[1]) * UNITS[available[2]])


def test_projected_overrun_is_refused_after_the_first_puts(make_store, store_path, backend):
    store = make_store(backend, disk_budget="1MiB")  # for a generation of about 16 MiB
    puts = 0
    writer = store.writer(0, 1000)
    with pytest.raises(BudgetExceededError) as info:
        for i in range(1000):
            writer.put(i, big_sample(0, i))
            puts += 1
    assert puts < ShardWriter.PROJECT_AFTER_SAMPLES  # early, not at the end
    needed, available = sizes_in(str(info.value))
    assert 15 * 2**20 <= needed <= 18 * 2**20
    assert available == 2**20
    assert isinstance(info.value, OSError)
    # The refusal removed the staging area and released the lock without the caller's help.
    assert writer.state == "aborted"
    assert store.generations() == []
    if backend != "memory":
        assert leftovers(store_path) == []
    write_generation(store, 0, 40, big_sample)  # 640 KiB fits
    check_generation(store.reader(), 0, 40, big_sample)


def test_committed_generations_count_against_the_budget(make_store, backend):
    store = make_store(backend, disk_budget="3MiB")
    write_generation(store, 0, 100, big_sample)  # about 1.6 MiB
    with pytest.raises(BudgetExceededError, match="used by committed generations") as info:
        with store.writer(1, 100) as writer:
            for i in range(100):
                writer.put(i, big_sample(1, i))
    needed, available = sizes_in(str(info.value))
    assert needed > available and available < 1.5 * 2**20
    assert [g.id for g in store.generations()] == [0]
    store.prune(keep=0)
    write_generation(store, 1, 100, big_sample)  # fits once the old generation is gone


def test_budget_is_enforced_on_every_put_without_num_samples(make_store, store_path, backend):
    # No num_samples: nothing to project from. Before, 25 MiB went into a 200 kB budget and committed.
    store = make_store(backend, disk_budget=200_000)
    write_generation(store, 0, 2, big_sample)
    puts = 0
    with pytest.raises(BudgetExceededError, match="over the .* available") as info:
        with store.writer(1) as writer:
            for i in range(1600):  # 25 MiB
                writer.put(i, big_sample(1, i))
                puts += 1
    assert puts * 16 * 2**10 <= 200_000, "refused on the put that crossed the budget, not later"
    assert isinstance(info.value, OSError) and writer.state == "aborted"
    assert [(g.id, g.committed) for g in store.generations()] == [(0, True)]
    if backend != "memory":
        assert leftovers(store_path) == []
    check_generation(store.reader(0), 0, 2, big_sample)


def test_a_generation_over_budget_never_commits(make_store, store_path, backend):
    # Three shards each within the budget, together over it: commit measures the whole generation.
    store = make_store(backend, disk_budget=200_000)
    write_generation(store, 0, 2, big_sample)
    writer = store.writer(1)
    spec = writer.shard_spec()
    for k in range(3):
        shard = spec.open(f"shard-{k}")
        for i in range(k * 4, k * 4 + 4):  # 64 KiB per shard, 192 KiB in all
            shard.put(i, big_sample(1, i))
        shard.close()
    with pytest.raises(BudgetExceededError, match="generation 1 .* grew to"):
        writer.commit()
    assert writer.state == "aborted"
    assert [(g.id, g.committed) for g in store.generations()] == [(0, True)]
    if backend != "memory":
        assert leftovers(store_path) == []
    check_generation(store.reader(0), 0, 2, big_sample)
    write_generation(store, 1, 4, big_sample)  # what fits still commits


@pytest.fixture
def tiny_fs(tmp_path):
    """A real 2 MiB tmpfs (we may be root in a container that forbids mounts: then skip)."""
    with mounted_tmpfs(tmp_path / "tiny", "2m") as mount_point:
        yield mount_point


def test_real_enospc_aborts_cleanly(tiny_fs, disk_backend):
    path = tiny_fs / "store"
    store = open_store(path, disk_backend)
    try:
        write_generation(store, 0, 10, big_sample)
        used = shutil.disk_usage(tiny_fs).used
        filler = tiny_fs / "someone-else.bin"
        with pytest.raises(BudgetExceededError, match="disk full|no room"):
            # No num_samples: nothing to project. Once the writer has fixed its budget (the free
            # space), another program takes nearly all of it: the disk itself fills up.
            with store.writer(1) as writer:
                with open(filler, "wb") as f:
                    f.write(b"\0" * (shutil.disk_usage(tiny_fs).free - 48 * 2**10))
                for i in range(64):  # 1 MiB: within the budget, not within what is left
                    writer.put(i, big_sample(1, i))
        filler.unlink()
        assert writer.state == "aborted"
        assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]
        assert shutil.disk_usage(tiny_fs).used <= used  # every byte of the staging area is freed
        check_generation(store.reader(), 0, 10, big_sample)
        assert store.verify() == []
        write_generation(store, 1, 10, big_sample)  # lock released, room back
    finally:
        store.close()


def test_simulated_enospc_aborts_cleanly(make_store, store_path, monkeypatch):
    store = make_store("memmap")
    write_generation(store, 0, 4)
    real_pwrite, calls = os.pwrite, []

    def pwrite(fd, data, offset):
        calls.append(offset)
        if len(calls) > 20:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    with pytest.raises(BudgetExceededError, match="disk full"):
        with store.writer(1, 100) as writer:
            for i in range(100):
                writer.put(i, fixed_sample(1, i))
    monkeypatch.undo()
    assert len(calls) == 21
    assert sorted(os.listdir(store_path)) == ["gen-000000", "store.json"]
    check_generation(store.reader(), 0, 4)


def test_short_writes_are_completed(make_store, monkeypatch):
    # A regular file may take fewer bytes than asked (the disk filling up, a signal): the rest
    # must be written, not dropped.
    store = make_store("memmap")
    real_pwrite = os.pwrite

    def pwrite(fd, data, offset):
        data = memoryview(data).cast("B")
        return real_pwrite(fd, data[:max(1, len(data) // 2)], offset)

    monkeypatch.setattr(os, "pwrite", pwrite)
    write_generation(store, 0, 16, big_sample)
    monkeypatch.undo()
    check_generation(store.reader(), 0, 16, big_sample)
    assert store.verify() == []


def test_allocated_bytes_count_blocks_not_apparent_size(tmp_path):
    sparse = tmp_path / "sparse.bin"
    with open(sparse, "wb") as f:
        f.truncate(2**30)
    if os.stat(sparse).st_blocks * 512 >= 2**20:
        pytest.skip("this file system does not make sparse files")
    assert sparse.stat().st_size == 2**30
    assert allocated_bytes(sparse) < 2**20
    assert allocated_bytes(tmp_path) < 2**20
    with open(sparse, "r+b") as f:
        f.seek(2**29)
        f.write(b"\1" * 2**20)
    assert 2**20 <= allocated_bytes(tmp_path) < 2**20 + 2**18


def test_budget_counts_allocated_bytes_of_sparse_files(disk_store, store_path):
    write_generation(disk_store, 0, 8)
    gen_dir = os.path.join(store_path, "gen-000000")
    with open(os.path.join(gen_dir, "sparse.bin"), "wb") as f:  # 1 GiB apparent, nothing allocated
        f.truncate(2**30)
    if os.stat(os.path.join(gen_dir, "sparse.bin")).st_blocks * 512 >= 2**20:
        pytest.skip("this file system does not make sparse files")
    (info,) = disk_store.generations()
    assert info.nbytes < 2**20
    assert disk_store.usage() < 2**20
    disk_store.disk_budget = 64 * 2**20  # counted by apparent size, generation 0 alone would exceed it
    write_generation(disk_store, 1, 100, big_sample)
    check_generation(disk_store.reader(1), 1, 100, big_sample)
