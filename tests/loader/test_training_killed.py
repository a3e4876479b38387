"""The training process is killed mid-epoch: its workers and its shared memory go with it.

A real training process (``killed_script.py``) runs a generate epoch whose
next batch a worker computes forever; the test SIGKILLs or SIGTERMs it and
checks, within a bounded time, that every worker is gone and that no slot
of it survives - neither a file in ``/dev/shm`` nor a memfd held by any
process. A new run on the same prefix then cleans the staging area and lock.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from loader import CachedLoader

from .conftest import leftovers, segments_of
from .datasets import ArangeDataset

pytestmark = pytest.mark.timeout(90)

SCRIPT = Path(__file__).with_name("killed_script.py")
ROOT = SCRIPT.parent.parent.parent
DEADLINE = 30.0  # seconds for anything the test waits on


def _wait_for(condition, what: str, proc: subprocess.Popen | None = None):
    deadline = time.monotonic() + DEADLINE
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            raise AssertionError(f"the training process exited ({proc.returncode}) before {what}:\n"
                                 + Path(proc.args[-1]).with_name("stderr.txt").read_text())
        time.sleep(0.05)  # polling a condition, with a deadline: not a synchronisation by sleeping
    raise AssertionError(f"not within {DEADLINE:.0f} s: {what}")


def _running(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# The default forks the workers of this script (nothing unsafe runs in it); spawned ones, and a
# forkserver's (whose parent-death signal follows the server, which exits with the training process).
@pytest.mark.parametrize("signum,method", [(signal.SIGKILL, "auto"), (signal.SIGTERM, "auto"),
                                           (signal.SIGKILL, "spawn"), (signal.SIGKILL, "forkserver")])
def test_workers_and_slots_die_with_the_training_process(tmp_path, signum, method):
    prefix, markers = tmp_path / "cache", tmp_path / "markers"
    markers.mkdir()
    with open(tmp_path / "stderr.txt", "w") as stderr:
        proc = subprocess.Popen([sys.executable, str(SCRIPT), str(prefix), str(markers), method],
                                env={**os.environ, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                                stderr=stderr)
    try:
        pids_file = markers / "pids.txt"
        _wait_for(pids_file.exists, "the first batch arrived", proc)
        trainer, *workers = [int(line) for line in pids_file.read_text().split()]
        assert trainer == proc.pid and len(workers) == 2
        # A batch is in flight: a worker is inside __getitem__ for good.
        hung = _wait_for(lambda: list(markers.glob("hanging-*")), "a worker is stuck in __getitem__", proc)
        assert int(hung[0].name.split("-")[1]) in workers
        assert segments_of(trainer), "the slots are found while the training process lives"

        os.kill(trainer, signum)
        proc.wait(DEADLINE)
        assert proc.returncode == -signum

        _wait_for(lambda: not any(_running(pid) for pid in workers), "every worker is gone")
        _wait_for(lambda: not segments_of(trainer), "no shared-memory slot of the training process is left")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(DEADLINE)
        for pid in locals().get("workers", []):
            if _running(pid):
                os.kill(pid, signal.SIGKILL)

    # The killed run left its staging area and lock file: the next run on the prefix cleans them.
    with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(prefix), "update_frequency": 2}) as loader:
        assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(12))
        assert loader.epoch_stats[0].committed
    assert leftovers(str(prefix)) == []
