"""Bugs the chaos suite found, each a regression test (they were strict xfails until fixed).

A seed names a whole scenario (``CHAOS_SEED=<seed> CHAOS_N=1 make chaos`` runs it again with its
logs; add ``CHAOS_FAULTS=original`` for the seeds checked with :data:`~tests.chaos.scenario.ORIGINAL`,
named before the suite drew the ordinary accidents and the cooperating processes); where the
failure depends on the exact moment a process was killed, the aftermath of that moment is built
directly instead, so that the test fails every time until the bug is fixed.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import secrets

import numpy as np
import pytest

from cachestore import open_store

from ..marks import long
from .runner import run_scenario
from .scenario import ORIGINAL
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
    check(5019, tmp_path, ORIGINAL)


def test_seed_117_next_run_that_only_reads_cleans_up_after_a_killed_writer(tmp_path):
    # run1 (K=3) is SIGKILLed while writing generation 1; run2 reads generation 0 for its 3 epochs.
    check(117, tmp_path, ORIGINAL)


def test_seed_9051_processes_writing_together_onto_a_full_disk_wait_for_no_claim_for_ever(tmp_path):
    # Three runs write generation 0 together when the disk fills: writing stops (policy "rotate") while
    # each still held the claims of what it computed and waited for the others' samples.
    check(9051, tmp_path)


def test_seed_20261130_processes_writing_together_onto_a_full_disk_die_of_no_sigbus(tmp_path):
    # Marking a sample done went through a shared mapping of the done map: on the full tmpfs, a SIGBUS
    # killed coop1. Then a producer kept the shard the full disk had closed, and failed the next epoch.
    check(20261130, tmp_path)


def test_seed_712100_a_complete_area_whose_publish_found_the_disk_full_is_not_left_behind(tmp_path):
    # The prefix was removed under two cooperating runs, which wrote generation 0 again; each one's
    # publish had to write store.json again on the full disk, and gave caching up (policy "stream"),
    # leaving the complete area, with no store.json beside it, to a next joiner.
    check(712100, tmp_path)


def test_seed_4112075_a_sample_read_back_from_an_area_removed_under_it_is_computed(tmp_path):
    # A member's commit failed on the full disk and removed the area while another read a sample back from
    # it: FileNotFoundError on an index file the read had just listed.
    check(4112075, tmp_path)


def test_seed_2602510374_a_stream_worker_that_died_is_a_worker_error_at_the_next_epoch(tmp_path):
    # A stream worker killed in one epoch: the next epoch's first message to it met a broken pipe, and a
    # bare BrokenPipeError reached the training loop instead of the WorkerError that names the worker.
    check(2602510374, tmp_path)


@pytest.mark.parametrize("seed", [pytest.param(2602510344, marks=long), 2602510355])
def test_stream_records_flipped_on_purpose_are_an_error_that_says_to_prune(tmp_path, seed):
    # A stream's sample cannot be computed again by its index: a flipped record is a CorruptSampleError
    # that says to prune the generation (the check had taken it for one no fault explains).
    check(seed, tmp_path)


def test_seed_4112090_a_member_of_a_removed_area_does_not_publish_its_successor(tmp_path):
    # After a commit that failed on the full disk (the area removed, its members file unlinked), a member
    # of the old area took the commit lock of the old file and published the new area beside its own
    # committer: "generation 0 ... is already committed".
    check(4112090, tmp_path)


def test_seed_58203186_adopting_a_partial_generation_on_a_full_disk_applies_the_budget_policy(tmp_path):
    # The disk filled during epoch 0; epoch 1 adopted what it kept, and rewriting the shards' logs on the
    # full disk raised a bare OSError instead of BudgetExceededError (policy "stream").
    check(58203186, tmp_path)


def test_seed_58203260_a_shared_area_that_cannot_be_made_on_a_full_disk_leaves_no_lock_file(tmp_path):
    # The disk was full when run1 joined generation 0 again: making the area failed, and the members file
    # it had made for it stayed under the prefix after every run closed.
    check(58203260, tmp_path)


def test_seed_91357317_a_generation_pruned_by_another_runs_refresh_commit_is_explained(tmp_path):
    # run1's background refresh committed generation 1 (and pruned 0) as its epoch 3 began, just before
    # run-c's epoch 1 opened generation 0: the check did not count a refresh commit as a removal. The
    # moment itself is pinned in test_checks.py.
    check(91357317, tmp_path)


def test_seed_62830230_a_corrupt_record_read_back_from_a_generation_committed_meanwhile_is_a_miss(tmp_path):
    # run-c wrote generation 0 together with run1, which committed it; a byte of it was flipped, and
    # run-c's worker, reading sample 5 back from the committed generation, raised CorruptSampleError.
    check(62830230, tmp_path)


def test_seed_62830308_a_generation_pruned_by_a_newer_commit_may_be_computed_again(tmp_path):
    # run-c planned to write generation 0 together with run1; by the time its workers started, run1 had
    # committed 0 and its refresh had committed 1, which pruned 0: run-c computed samples afresh. The
    # check took that for another copy of a generation nothing had removed (pinned in test_checks.py).
    check(62830308, tmp_path)


def test_seed_62830312_a_disk_freed_while_a_write_failed_was_full(tmp_path):
    # coop1 filled the disk before run1's epoch 2 and freed it 2 ms before run1's write failed on it
    # (policy "error"); the check looked only at the disk's state when the error came.
    check(62830312, tmp_path)


def test_seed_148_disk_rotation_window_on_a_full_disk(tmp_path):
    check(148, tmp_path, ORIGINAL)


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
    check(89, tmp_path, ORIGINAL)


def test_seed_159_a_kept_partial_generation_is_not_debris(tmp_path):
    # lmdb: run1 is SIGKILLed while writing; its staging (with lock.mdb, temp files) is the partial generation.
    check(159, tmp_path, ORIGINAL)


def test_seed_20261197_workers_sending_records_never_serve_other_values_than_stored(tmp_path):
    # memory backend, 3 workers, a worker killed and a dataset error: a partial generation their
    # records built must not be resumed by recomputing its samples (served values would differ).
    check(20261197, tmp_path, ORIGINAL)


def _served(loader) -> list[int]:
    return sorted(int(y) for batch in loader for y in batch["y"])


def test_rm_of_the_prefix_under_writers_together_says_the_cache_directory_was_removed(tmp_path):
    # CHAOS_SEED=138: rm -rf of the prefix while generation 0 is written in a shared area (memmap, the default).
    import subprocess

    from cachestore.errors import CacheStoreError
    from loader import CachedLoader
    from tests.loader.datasets import ArangeDataset

    prefix = str(tmp_path / "cache")
    with CachedLoader(ArangeDataset, {"n": 24}, batch_size=4, nb_worker=0, seed=0,
                      cache_setting={"prefix": prefix}) as loader:
        seen = []
        try:
            for i, batch in enumerate(loader):
                seen += batch["y"].tolist()
                if i == 1:
                    subprocess.run(["rm", "-rf", prefix], check=True)
        except CacheStoreError as exc:  # what the exclusive writer says ("staging area ... is gone")
            assert "removed" in str(exc) or "gone" in str(exc), exc
        else:
            assert sorted(seen) == list(range(24))
        assert _served(loader) == list(range(24))  # the next epoch writes the generation again
        assert loader.epoch_stats[-1].mode == "generate" and loader.epoch_stats[-1].committed


def _remounted_read_only_after_epoch_0(tmp_path, workers: int, refresh: bool, epochs: int) -> tuple[list, list]:
    """Epoch 0 writes generation 0 on a tmpfs, which is then remounted read-only; the next `epochs` epochs
    (K=2: epoch 1 reads generation 0, maybe refreshing generation 1; epoch 2 would write generation 1)."""
    import subprocess

    from loader import CachedLoader
    from tests.fullfs import mounted_tmpfs
    from tests.loader.datasets import ArangeDataset

    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        try:
            with CachedLoader(ArangeDataset, {"n": 24}, batch_size=8, nb_worker=workers, seed=0,
                              cache_setting={"prefix": str(mnt / "c"), "update_frequency": 2,
                                             "background_refresh": refresh}) as loader:
                served = [_served(loader)]
                subprocess.run(["mount", "-o", "remount,ro", str(mnt)], check=True)
                served += [_served(loader) for _ in range(epochs)]
                stats = [(s.mode, s.generation) for s in loader.epoch_stats]
        finally:
            subprocess.run(["mount", "-o", "remount,rw", str(mnt)], check=False)
    return served, stats


def test_seed_16_a_refresh_that_cannot_start_on_a_read_only_prefix_leaves_the_read_epoch_alone(tmp_path):
    # Epoch 1 reads generation 0 and would refresh generation 1: the refresh gives up, the epoch is served.
    served, stats = _remounted_read_only_after_epoch_0(tmp_path, workers=2, refresh=True, epochs=1)
    assert served == [list(range(24))] * 2
    assert stats[1] == ("read", 0)


def test_seed_132_a_prefix_remounted_read_only_during_a_run_is_read_not_written(tmp_path):
    served, stats = _remounted_read_only_after_epoch_0(tmp_path, workers=0, refresh=False, epochs=3)
    assert served == [list(range(24))] * 4
    assert stats[1:] == [("read", 0)] * 3


def test_seed_266_a_shared_commit_that_fails_on_a_full_disk_leaves_no_lock_file(tmp_path):
    from cachestore.errors import BudgetExceededError
    from tests.fullfs import fill, free, mounted_tmpfs

    with mounted_tmpfs(tmp_path / "mnt") as mnt:
        store = open_store(mnt / "s", "memmap", fingerprint={"chaos": 266})
        writer = store.join(0, 8)
        for i in range(8):
            writer.put(i, {"x": np.full(4, i, np.float64)})
        fill(mnt)  # the last member out commits onto a full disk
        try:
            with pytest.raises(BudgetExceededError):
                writer.commit()
        finally:
            free(mnt)
            store.close()
        assert sorted(os.listdir(mnt / "s")) == ["store.json"]


CTRL_C_IN_CLOSE = """
import json, os, signal, sys, threading
from loader import CachedLoader
from loader.resources import OpenWork
from tests.loader.datasets import ArangeDataset

loader = CachedLoader(ArangeDataset, {"n": 24}, batch_size=4, nb_worker=0, seed=0,
                      cache_setting={"prefix": sys.argv[1]})
it = iter(loader)
next(it)  # generation 0 is being written
# Any thread that does not block SIGINT (torch's, a timer, the user's) may be the one the kernel gives Ctrl-C to;
# here it is the thread that presses it, while close() keeps the builds (the signal comes from that thread).
press = threading.Event()
presser = threading.Thread(target=lambda: (press.wait(), os.kill(os.getpid(), signal.SIGINT)), daemon=True)
presser.start()
kept = []
keep = OpenWork.keep

def keeping(self):
    press.set()
    presser.join()
    keep(self)
    kept.append(True)

OpenWork.keep = keeping
try:
    loader.close()
    print(json.dumps({"interrupted": False, "kept": bool(kept)}))
except KeyboardInterrupt:
    print(json.dumps({"interrupted": True, "kept": bool(kept)}))
"""


def test_seed_221_ctrl_c_during_close_arrives_once_the_clean_up_is_done(tmp_path):
    import json
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", CTRL_C_IN_CLOSE, str(tmp_path / "cache")], capture_output=True,
                          text=True, timeout=120, cwd=root, env={**os.environ, "PYTHONPATH": root})
    assert done.returncode == 0, done.stderr[-3000:]
    # interrupts_deferred() promises: the clean-up runs to its end, then KeyboardInterrupt arrives.
    assert json.loads(done.stdout.splitlines()[-1]) == {"interrupted": True, "kept": True}, done.stderr[-3000:]
