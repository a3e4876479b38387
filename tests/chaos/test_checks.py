"""The chaos checks on hand-made event logs: what they accept as explained, and what they do not.

A check that blames the loader for what a fault (or another run) did makes every chaos run fail by
chance; one that explains too much hides bugs. Each case here is a log a real run wrote.
"""

from __future__ import annotations

import json
import types
from pathlib import Path

from . import checks

SCENARIO = {"backend": "memmap", "tmpfs": False, "mode": "cache", "policy": "error"}


def run(name: str, pid: int, events: list[dict], version: int = 1):
    return types.SimpleNamespace(name=name, pid=pid, events=events, spec={"version": version},
                                 started=events[0]["t"], ended=events[-1]["t"], interrupted=False)


def epoch(t: float, number: int) -> dict:
    return {"ev": "epoch", "t": t, "epoch": number}


def stats(t: float, number: int, mode: str, generation: int) -> dict:
    return {"ev": "stats", "t": t, "epoch": number, "completed": True,
            "stats": {"mode": mode, "generation": generation, "committed": False, "extra": {}}}


def timeout(t: float, number: int, pid: int, indices: list[int], starting: bool = False) -> dict:
    message = "no data within timeout=2 s" + (f"\n(not available: {checks.STARTING})" if starting else "")
    return {"ev": "error", "t": t, "epoch": number, "type": checks.TIMEOUT_ERROR, "mro": [checks.TIMEOUT_ERROR],
            "message": message, "pid": pid, "indices": indices, "notes": [], "traceback": ""}


def paths_with_hang(tmp_path: Path, index: int, pid: int, t: float, ppid: int = 100) -> checks.Paths:
    """The control directory of a run (training pid `ppid`) whose worker `pid` hung in ``dataset[index]``."""
    for name in ("fired", "procs"):
        (tmp_path / "ctl" / name).mkdir(parents=True)
    (tmp_path / "ctl" / "fired" / f"hang-{index}-{pid}").write_text(json.dumps({"time": t}))
    (tmp_path / "ctl" / "procs" / str(pid)).write_text(json.dumps({"ppid": ppid}))
    return checks.Paths(prefix=str(tmp_path / "cache"), rotation="", ctl=str(tmp_path / "ctl"), mount="")


def test_a_timeout_after_the_one_that_killed_a_hung_worker_is_not_blamed_on_that_hang(tmp_path):
    # Epoch 2's timeout named the hung worker and killed the executor; epoch 3's new workers were still
    # starting when its own timeout came (a loaded machine): no hang of epoch 3 to name.
    paths = paths_with_hang(tmp_path, index=28, pid=101, t=10.5)
    events = [epoch(10.0, 2), timeout(12.5, 2, pid=101, indices=[28]), stats(12.6, 2, "read", 0),
              epoch(12.6, 3), timeout(14.6, 3, pid=202, indices=[13, 17, 6], starting=True),
              stats(14.7, 3, "read", 0)]
    assert checks.check_errors(SCENARIO, [run("run1", 100, events)], paths) == []


def test_a_timeout_that_names_another_worker_than_the_hung_one_is_a_problem(tmp_path):
    paths = paths_with_hang(tmp_path, index=28, pid=101, t=10.5)
    events = [epoch(10.0, 2), timeout(12.5, 2, pid=202, indices=[13]), stats(12.6, 2, "read", 0)]
    problems = checks.check_errors(SCENARIO, [run("run1", 100, events)], paths)
    assert len(problems) == 1 and "but the stuck worker is pid 101" in problems[0]


def test_a_generation_pruned_by_another_runs_refresh_commit_is_explained():
    # run1's background refresh completed generation 1 as its epoch 3 began: that commit pruned
    # generation 0 while run-c's epoch 1 was about to read it.
    run1 = run("run1", 100, [epoch(1.0, 2), stats(2.0, 2, "read", 0), epoch(2.0, 3), stats(3.0, 3, "read", 1)])
    runc = run("run-c", 200, [epoch(2.1, 1), stats(2.5, 1, "read", 0)])
    assert "commit of generation 1" in checks.removed_during(SCENARIO, [run1, runc], runc, 2.1, 2.4)
    # The same epochs with no generation newer than the one before: nothing was committed, nor removed.
    still = run("run1", 100, [epoch(1.0, 2), stats(2.0, 2, "read", 0), epoch(2.0, 3), stats(3.0, 3, "read", 0)])
    assert checks.removed_during(SCENARIO, [still, runc], runc, 2.1, 2.4) is None


def test_a_timeout_of_the_first_batch_after_the_executor_was_killed_is_a_slow_start(tmp_path):
    # Epoch 3's timeout killed the executor; epoch 4's first batch waited for new workers, the one named
    # had just finished starting (so the message shows its stack, not "still starting").
    paths = paths_with_hang(tmp_path, index=28, pid=101, t=10.5)
    events = [epoch(10.0, 3), timeout(12.5, 3, pid=101, indices=[28]), stats(12.6, 3, "read", 0),
              epoch(12.6, 4), dict(timeout(14.6, 4, pid=303, indices=[34]), message="no data within timeout=2 s: "
                                   "batch 0 of epoch 4 has not arrived after 2.0 s"), stats(14.7, 4, "read", 0)]
    assert checks.check_errors(SCENARIO, [run("run1", 100, events)], paths) == []
    # Not the first batch: a worker that started long ago and hangs with no fault is a problem.
    events[4]["message"] = "no data within timeout=2 s: batch 3 of epoch 4 has not arrived after 2.0 s"
    assert len(checks.check_errors(SCENARIO, [run("run1", 100, events)], paths)) == 1


def test_a_timeout_of_a_runs_first_batch_is_a_slow_start(tmp_path):
    # A new run's workers were importing the dataset's module when its first batch ran out of time.
    paths = paths_with_hang(tmp_path, index=28, pid=101, t=1.0, ppid=999)  # another run's hang
    events = [epoch(10.0, 0), dict(timeout(13.0, 0, pid=303, indices=[17]), message="no data within timeout=3 s: "
                                   "batch 0 of epoch 0 has not arrived after 3.0 s"), stats(13.1, 0, "read", 0)]
    assert checks.check_errors(SCENARIO, [run("run2", 100, events)], paths) == []


def batch(t: float, number: int, index: int, nonce: int) -> dict:
    return {"ev": "batch", "t": t, "epoch": number, "y": [index], "v": [1], "nonce": [nonce], "bad": [], "wait": 0.0}


def test_a_generation_computed_again_after_a_newer_one_pruned_it_is_no_other_copy(tmp_path):
    # run1 committed generation 0 with computation 11 of sample 6, then its refresh committed generation
    # 1, which pruned 0; run-c, planned to write 0 before that, found it gone and computed 6 afresh (22).
    paths = paths_with_hang(tmp_path, index=0, pid=1, t=0.0)
    committed = stats(2.0, 0, "generate", 0)
    committed["stats"]["committed"] = True
    run1 = run("run1", 100, [epoch(1.0, 0), batch(1.5, 0, 6, 11), committed, epoch(2.0, 1), stats(3.0, 1, "read", 0),
                             epoch(3.0, 2), stats(4.0, 2, "read", 1)])
    runc = run("run-c", 200, [epoch(2.5, 0), batch(4.5, 0, 6, 22), stats(4.6, 0, "generate", 0)])
    scenario = dict(SCENARIO, faults=["concurrent-run"])
    assert checks.check_shared_content(scenario, [run1, runc], paths) == []
    # Without the newer commit nothing removed generation 0: another computation of it is a problem.
    run1.events = run1.events[:-2]
    problems = checks.check_shared_content(scenario, [run1, runc], paths)
    assert len(problems) == 1 and "6 (run1 epoch 0, then run-c epoch 0)" in problems[0]


def test_a_disk_freed_during_an_epoch_was_full_at_its_start():
    # coop1 filled the disk before run1's epoch began and freed it 20 ms before run1's write failed.
    coop1 = run("coop1", 300, [{"ev": "action", "t": 7.31, "kind": "fill-disk"},
                               {"ev": "action", "t": 7.358, "kind": "free-disk"}])
    assert checks.disk_full_during([coop1], 7.336, 7.360)
    assert checks.disk_full_during([coop1], 7.2, 7.32)  # filled in the window
    assert not checks.disk_full_during([coop1], 7.36, 7.5)  # freed before it
    assert not checks.disk_full_during([coop1], 7.0, 7.3)  # filled after it
