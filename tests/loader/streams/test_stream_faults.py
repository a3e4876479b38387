"""Faults in the middle of a stream: a worker or the training process killed, a full disk; what is left."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import psutil
import pytest

from cachestore import open_store
from loader import CachedLoader
from loader.errors import WorkerError

from ...fullfs import mounted_tmpfs
from .stream_datasets import Counting, Dying, DyingOnce

ROOT = Path(__file__).resolve().parents[3]


def served(loader: CachedLoader) -> list[int]:
    return [int(v) for b in loader for v in np.asarray(b["i"] if isinstance(b, dict) else b).ravel()]


def leftovers(prefix: str) -> list[str]:
    """What a store directory holds besides its metadata and committed generations."""
    return sorted(p.name for p in Path(prefix).iterdir()
                  if not (p.name.startswith("gen-") or p.name in ("store.json",) or p.name.endswith(".lock")))


def test_a_worker_killed_mid_stream_commits_nothing_and_the_next_epoch_writes_it(tmp_path) -> None:
    prefix = str(tmp_path / "cache")
    with CachedLoader(Dying(60, after=5), batch_size=4, num_workers=2, timeout=60,
                      cache_setting={"prefix": prefix}) as loader:
        with pytest.raises(WorkerError, match="exited unexpectedly"):
            list(loader)
        assert loader.store is not None and loader.store.latest() is None  # no half generation committed
    with CachedLoader(Counting(60), batch_size=4, num_workers=2, cache_setting={"prefix": str(tmp_path / "b")}) as ok:
        assert sorted(served(ok)) == list(range(60))


def test_the_epoch_after_a_dead_stream_worker_starts_new_workers(tmp_path) -> None:
    # As torch's next iter(): the copies cannot be taken up where one died, new ones iterate the stream.
    with CachedLoader(DyingOnce(60, after=5, marker=str(tmp_path / "died")), batch_size=4, num_workers=2,
                      timeout=60, cache_setting={"prefix": str(tmp_path / "cache")}) as loader:
        with pytest.raises(WorkerError, match="exited unexpectedly"):
            list(loader)
        assert sorted(served(loader)) == list(range(60))
        assert loader.store is not None and loader.store.latest() is not None  # written and committed


def test_the_training_process_killed_mid_stream(tmp_path) -> None:
    prefix = str(tmp_path / "cache")
    with subprocess.Popen([sys.executable, "-m", "tests.loader.streams.killed_stream", prefix, "2"], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("workers"), line
            workers = [int(p) for p in line.split()[1:]]
            while not proc.stdout.readline().startswith("served 5"):
                assert proc.poll() is None, "the training process ended before it was killed"
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
        finally:
            proc.kill()
            proc.wait(30)
    deadline = time.monotonic() + 30  # the workers die with their parent (the parent-death signal)
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in workers):
        assert time.monotonic() < deadline, f"stream workers {workers} outlived the killed training process"
        time.sleep(0.05)
    with open_store(prefix, readonly=True) as store:
        assert store.latest() is None  # nothing committed half way
    with CachedLoader(Counting(400), batch_size=4, num_workers=2, shuffle=True,
                      cache_setting={"prefix": prefix}) as loader:
        assert sorted(served(loader)) == list(range(400))
        assert loader.epoch_stats[0].committed
        assert sorted(served(loader)) == list(range(400)) and loader.epoch_stats[1].mode.value == "read"
    assert leftovers(prefix) == []  # the dead run's staging area was swept


def test_a_full_disk_mid_stream(tmp_path) -> None:
    with mounted_tmpfs(tmp_path / "small", "2m") as mount:
        prefix = str(mount / "cache")
        with CachedLoader(Counting(400, width=4096), batch_size=8, num_workers=0,
                          cache_setting={"prefix": prefix}) as loader:
            with pytest.raises(OSError) as caught:  # BudgetExceededError (an OSError) or ENOSPC
                list(loader)
            assert "budget" in str(caught.value).lower() or "space" in str(caught.value).lower()
        with open_store(prefix, readonly=True) as store:
            assert store.latest() is None
        assert leftovers(prefix) == []  # no half-written generation left


@pytest.mark.parametrize("workers", [0, 2])
def test_a_corrupt_record_of_a_stream_says_what_to_do(tmp_path, workers: int) -> None:
    """A map-style sample is computed again by index; a stream's cannot: the error says how to rewrite it."""
    from cachestore.errors import CorruptSampleError
    from tests.cachestore.test_corruption import corrupt_sample

    prefix = str(tmp_path / "cache")
    with CachedLoader(Counting(16), batch_size=4, num_workers=workers, cache_setting={"prefix": prefix}) as loader:
        served(loader)
    corrupt_sample(Path(prefix) / "gen-000000", "memmap", None, 5)
    with CachedLoader(Counting(16), batch_size=4, num_workers=workers, cache_setting={"prefix": prefix}) as loader:
        with pytest.raises(CorruptSampleError, match="cannot be computed again by index"):
            served(loader)
