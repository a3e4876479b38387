"""Shared-memory slots: memfds reached through /proc (or files), grown in place, released with their users."""

from __future__ import annotations

import glob
import multiprocessing as mp
import os

import numpy as np
import pytest

import loader.executors.process.shm as shm
from loader.executors.process.segments import WorkerSegments, write_batch
from loader.executors.process.slots import SlotPool
from loader import CachedLoader

from ....fullfs import fill, mounted_tmpfs
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


def _write_on_full_shm(mount: str, conn, hints: tuple[int, int] | None, elements: int) -> None:
    """In a child whose slots are files on the small tmpfs `mount`: a slot (of `hints`: its size and the bytes
    allocated when it is made, else the pool's first), the mount filled, a batch of `elements` int64 written into
    it; report."""
    shm._SHM_DIR = mount
    pool = SlotPool(1 if hints is None else 0, memfd=False)
    if hints is not None:
        pool.size_hint, pool.used_hint = hints
    worker = WorkerSegments()
    try:
        slot, name, size = pool.acquire()
        fill(mount)
        try:
            write_batch(worker, slot, name, size, {"x": np.zeros(elements, np.int64)})
            conn.send("written")
        except OSError as exc:
            conn.send(f"{type(exc).__name__}: {exc}")
    finally:
        worker.close()
        pool.close()


@pytest.mark.parametrize("hints,elements", [
    # A slot's pages are allocated when it is made or grown: 6 MiB grows the 1 MiB slot.
    pytest.param(None, 3 << 18, id="grown"),
    # Its spare quarter is not allocated when it is made: the worker allocates what its batch needs before
    # writing it (3 MiB into a 4 MiB slot made with 1 MiB allocated: no growth).
    pytest.param((4 << 20, 1 << 20), 3 << 17, id="past-the-allocated-part"),
])
def test_a_slot_written_on_a_full_dev_shm_is_an_error_not_a_sigbus(tmp_path, hints, elements):
    # A full /dev/shm (here a small tmpfs standing in for it) is an OSError where the pages are allocated, not
    # a SIGBUS when the batch is copied in. memfd slots are not in /dev/shm at all: their pages are charged
    # to memory, allocated the same way.
    with mounted_tmpfs(tmp_path / "shm", "4m") as mount:
        ctx = mp.get_context("spawn")
        ours, theirs = ctx.Pipe()
        proc = ctx.Process(target=_write_on_full_shm, args=(str(mount), theirs, hints, elements))
        proc.start()
        try:
            assert ours.poll(30), f"the worker died with exit code {proc.exitcode} (-7: a SIGBUS)"
            assert "cannot allocate" in ours.recv()
        finally:
            proc.join(30)
        assert proc.exitcode == 0
        assert not [p for p in os.listdir(mount) if p.startswith("cachestore-")]


@pytest.mark.parametrize("memfd", MODES)
def test_a_slots_spare_quarter_takes_no_memory_until_a_batch_needs_it(memfd):
    pool = SlotPool(0, memfd=memfd)
    pool.size_hint, pool.used_hint = shm.slot_size_for(3 << 20), 3 << 20  # as after an epoch of 3 MiB batches
    worker = WorkerSegments()
    try:
        slot, name, size = pool.acquire()
        fd = os.open(shm.path_of(name), os.O_RDONLY)
        try:
            assert size == 4 << 20 and os.fstat(fd).st_blocks * 512 == 3 << 20, "the batch's bytes, not the spare"
            write_batch(worker, slot, name, size, {"x": np.ones((7 << 20) // 16, np.int64)})  # 3.5 MiB
            assert os.fstat(fd).st_blocks * 512 == 7 << 19, "allocated by the worker before it wrote"
        finally:
            os.close(fd)
    finally:
        worker.close()
        pool.close()


_KEEP_EVERY_BATCH = """
import resource, sys
import numpy as np
from loader import CachedLoader

class Rows:
    def __len__(self):
        return 400

    def __getitem__(self, i):
        return np.full(4, i, dtype=np.float32)

if __name__ == "__main__":
    cache = {"prefix": sys.argv[1]} if sys.argv[1] != "-" else None
    if sys.argv[2] == "limit":
        resource.setrlimit(resource.RLIMIT_NOFILE, (100, 100))
    kept = []
    with CachedLoader(Rows(), batch_size=2, num_workers=1, start_method="fork", cache_setting=cache) as loader:
        for _ in range(2):
            kept += list(loader)
    served = sorted(int(v) for batch in kept for v in batch[:, 0])
    assert served == sorted(list(range(400)) * 2), served[:10]
    print("served", len(kept))
"""


@pytest.mark.parametrize("cached", [False, True])
def test_batches_kept_alive_under_a_small_descriptor_limit_are_served(tmp_path, cached):
    # ulimit -n 100 and every batch kept: past the slot budget, batches are copied out of their slots
    # (each slot holds descriptors), so the epochs complete where a slot per batch ran out of them.
    import subprocess
    import sys

    script = tmp_path / "keep.py"
    script.write_text(_KEEP_EVERY_BATCH)
    prefix = str(tmp_path / "c") if cached else "-"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    if cached:  # written without the limit, read with it
        subprocess.run([sys.executable, str(script), prefix, "nolimit"], check=True, env=env, timeout=120)
    out = subprocess.run([sys.executable, str(script), prefix, "limit"], env=env, timeout=120,
                         capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "served 400" in out.stdout
