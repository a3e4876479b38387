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
            assert a.stdout.readline().strip() == "writing"  # job A holds the store's writer lock now
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
