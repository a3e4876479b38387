"""A stuck __getitem__ never hangs the training loop silently: timeout, hang warning, stack."""

from __future__ import annotations

import logging

import pytest

import loader.epochs.scheduler
from loader import CachedLoader
from loader.errors import WorkerError, WorkerTimeoutError

from ..datasets import RELEASE_STUCK, ArangeDataset, HangDataset

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("use_threading", [False, True])
def test_timeout_names_indices_pid_and_stack(no_leaks, use_threading):
    loader = CachedLoader(HangDataset, {"n": 64, "hang_at": 21}, batch_size=8, nb_worker=2, shuffle=False,
                          timeout=1.5, use_threading=use_threading)
    got = []
    with pytest.raises(WorkerTimeoutError) as info:
        for batch in loader:
            got.append(batch["y"].tolist())
    exc = info.value
    assert isinstance(exc, TimeoutError) and isinstance(exc, WorkerError)
    assert 21 in exc.indices, exc.indices
    assert "stuck_reading_the_labels" in exc.stack, exc.stack
    assert "timeout=1.5" in str(exc) and "stuck_reading_the_labels" in str(exc)
    assert isinstance(exc, RuntimeError) and str(exc).startswith("DataLoader timed out after 1.5 seconds")  # torch's
    if not use_threading:
        assert exc.pid is not None and f"pid {exc.pid}" in str(exc)
    assert got == [list(range(i, i + 8)) for i in (0, 8)], "batches before the stuck one are served in order"
    RELEASE_STUCK.set()  # a stuck thread cannot be killed: let it finish before close() joins it
    try:
        loader.close()
    finally:
        RELEASE_STUCK.clear()


def test_next_epoch_after_a_timeout_starts_new_workers(no_leaks, tmp_path):
    # The stuck worker is killed with the epoch; the next epoch works with fresh ones (a hang that was transient).
    loader = CachedLoader(HangDataset, {"n": 16, "hang_at": 100}, batch_size=4, nb_worker=2, timeout=30)
    with loader:
        assert sum(len(b["y"]) for b in loader) == 16
        pids = set(loader.worker_pids())
        assert sum(len(b["y"]) for b in loader) == 16
        assert set(loader.worker_pids()) == pids


def test_a_long_wait_is_logged_with_the_stuck_worker(no_leaks, caplog, monkeypatch):
    monkeypatch.setattr(loader.epochs.scheduler, "HANG_WARNING_SECONDS", 0.5)
    caplog.set_level(logging.WARNING, logger="loader")
    with CachedLoader(HangDataset, {"n": 16, "hang_at": 5}, batch_size=4, nb_worker=1, shuffle=False,
                      timeout=3) as cached:
        with pytest.raises(WorkerTimeoutError):
            list(cached)
    # One warning for the stuck batch (on a loaded machine the workers' start may earn one for batch 0 too).
    warnings = [r.getMessage() for r in caplog.records if "waiting for data: batch 1 " in r.getMessage()]
    assert len(warnings) == 1, warnings
    assert "stuck_reading_the_labels" in warnings[0] and "[4, 5, 6, 7]" in warnings[0]


def test_timeout_is_validated():
    for bad in (-1, "5", True, False):
        with pytest.raises(ValueError, match="timeout"):
            CachedLoader(ArangeDataset, {"n": 4}, nb_worker=0, timeout=bad)
