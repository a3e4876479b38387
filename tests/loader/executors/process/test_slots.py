"""Shared-memory slots: memfds reached through /proc (or files), grown in place, released with their users."""

from __future__ import annotations

import glob
import os

import numpy as np
import pytest

import loader.executors.process.shm as shm
from loader.executors.process.segments import WorkerSegments, write_batch
from loader.executors.process.slots import SlotPool
from loader import CachedLoader

from ...conftest import my_segments
from ...datasets import BigSampleDataset

pytestmark = pytest.mark.timeout(60)

MODES = [pytest.param(True, id="memfd"), pytest.param(False, id="files")]


@pytest.mark.parametrize("memfd", MODES)
def test_slot_grows_in_place_and_the_owner_sees_it(memfd):
    if memfd and not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    pool = SlotPool(2, memfd=memfd)
    worker = WorkerSegments()
    try:
        assert memfd == pool._names[0].startswith("/proc/")
        slot, name, size = pool.acquire()
        small = {"x": np.arange(10, dtype=np.int64)}
        meta = write_batch(worker, slot, name, size, small)
        assert np.array_equal(pool.view(slot, meta)["x"], small["x"])
        big = {"x": np.arange(3 << 18, dtype=np.int64)}  # 6 MiB > the 1 MiB slot
        meta = write_batch(worker, slot, name, size, big)
        assert meta.name == name and meta.size > size
        assert np.array_equal(pool.view(slot, meta)["x"], big["x"])
        # The next task on this slot is told the new size; another worker maps the grown file.
        other = WorkerSegments()
        try:
            meta = write_batch(other, slot, name, pool._sizes[slot], {"x": big["x"][::-1].copy()})
            assert np.array_equal(pool.view(slot, meta)["x"], big["x"][::-1])
        finally:
            other.close()
    finally:
        worker.close()
        pool.close()
    assert not my_segments()
    assert not glob.glob(os.path.join(shm.shm_dir(), pool.prefix + "*"))


def test_memfd_slots_have_no_name_in_dev_shm():
    if not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    pool = SlotPool(3)
    try:
        assert not glob.glob(os.path.join(shm.shm_dir(), f"cachestore-{os.getpid()}-*"))
        assert len(my_segments()) >= 3
    finally:
        pool.close()
    assert not my_segments()


@pytest.mark.parametrize("memfd", MODES)
def test_loader_carries_big_batches_in_either_mode(no_leaks, monkeypatch, memfd):
    if memfd and not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    monkeypatch.setattr(shm, "USE_MEMFD", memfd)
    with CachedLoader(BigSampleDataset, {"n": 6, "mib": 2.0}, batch_size=3, nb_worker=2, shuffle=False) as loader:
        for _ in range(2):
            seen = []
            for batch in loader:
                for y, x in zip(batch["y"].tolist(), batch["x"]):
                    assert (x == y).all()
                    seen.append(y)
            assert seen == list(range(6))
        assert loader._res.slots.memfd == memfd


@pytest.mark.parametrize("pid", ["²", "٣"])
def test_the_sweep_of_dead_segments_leaves_names_it_did_not_make(pid):
    # /dev/shm is anyone's to write: a name with a Unicode digit is nobody's segment (int() failed on
    # "²", and read "٣" as pid 3).
    path = os.path.join(shm._SHM_DIR, f"cachestore-{pid}-{os.getpid()}-not-ours")
    with open(path, "w") as f:
        f.write("someone else's")
    try:
        assert path not in shm.sweep_dead_segments()
        assert os.path.exists(path)
    finally:
        os.unlink(path)
