"""Partial generations: a generate epoch that is broken off, fails or is killed keeps what it wrote.

The next attempt at the same generation (the next epoch, or a new run with the same fingerprint)
adopts the staging area, reads back the samples already in it instead of computing them, computes
only what is missing, and commits once every sample is in. Dataset calls are counted across
processes (``ArangeDataset(counter_dir=...)``) to show that no written sample is computed again.
"""

from __future__ import annotations

import collections
import json
import logging
import os
import select
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachestore import open_store
from loader import CachedLoader

from ..conftest import kept_partial, leftovers
from ..datasets import ArangeDataset, read_calls
from ..partial_script import N, make_loader, served_values

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[3]
CASES = [("memmap", 0), ("memmap", 2), ("lmdb", 0), ("lmdb", 2), ("memory", 0)]


def _staging(prefix: str) -> list[Path]:
    """The partial generations under `prefix`: shared areas (the default) or a writer's staging areas."""
    return sorted(p for p in Path(prefix).glob(".s*") if p.name.startswith((".staging-", ".shared-"))
                  and p.is_dir())


@pytest.mark.parametrize("backend,nb_worker", CASES)
def test_a_loop_that_always_breaks_early_still_builds_its_cache(no_leaks, caplog, backend, nb_worker):
    prefix, calls_dir = str(no_leaks / "c"), no_leaks / "calls"
    calls_dir.mkdir()
    n, breaks_after = 40, 4  # 10 batches an epoch, 4 served
    modes = []
    with caplog.at_level(logging.INFO, logger="loader"):
        with CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls_dir)}, batch_size=4,
                          nb_worker=nb_worker, seed=3, max_queue_size=2,
                          cache_setting={"prefix": prefix, "backend": backend}) as loader:
            for epoch in range(12):
                for step, _ in enumerate(loader):
                    if step + 1 == breaks_after:
                        break
                modes.append(str(loader.epoch_stats[-1].mode))
                if modes[-1] == "read":
                    break
            stats = list(loader.epoch_stats)
    assert modes[-1] == "read" and len(modes) <= 10, f"never committed: {modes}"
    assert all(mode == "generate" for mode in modes[:-1])
    # Every sample computed once in all: nothing written was computed again, and what was in flight
    # at a break (workers) was written too.
    calls = read_calls(str(calls_dir))
    assert sorted(calls) == list(range(n)), collections.Counter(calls).most_common(3)
    generate = [s for s in stats if s.mode == "generate"]
    if len(generate) > 1:
        # Later attempts adopted the earlier ones and served their samples from the staging area.
        assert all(s.extra.get("adopted", 0) > 0 for s in generate[1:])
        assert sum(s.read for s in generate[1:]) > 0
        assert "ended with generation 0 incomplete" in caplog.text
    assert "is complete: committed" in caplog.text
    if backend != "memory":
        assert not leftovers(prefix) and not _staging(prefix)
        with open_store(prefix, readonly=True) as store:
            assert store.latest() == 0 and not store.verify()


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_a_failed_epoch_keeps_what_it_wrote(no_leaks, nb_worker):
    prefix, calls_dir = str(no_leaks / "c"), no_leaks / "calls"
    calls_dir.mkdir()
    params = {"n": 24, "counter_dir": str(calls_dir), "fail_at": 13}
    with CachedLoader(ArangeDataset, params, batch_size=4, nb_worker=nb_worker, shuffle=False, max_queue_size=2,
                      cache_setting={"prefix": prefix}) as loader:
        served = []
        with pytest.raises(Exception, match="sample 13 is broken"):
            for batch in loader:
                served += batch["y"].tolist()
        assert loader.epoch_stats[-1].mode == "generate"
    (staging,) = _staging(prefix)
    assert kept_partial(str(staging))
    # What it kept, seen through the store: at least every sample it delivered (with workers, also
    # what they finished before they were stopped).
    with open_store(prefix) as store:
        writer = store.join(0, 24)
        written = writer.present().tolist()
        writer.keep()
    assert served and set(served) <= set(written) and 13 not in written
    assert sorted(read_calls(str(calls_dir))) == sorted(set(read_calls(str(calls_dir))))


def _kill_mid_epoch(tmp: Path, backend: str, nb_worker: int) -> tuple[str, Path, list]:
    prefix, calls_dir, served = str(tmp / "c"), tmp / "calls", tmp / "served.json"
    calls_dir.mkdir()
    proc = subprocess.Popen([sys.executable, "-m", "tests.loader.partial_script", prefix, str(calls_dir),
                             str(served), "--backend", backend, "--nb-worker", str(nb_worker), "--stop-after", "3"],
                            cwd=ROOT, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 60)
        line = proc.stdout.readline() if ready else b""
        assert line.strip() == b"ready", proc.stderr.read().decode()[-3000:] if proc.poll() is not None else line
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
        for stream in (proc.stdin, proc.stdout, proc.stderr):
            stream.close()
    return prefix, calls_dir, json.loads(served.read_text())


@pytest.mark.parametrize("backend,nb_worker", [("memmap", 0), ("memmap", 2), ("lmdb", 0), ("lmdb", 2)])
def test_a_killed_run_is_completed_by_the_next_one(no_leaks, backend, nb_worker):
    prefix, calls_dir, served = _kill_mid_epoch(no_leaks, backend, nb_worker)
    killed_calls = read_calls(str(calls_dir))
    assert len(served) == 12 and len(killed_calls) >= 12
    assert _staging(prefix), "the killed run left its partial generation"
    with make_loader(prefix, str(calls_dir), backend, nb_worker) as loader:
        values = dict(tuple(pair) for batch in loader for pair in served_values(batch))
        first = loader.epoch_stats[0]
        assert first.mode == "generate" and first.committed
        adopted = first.extra["adopted"]
        again = dict(tuple(pair) for batch in loader for pair in served_values(batch))
        assert loader.epoch_stats[1].mode == "read"
    new_calls = list((collections.Counter(read_calls(str(calls_dir))) - collections.Counter(killed_calls)).elements())
    # The new run computed exactly what was missing, each sample once, and read the rest back.
    assert adopted >= 12 and len(new_calls) == N - adopted == first.computed
    assert first.read == adopted and len(set(new_calls)) == len(new_calls)
    # What the killed run delivered is what the generation holds: adopted, not recomputed
    # (the samples are augmented with random noise, so a recomputation would differ).
    assert all(again[i] == v for i, v in served), "cached values differ from those delivered before the kill"
    assert values == again
    # Only the batches in flight at the kill may have been computed twice in all.
    twice = [i for i, c in collections.Counter(killed_calls + new_calls).items() if c > 1]
    assert len(twice) <= 2 * 4, twice  # max_queue_size=2 batches of 4
    assert not leftovers(prefix) and not _staging(prefix)


def test_a_partial_generation_of_another_dataset_is_not_adopted(no_leaks):
    prefix, calls_dir, _ = _kill_mid_epoch(no_leaks, "memmap", 0)
    (staging,) = _staging(prefix)
    other = no_leaks / "other-calls"
    other.mkdir()
    # Other dataset parameters: another fingerprint. Nothing was committed, so the store takes the new
    # producer; the dead writer's staging area is debris and goes, nothing of it is served.
    with CachedLoader(ArangeDataset, {"n": N, "shape": [3], "counter_dir": str(other)}, batch_size=4,
                      nb_worker=0, seed=7, cache_setting={"prefix": prefix}) as loader:
        ys = sorted(y for batch in loader for y in batch["y"].tolist())
        assert "adopted" not in loader.epoch_stats[0].extra and loader.epoch_stats[0].committed
    assert ys == list(range(N)) and sorted(read_calls(str(other))) == list(range(N))
    assert not staging.exists() and not leftovers(prefix)


def test_background_refresh_keeps_what_it_computed(no_leaks):
    prefix, calls_dir = str(no_leaks / "c"), no_leaks / "calls"
    calls_dir.mkdir()

    def loader():
        return CachedLoader(ArangeDataset, {"n": 48, "counter_dir": str(calls_dir), "delay": 0.002}, batch_size=8,
                            nb_worker=2, seed=1, cache_setting={"prefix": prefix, "update_frequency": 2,
                                                                "background_refresh": True})

    with loader() as first:
        list(first)  # generation 0
        it = iter(first)  # a read epoch of 0: the workers compute generation 1 meanwhile
        for _ in range(3):
            next(it)
        while first._runner.ctx.refresh.build.written < 8:  # wait for a few refresh chunks, no sleep
            first._runner.ctx.refresh.pump(first._res.executor)
            msg = first._res.executor.next_message(timeout=10)
            assert msg is not None
            first._runner.ctx.refresh.handle(msg)
        del it
    (staging,) = _staging(prefix)
    assert kept_partial(str(staging)) and staging.name.startswith((".staging-000001-", ".shared-000001-"))
    before = collections.Counter(read_calls(str(calls_dir)))
    with open_store(prefix) as store:
        writer = store.join(1, 48)
        kept = len(writer.present())
        writer.keep()
    assert kept >= 8
    with loader() as second:
        second.set_epoch(2)  # the first epoch of generation 1: the refresh's samples are adopted
        assert sorted(y for b in second for y in b["y"].tolist()) == list(range(48))
        stats = second.epoch_stats[0]
        assert stats.generation == 1 and stats.committed and stats.extra["adopted"] == kept
    new_calls = collections.Counter(read_calls(str(calls_dir))) - before
    assert sum(new_calls.values()) == 48 - kept and max(new_calls.values()) == 1
