"""Slots shrink after an epoch that needed more (or larger) ones than the next: in the training
process and in every worker, never under a batch the loop still holds."""

from __future__ import annotations

import dataclasses

import os

import numpy as np
import pytest

import loader.epochs.scheduler as epoch_module
import loader.executors.process.shm as shm
from loader.executors.process.segments import WorkerSegments, write_batch
from loader.executors.process.slots import SlotPool
from loader import CachedLoader
from loader.errors import WorkerError, WorkerTimeoutError

from ...conftest import my_segments
from ...datasets import ArangeDataset, HangDataset, KillSelfDataset, SizeFromFileDataset

pytestmark = pytest.mark.timeout(90)

MODES = [pytest.param(True, id="memfd"), pytest.param(False, id="files")]
_DELETED = " (deleted)"


def slot_files(pid: int, prefix: str) -> dict[str, int]:
    """Slots of the pool named `prefix` that process `pid` holds open or mapped: label -> bytes it maps."""
    def label(path: str) -> str | None:
        path = path[:-len(_DELETED)] if path.endswith(_DELETED) else path
        name = path.split(":", 1)[1] if path.startswith("/memfd:") else os.path.basename(path)
        return name if shm.is_segment_path(path) and name.startswith(prefix + "-") else None

    found: dict[str, int] = {}
    for entry in os.listdir(f"/proc/{pid}/fd"):
        try:
            held = label(os.readlink(f"/proc/{pid}/fd/{entry}"))
        except OSError:
            continue  # closed meanwhile
        if held is not None:
            found.setdefault(held, 0)
    with open(f"/proc/{pid}/maps") as f:
        for line in f:
            parts = line.rstrip("\n").split(maxsplit=5)
            mapped = label(parts[5]) if len(parts) == 6 else None
            if mapped is not None:
                lo, hi = (int(v, 16) for v in parts[0].split("-"))
                found[mapped] = found.get(mapped, 0) + hi - lo
    return found


def _write_and_view(pool: SlotPool, worker: WorkerSegments, batch: dict) -> dict:
    slot, name, size = pool.acquire()
    return pool.view(slot, write_batch(worker, slot, name, size, batch))


def _labels(names: list[str]) -> set[str]:
    return {name.rsplit("#", 1)[-1] for name in names}


# ----------------------------------------------------------------------- the pool alone

@pytest.mark.parametrize("memfd", MODES)
def test_shrink_retires_free_slots_the_last_period_did_not_need(memfd):
    if memfd and not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    pool = SlotPool(2, memfd=memfd)
    worker = WorkerSegments()
    small = {"x": np.arange(10, dtype=np.int64)}
    try:
        views = [_write_and_view(pool, worker, small) for _ in range(6)]  # a deep period: 6 lent at once
        del views
        assert len(pool) == 6 and pool.shrink() == [], "the period just ended needed all 6"
        kept = _write_and_view(pool, worker, small)  # a shallow period: 2 lent at once
        _write_and_view(pool, worker, small)
        retired = pool.shrink()
        assert len(retired) == 4 and len(pool) == 2 == pool.floor
        assert worker.forget(retired) == 4 and len(worker) == 2
        if memfd:
            still = set(slot_files(os.getpid(), pool.prefix))
            assert not _labels(retired) & still, "a retired slot is still open or mapped"
        assert kept["x"].tolist() == list(range(10)), "the batch still held lost its slot"
        del kept
    finally:
        worker.close()
        pool.close()
    assert not my_segments()


def test_a_period_that_lent_no_slot_keeps_none():
    pool = SlotPool(2)
    worker = WorkerSegments()
    try:
        views = [_write_and_view(pool, worker, {"x": np.arange(10)}) for _ in range(3)]
        del views
        assert pool.shrink() == [] and len(pool) == 3, "the period just ended needed 3"
        retired = pool.shrink()  # a period gathered elsewhere (threads, the training process): none lent
        assert len(retired) == 3 and len(pool) == 0
        worker.forget(retired)
        assert _write_and_view(pool, worker, {"x": np.arange(4)})["x"].tolist() == [0, 1, 2, 3], \
            "a slot is created again when a task needs one"
    finally:
        worker.close()
        pool.close()
    assert not my_segments()


def test_a_grown_slot_shrinks_once_a_period_carries_only_small_batches():
    pool = SlotPool(2)
    worker = WorkerSegments()
    big = {"x": np.arange(3 << 18, dtype=np.int64)}  # 6 MiB: the slot grows to 8 MiB
    try:
        held = _write_and_view(pool, worker, big)
        assert max(pool._sizes.values()) > big["x"].nbytes and pool.size_hint > shm.MIN_SLOT
        assert pool.shrink() == [], "the period just ended carried the big batch"
        _write_and_view(pool, worker, {"x": np.arange(10)})
        assert pool.shrink() == [], "the grown slot is still lent to a batch the loop holds"
        assert np.array_equal(held["x"], big["x"])
        del held
        _write_and_view(pool, worker, {"x": np.arange(10)})
        retired = pool.shrink()  # the period since carried only small batches
        assert len(retired) == 1 and max(pool._sizes.values()) == shm.MIN_SLOT == pool.size_hint
        worker.forget(retired)
        assert all(len(m) <= shm.MIN_SLOT for _, _, m in worker._maps.values())
        # Recreated at the size the batches need when the pool runs short.
        views = [_write_and_view(pool, worker, {"x": np.arange(10)}) for _ in range(3)]
        assert len(pool) == 3 and set(pool._sizes.values()) == {shm.MIN_SLOT}
        del views
    finally:
        worker.close()
        pool.close()
    assert not my_segments()


def test_slots_of_tasks_that_never_answer_are_retired():
    class Task:
        epoch, seq, part = 0, 0, 0

    pool = SlotPool(2)
    try:
        task = Task()
        task.slot, name, _ = pool.acquire()
        pool.orphan([task])
        assert pool.drop_orphans() == [name] and len(pool) == 1 and pool.orphaned() == 0
        done = type("Done", (), {"epoch": 0, "seq": 0, "part": 0, "meta": None})()
        pool.release_task(done)  # a late answer after all changes nothing
        assert len(pool) == 1 and len(pool._free) == 1
    finally:
        pool.close()
    assert not my_segments()


# ----------------------------------------------------------------------- a loader with workers

@pytest.mark.parametrize("deep", ["held", "depth"])
def test_slots_retire_after_a_deep_epoch_here_and_in_the_workers(no_leaks, monkeypatch, deep):
    """Epoch 0 needs a slot per batch (the loop keeps every batch / the in-flight depth is 32), epoch
    1 a few; epoch 2 starts by retiring the rest, in this process and in both workers."""
    if not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    batches = 32
    with CachedLoader(ArangeDataset, {"n": 2 * batches, "shape": (16,)}, batch_size=2, nb_worker=2, shuffle=False,
                      max_queue_size=4 if deep == "held" else batches) as loader:
        if deep == "depth":
            monkeypatch.setattr(epoch_module, "INITIAL_DEPTH_PER_WORKER", batches)
            assert sum(1 for _ in loader) == batches
            monkeypatch.undo()
            runner = loader._runner  # later epochs are shallow
            runner.ctx.settings = dataclasses.replace(runner.ctx.settings, max_queue_size=4)
            kept = None
        else:
            held = list(loader)
            kept = held[5]  # held through the later epochs: its slot must never retire
            del held
        assert loader.epoch_stats[0].extra["max_in_flight"] == (batches if deep == "depth" else 4)
        pool, workers = loader._res.slots, loader._res.executor.pids()
        # A slot per batch, but for the first: it came in two parts (one per worker), joined into a copy.
        assert len(pool._names) >= batches - 1 and len(slot_files(os.getpid(), pool.prefix)) == len(pool._names)
        assert sum(len(slot_files(pid, pool.prefix)) for pid in workers) >= batches - 1, "the workers mapped every slot"
        for _ in range(2):
            for batch in loader:
                assert batch["x"].shape == (2, 16)
        here = slot_files(os.getpid(), pool.prefix)
        # Epoch 1 lent at most: the 4 in flight, the batch the loop holds, the one kept (and one spare).
        assert len(pool._names) == len(here) <= 4 + 2 + 1
        # The last retirement was sent as epoch 2 ended; a round trip through every worker (its
        # messages keep their order) makes sure each has read it.
        assert loader._res.executor.flush_shards() == []
        for pid in workers:
            assert set(slot_files(pid, pool.prefix)) <= set(here), f"worker {pid} keeps retired slots open"
        if kept is not None:
            assert kept["y"].tolist() == [10, 11] and (kept["x"] == np.array([[10], [11]])).all()
        del kept


def test_a_slot_grown_for_huge_batches_shrinks_here_and_in_the_workers(no_leaks, tmp_path):
    if not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    size_file = tmp_path / "size"
    size_file.write_text(str(1 << 20))  # 4 MiB samples: 8 MiB batches, slots grown to 10 MiB
    with CachedLoader(SizeFromFileDataset, {"n": 8, "size_file": str(size_file)}, batch_size=2, nb_worker=2,
                      shuffle=False, max_queue_size=4) as loader:
        assert sum(1 for _ in loader) == 4
        pool, workers = loader._res.slots, loader._res.executor.pids()
        assert max(slot_files(os.getpid(), pool.prefix).values()) >= 8 << 20
        for pid in workers:
            assert max(slot_files(pid, pool.prefix).values()) >= 8 << 20, "each worker grew a slot"
        size_file.write_text("16")
        for _ in range(2):  # epoch 1 carries small batches only; epoch 2 starts by retiring the big slots
            assert [batch["y"].tolist() for batch in loader] == [[0, 1], [2, 3], [4, 5], [6, 7]]
        for pid in [os.getpid(), *workers]:
            assert max(slot_files(pid, pool.prefix).values()) <= shm.MIN_SLOT, f"pid {pid} still maps a big slot"


def test_slots_lent_to_killed_workers_are_retired(no_leaks):
    """A failing epoch kills its workers: the slots of its tasks in flight never come back, and the
    next epoch retires them instead of leaving them lent for the loader's lifetime. (A dataset error
    fails its batch only, as in torch: the failure here is a timeout.)"""
    with CachedLoader(HangDataset, {"n": 40, "hang_at": 0, "delay": 0.01}, batch_size=2, nb_worker=2,
                      shuffle=False, max_queue_size=4, timeout=1) as loader:
        for _ in range(3):
            with pytest.raises(WorkerTimeoutError):
                for _ in loader:
                    pass
            # At most the 5 tasks in flight when the last epoch failed (4 batches, the first in a part
            # per worker); those of earlier ones are gone.
            assert 1 <= loader._res.slots.orphaned() <= 5
        assert len(loader._res.slots._names) <= 4 + 5


def test_slots_retire_when_a_shallow_epoch_ends_not_at_the_next_start(no_leaks, monkeypatch):
    """The loop may validate between epochs: a deep epoch's spare slots go as soon as an epoch that
    did not need them has ended, before the next ``iter()``."""
    if not shm.USE_MEMFD:
        pytest.skip("memfd slots are not usable here")
    batches = 32
    with CachedLoader(ArangeDataset, {"n": 2 * batches, "shape": (16,)}, batch_size=2, nb_worker=2, shuffle=False,
                      max_queue_size=batches) as loader:
        monkeypatch.setattr(epoch_module, "INITIAL_DEPTH_PER_WORKER", batches)
        assert sum(1 for _ in loader) == batches
        monkeypatch.undo()
        loader._runner.ctx.settings = dataclasses.replace(loader._runner.ctx.settings, max_queue_size=4)
        pool, workers = loader._res.slots, loader._res.executor.pids()
        assert len(pool._names) >= batches - 1, "the deep epoch kept its slots: it needed them"
        assert sum(1 for _ in loader) == batches  # one shallow epoch, and no iter() after it
        here = slot_files(os.getpid(), pool.prefix)
        assert len(pool._names) == len(here) <= 4 + 2 + 1
        # The workers were told at the end of the epoch; a round trip through every worker (its
        # messages keep their order) makes sure each has read it.
        assert loader._res.executor.flush_shards() == []
        for pid in workers:
            assert set(slot_files(pid, pool.prefix)) <= set(here), f"worker {pid} keeps retired slots open"


def test_slots_lent_to_a_worker_that_died_past_max_worker_restarts_are_retired(no_leaks):
    """An epoch ended by a worker death past ``max_worker_restarts`` stops the other workers too: the
    next epoch starts new ones and retires the slots of the dead one's tasks, which never answer
    (they stayed lent for the loader's lifetime, a few more every failing epoch)."""
    with CachedLoader(KillSelfDataset, {"kill_at": 5, "n": 40}, batch_size=4, nb_worker=2, shuffle=False,
                      max_worker_restarts=1, timeout=60) as loader:
        held = []
        for _ in range(4):
            with pytest.raises(WorkerError, match="more than max_worker_restarts=1"):
                for _ in loader:
                    pass
            held.append(len(my_segments()))
        assert held[-1] <= held[0], f"slots held after each failing epoch: {held}"
