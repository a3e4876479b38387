"""Every feature with every other: dataset kind × executor × caching × topology × resume.

Each cell (``cell.py``) serves a tiny dataset for three epochs, in this process or as two torchrun
ranks, and checks: each sample exactly once per epoch across the ranks (``rotation`` times with
rotation), values equal to the dataset's, a resumed run (stopped in epoch 1) serves exactly the rest,
a second job on the remote computes 0 samples, and nothing is left behind. ``make test`` runs a
diagonal of the product (every value of every axis once), ``make check`` all of it. Every cell runs:
streams too on threads and on Ray (their copies on the loader's workers, as a map-style dataset's tasks).
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from tests.loader.conftest import leftovers, live_children, my_segments, segments_of
from tests.marks import covering, long

from . import cell

pytestmark = pytest.mark.timeout(420)

TORCHRUN = Path(sys.executable).with_name("torchrun")
SCRIPT = Path(cell.__file__)
N = 24  # samples (a stream's: per rank)
EPOCHS = 3
STOP = [1, 1]  # the stopped run takes its state after batch 1 of epoch 1


def expected(kind: str, caching: str, ranks: int) -> collections.Counter:
    """Every id an epoch serves across the ranks, as many times as it is served."""
    ids = [r * 1000 + k for r in range(ranks) for k in range(N)] if kind == "stream" else list(range(N))
    times = 2 if caching.startswith("rotation") else 1
    return collections.Counter({i: times for i in ids})


def torchrun(out: Path, config: dict, phase: str) -> list[dict]:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT), str(out),
                          json.dumps(config), phase], capture_output=True, text=True, timeout=300, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    return [json.loads((out / f"{phase}-rank{r}.json").read_text()) | {"ranks": 2} for r in range(2)]


def serve(out: Path, config: dict, phase: str, topology: str) -> list[dict]:
    if topology == "ranks":
        results = torchrun(out, config, phase)
    else:
        before = {p.pid for p in live_children()}  # the servers (SeaweedFS, Ray)
        results = [cell.run(config, out, phase) | {"ranks": 1}]
        assert not ended_or_left([p for p in live_children() if p.pid not in before]), "worker processes left behind"
        assert not my_segments(), "shared memory left behind"
    for result in results:
        assert result["error"] is None, result.get("traceback") or result["error"]
        for pid in result["pids"]:
            assert not psutil.pid_exists(pid) or psutil.Process(pid).status() == psutil.STATUS_ZOMBIE, pid
        assert not segments_of(result.get("pid", os.getpid())) or topology == "ranks"
    assert not leftovers(str(out)), leftovers(str(out))
    return results


def ended_or_left(new: list[psutil.Process]) -> list[psutil.Process]:
    """Of the processes started during a cell, those that stay: the Ray cluster's raylet ends the workers
    of a job (``ray::IDLE``, those it started for the job's actors) once the job's driver disconnected, in
    its own time, so those get a minute to end; any other process must have ended already."""
    def ray_worker(p: psutil.Process) -> bool:
        try:
            return p.name().startswith("ray::") or any(a.startswith("ray::") for a in p.cmdline()[:1])
        except psutil.NoSuchProcess:
            return True  # ended as it was looked at (a Ray worker the raylet stopped): wait_procs finds it gone

    _, alive = psutil.wait_procs([p for p in new if ray_worker(p)], timeout=60)
    return [p for p in new if not ray_worker(p)] + alive


def across(results: list[dict], epoch: int) -> collections.Counter:
    return collections.Counter(i for r in results for i in r["epochs"][epoch])


@covering("kind,executor,caching,topology,resume", ["map", "stream"], ["none", "process", "threads", "ray"],
          ["none", "cache", "remote", "rotation-memory", "rotation-disk"], ["one", "ranks"], [False, True])
def test_cell(tmp_path, request, kind, executor, caching, topology, resume):
    check(tmp_path, request, kind, executor, caching, topology, resume)


def check(tmp_path, request, kind, executor, caching, topology, resume, **more):
    """One cell (see the module docstring); `more`: other keys of its config."""
    if topology == "ranks" and not TORCHRUN.exists():
        pytest.skip("torchrun is not installed next to this Python")
    config: dict = {"kind": kind, "executor": executor, "caching": caching, "n": N, "epochs": EPOCHS, **more}
    if caching == "remote":
        request.getfixturevalue("s3_env")
        config["remote"] = request.getfixturevalue("remote_url")
    if executor == "ray":
        config["ray_address"] = request.getfixturevalue("ray_address")
    ranks = 2 if topology == "ranks" else 1
    want = expected(kind, caching, ranks)
    if resume:
        config["stop"] = STOP
    results = serve(tmp_path, config, "run", topology)
    for epoch in range(STOP[0] if resume else EPOCHS):
        assert across(results, epoch) == want, f"epoch {epoch}"
    if resume:
        stopped = across(results, STOP[0])
        again = serve(tmp_path, config, "resume", topology)
        assert stopped + across(again, 0) == want, "the resumed run serves exactly the rest of the epoch"
        for epoch in range(1, EPOCHS - STOP[0]):
            assert across(again, epoch) == want, f"resumed epoch {STOP[0] + epoch}"
    if caching == "remote":
        made = cell.computed(str(tmp_path / "calls"))
        # The generation the remote holds serves K = 2 epochs (no background refresh of the next one).
        second = serve(tmp_path, {**config, "stop": None, "epochs": 2, "refresh": False}, "second", topology)
        for epoch in range(2):
            assert across(second, epoch) == want, f"second job, epoch {epoch}"
        assert cell.computed(str(tmp_path / "calls")) == made, "the second job computed samples"


def test_a_cached_stream_under_torchrun_resumes_its_own_state(tmp_path, request):
    check(tmp_path, request, "stream", "process", "cache", "ranks", True)


@pytest.mark.parametrize("kind,caching", [("map", "none"), ("map", "rotation-disk"),
                                          pytest.param("stream", "none", marks=long),
                                          pytest.param("map", "rotation-memory", marks=long),
                                          pytest.param("map", "cache", marks=long)])
def test_rank_0s_state_resumes_every_rank(tmp_path, request, kind, caching):
    check(tmp_path, request, kind, "process", caching, "ranks", True, state_from="rank0")


def test_rotation_over_a_stream_under_torchrun_takes_each_ranks_next_samples(tmp_path):
    if not TORCHRUN.exists():
        pytest.skip("torchrun is not installed next to this Python")
    half = N // 2
    config = {"kind": "stream", "executor": "process", "caching": "rotation-memory", "n": N, "epochs": 3,
              "take": half}
    results = serve(tmp_path, config, "run", "ranks")
    epochs = [across(results, epoch) for epoch in range(3)]
    for epoch, served in enumerate(epochs):
        assert set(served.values()) == {2}, f"epoch {epoch}: each sample twice"
        assert sorted(sum(1 for i in served if i // 1000 == r) for r in range(2)) == [half, half], epoch
    assert epochs[0] + epochs[1] == expected("stream", "rotation", 2), \
        "epochs 0 and 1: each rank's whole stream, its next samples in epoch 1"
    assert epochs[2] == epochs[0], "the streams ended: a new pass"
