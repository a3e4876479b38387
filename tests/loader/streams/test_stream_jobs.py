"""Two jobs on one prefix with the same stream: one iterates it into the cache, the other reads what it committed."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import numpy as np

from loader import CachedLoader

from .stream_datasets import Counting, iterations

ROOT = Path(__file__).resolve().parents[3]


def test_the_second_job_waits_and_reads(tmp_path) -> None:
    prefix, log = str(tmp_path / "cache"), str(tmp_path / "log")  # one stream: the same attributes
    with subprocess.Popen([sys.executable, "-m", "tests.loader.streams.writing_job", prefix, log], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as a:
        try:
            assert a.stdout is not None and a.stdin is not None
            assert a.stdout.readline().strip() == "writing 0"  # job A holds the store's writer lock now
            loader = CachedLoader(Counting(50, log), batch_size=5, num_workers=0, shuffle=True, timeout=60,
                                  cache_setting={"prefix": prefix})
            got: list = []
            failed: list = []

            def read() -> None:
                try:
                    got.extend(int(v) for b in loader for v in np.asarray(b["i"]))
                except BaseException as exc:  # reported below, in the test's thread
                    failed.append(exc)

            # B's first epoch waits for A, which goes on only now: B must be waiting before A commits
            reader = threading.Thread(target=read)
            reader.start()
            a.stdin.write("go\n")
            a.stdin.flush()
            assert a.stdout.readline().strip() == "committed True"
            reader.join(60)
            assert not reader.is_alive() and not failed, failed
            assert sorted(got) == list(range(50))
            assert loader.epoch_stats[0].mode.value == "read" and iterations(log) == 1  # A's one worker
            loader.close()
        finally:
            a.kill()
            a.wait(30)


def test_a_job_that_finds_the_next_generation_being_written_reads_what_is_committed(tmp_path) -> None:
    """update_frequency=2: both jobs read generation 0; while job A writes generation 1 (its epoch 2), job B's
    epoch 2 reads generation 0, as for map-style data, and its epoch 3 reads the generation A committed: the
    stream is never iterated twice for one generation."""
    prefix, log = str(tmp_path / "cache"), str(tmp_path / "log")
    cache = {"prefix": prefix, "update_frequency": 2}
    with CachedLoader(Counting(50, log), batch_size=5, num_workers=0, cache_setting=cache) as first:
        list(first)  # generation 0, written here
    with subprocess.Popen([sys.executable, "-m", "tests.loader.streams.writing_job", prefix, log, "2"], cwd=ROOT,
                          stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True) as a:
        try:
            assert a.stdout is not None and a.stdin is not None
            with CachedLoader(Counting(50, log), batch_size=5, num_workers=0, shuffle=True, timeout=60,
                              cache_setting=cache) as loader:
                for _ in range(2):
                    list(loader)  # epochs 0 and 1 read generation 0
                assert a.stdout.readline().strip() == "writing 2"  # A holds the writer lock of generation 1
                assert sorted(int(v) for b in loader for v in np.asarray(b["i"])) == list(range(50))
                assert (loader.epoch_stats[-1].mode.value, loader.epoch_stats[-1].generation) == ("read", 0)
                a.stdin.write("go\n")
                a.stdin.flush()
                assert a.stdout.readline().strip() == "committed True"
                assert sorted(int(v) for b in loader for v in np.asarray(b["i"])) == list(range(50))
                assert (loader.epoch_stats[-1].mode.value, loader.epoch_stats[-1].generation) == ("read", 1)
        finally:
            a.kill()
            a.wait(30)
    assert iterations(log) == 2  # generation 0 here, generation 1 in A
