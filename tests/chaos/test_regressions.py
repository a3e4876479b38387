"""Bugs the chaos suite found, each a regression test (they were strict xfails until fixed).

A seed names a whole scenario (``CHAOS_SEED=<seed> CHAOS_N=1 make chaos`` runs it again with its
logs); where the failure depends on the exact moment a process was killed, the aftermath of that
moment is built directly instead, so that the test fails every time until the bug is fixed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets

import numpy as np
import pytest

from cachestore import open_store

from .runner import run_scenario
from .test_chaos import check

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def scenario(faults: list[str], actions: list[dict], **settings) -> dict:
    """A hand-made scenario (one run), for a moment a seed cannot pin down."""
    s = {"seed": 0, "backend": "memmap", "nb_worker": 0, "mode": "cache", "K": None, "background_refresh": False,
         "policy": "error", "medium": "memory", "rotation": 2, "size": 4, "n": 12, "batch_size": 4, "epochs": 2,
         "delay": 0.0, "loader_seed": 1, "faults": faults, "tmpfs": "disk-full" in faults, "timeout": None}
    s.update(settings)
    s["runs"] = [{"name": "run1", "version": 1, "nb_worker": s["nb_worker"], "epochs": s["epochs"],
                  "actions": actions, "on_mismatch": "error", "kill": None, "after": None}]
    return s


def test_commit_on_a_full_disk_keeps_the_budget_policy(tmp_path):
    # 3 batches; the disk fills after the last one is served, before the epoch commits.
    s = scenario(["disk-full"], [{"kind": "fill-disk", "epoch": 0, "batch": 2}], policy="stream")
    result = run_scenario(s, tmp_path)
    if result.skipped:
        pytest.skip(result.skipped)
    assert not result.problems, "\n".join(result.problems)


def test_seed_5019_dataset_error_in_a_rotation_epoch_without_workers_names_the_index(tmp_path):
    check(5019, tmp_path)


def test_seed_117_next_run_that_only_reads_cleans_up_after_a_killed_writer(tmp_path):
    # run1 (K=3) is SIGKILLed while writing generation 1; run2 reads generation 0 for its 3 epochs.
    check(117, tmp_path)


def test_seed_148_disk_rotation_window_on_a_full_disk(tmp_path):
    check(148, tmp_path)


def _dead_pid() -> int:
    proc = mp.get_context("spawn").Process(target=os.getpid)
    proc.start()
    proc.join(30)
    return proc.pid


def test_a_killed_workers_temp_file_is_not_committed(tmp_path):
    store = open_store(tmp_path / "store", "lmdb")
    writer = store.writer(0, num_samples=4)
    shard = writer.shard_spec().open("w0-i1")
    for i in range(4):
        shard.put(i, {"x": np.full(3, i, np.float64)})
    shard.close()
    staging = writer.shard_spec().token.path
    # What the SIGKILLed worker left: write_json_atomic's temp file, never renamed.
    debris = f".stats-w1-i1.json.{_dead_pid()}.{secrets.token_hex(4)}.tmp"
    with open(os.path.join(staging, debris), "w") as f:
        f.write('{"raw_bytes": 1, "stored_bytes": 1, "count": 1}')
    info = writer.commit()
    left = [name for name in os.listdir(info.path) if name.endswith(".tmp")]
    store.close()
    assert left == [], f"committed with generation {info.id}: {left}"


def test_a_failed_refresh_stops_the_workers_before_removing_the_staging_area(tmp_path, monkeypatch):
    from loader import CachedLoader
    from loader.cache.build import GenerationBuild

    from .dataset import ChaosDataset, ChaosError

    alive_at_abort: list[list[int]] = []
    abort = GenerationBuild.abort

    def watched_abort(self):
        executor = self._executor
        workers = getattr(executor, "workers", []) if executor is not None else []
        alive_at_abort.append([w.pid for w in workers if w.process.is_alive()])
        abort(self)

    monkeypatch.setattr(GenerationBuild, "abort", watched_abort)
    ctl = tmp_path / "ctl"
    for sub in ("arm", "fired", "calls", "procs"):
        (ctl / sub).mkdir(parents=True)
    n = 24
    with CachedLoader(ChaosDataset, {"n": n, "ctl": str(ctl), "delay": 0.03}, batch_size=8, nb_worker=2,
                      seed=0, cache_setting={"prefix": str(tmp_path / "cache"), "update_frequency": 2,
                                             "background_refresh": True}) as loader:
        list(loader)  # epoch 0 writes generation 0
        # The refresh of generation 1 computes the indices in order, a chunk at a time, during the
        # (fast) epoch 1: the last one is left for epoch 2, which finishes the refresh - and fails.
        (ctl / "arm" / f"raise-{n - 1}").touch()
        list(loader)
        with pytest.raises(ChaosError):
            list(loader)
    # A failed refresh keeps what it computed for the next attempt; whenever a staging area is
    # removed, the workers that write into it are gone first.
    assert not any(alive_at_abort), f"the refresh's staging area was removed while workers {alive_at_abort} ran"


def test_seed_89_a_refresh_whose_commit_meets_a_full_disk_keeps_serving(tmp_path):
    # memmap, K=2, background refresh, policy 'stream': the disk fills while generation 1 is refreshed.
    check(89, tmp_path)


def test_seed_159_a_kept_partial_generation_is_not_debris(tmp_path):
    # lmdb: run1 is SIGKILLed while writing; its staging (with lock.mdb, temp files) is the partial generation.
    check(159, tmp_path)


def test_seed_20261197_workers_sending_records_never_serve_other_values_than_stored(tmp_path):
    # memory backend, 3 workers, a worker killed and a dataset error: a partial generation their
    # records built must not be resumed by recomputing its samples (served values would differ).
    check(20261197, tmp_path)
