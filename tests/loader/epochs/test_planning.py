"""Planning is pure: every read of the store happens in the steps before it (loader.epochs.prepare),
and a generate epoch whose generation was committed as it opened it reads it, batch for batch."""

from __future__ import annotations

import sys
import threading

import numpy as np
import pytest

from loader import CachedLoader
from loader.epochs.kinds import generate
from loader.epochs.planner import plan_epoch
from loader.epochs.prepare import prepare

from ..datasets import ArangeDataset

pytestmark = pytest.mark.timeout(180)

#: Audit events of reading or changing the file system (the planner must raise none).
FILE_EVENTS = ("open", "os.listdir", "os.scandir", "os.remove", "os.rename", "os.mkdir", "os.rmdir", "os.truncate",
               "shutil.rmtree", "os.utime", "os.chmod", "mmap.__new__")
_recording: dict[int, list[str]] = {}  # thread id -> events seen while it records


def _audit(event: str, args: tuple) -> None:
    seen = _recording.get(threading.get_ident())
    if seen is not None and event in FILE_EVENTS:
        seen.append(f"{event}{args[:1]}")


sys.addaudithook(_audit)  # cannot be removed: it records nothing unless a test asks


def _plan_recorded(runner, epoch: int, ready) -> tuple[object, list[str]]:
    ctx = runner.ctx
    _recording[threading.get_ident()] = seen = []
    try:
        plan = plan_epoch(epoch, 0, ctx.settings, ctx.indices, ctx.state.seed, False, ctx.cache, ready)
    finally:
        del _recording[threading.get_ident()]
    return plan, seen


@pytest.mark.parametrize("committed", [True, False], ids=["read", "generate"])
def test_an_epoch_is_planned_without_reading_the_store(tmp_path, monkeypatch, committed):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": 2}
    epoch = 1 if committed else 2  # generation 0 (committed), or 1 (not yet)
    with CachedLoader(ArangeDataset, {"n": 24}, batch_size=4, nb_worker=0, seed=3, cache_setting=setting) as loader:
        list(loader)  # generation 0 written
        runner = loader._runner
        cache = runner.ctx.cache
        ready = prepare(cache, epoch)
        assert ready.choice.mode.value == ("read" if committed else "generate")

        def no_io(*args, **kwargs):
            raise AssertionError("the planner read the store")

        for name in ("generations", "reader", "lock_holder", "latest", "writer", "join", "budget"):
            monkeypatch.setattr(cache.store, name, no_io)
        plan, seen = _plan_recorded(runner, epoch, ready)
        assert seen == []
        assert plan.mode == ready.choice.mode and plan.generation == ready.choice.generation
        served = np.concatenate(list(plan.batches))
        assert sorted(served.tolist()) == list(range(24))


def test_the_steps_before_the_plan_read_the_store(tmp_path):
    """The audit hook sees what it is asked for: the look at the store before the plan opens its files
    (a check that the test above could fail)."""
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": 2}
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0, cache_setting=setting) as loader:
        list(loader)
        _recording[threading.get_ident()] = seen = []
        try:
            prepare(loader._runner.ctx.cache, 1)
        finally:
            del _recording[threading.get_ident()]
        assert seen


@pytest.mark.parametrize("workers", [0, 2])
def test_a_generation_committed_as_the_epoch_opens_it_is_read_batch_for_batch(no_leaks, monkeypatch, workers):
    """The other processes writing a generation commit it as this epoch opens it for writing: the epoch
    reads it in the batches it planned, computing nothing, instead of being planned again."""
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": 2, "background_refresh": False}
    params = {"n": 24}
    with CachedLoader(ArangeDataset, params, batch_size=4, nb_worker=0, seed=5, cache_setting=setting) as other:
        expected = [b["y"].tolist() for b in other]  # generation 0, committed by the other loader
    opened = generate.GenerateEpoch.open.__func__

    def committed_first(cls, ctx, place, plan):
        assert [g.id for g in ctx.cache.store.generations() if g.committed] == [0]
        return opened(cls, ctx, place, plan)

    with CachedLoader(ArangeDataset, params, batch_size=4, nb_worker=workers, seed=5, cache_setting=setting) as loader:
        loader._start()
        runner = loader._runner
        decide = runner.ctx.cache.decide

        def as_if_not_committed_yet(epoch, view):  # the look came before the other's commit
            return decide(epoch, type(view)({}, read_only=view.read_only))

        monkeypatch.setattr(runner.ctx.cache, "decide", as_if_not_committed_yet)
        monkeypatch.setattr(generate.GenerateEpoch, "open", classmethod(committed_first))
        served = [b["y"].tolist() for b in loader]
        stats = loader.epoch_stats[-1]
    assert served == expected
    assert stats.mode.value == "read" and stats.generation == 0 and stats.computed == 0
    assert stats.extra["committed_meanwhile"] is True
