"""Generations written together by several processes (cachestore.write.shared, cachestore.guard.claims)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
from pathlib import Path

import numpy as np
import pytest

from cachestore import GenerationCommitted, PutResult, StoreLockedError, open_store
from cachestore.backends.staging import has_members, members_path
from cachestore.guard.claims import Claims, create_claim_files, done_map, shard_tag

pytestmark = pytest.mark.timeout(120)
FP = {"dataset": "shared-test"}
CTX = mp.get_context("spawn")


def sample(i: int) -> dict:
    return {"x": np.full(64, i, dtype=np.float32), "y": i}


def writer_job(path: str, n: int, seed: int, kill_after: int | None, results, holding=None, go=None) -> None:
    """Write generation 0 of `path` together with the others, in this job's own order; with `kill_after`,
    claim one more sample after that many, say so (`holding`), and die holding it once told (`go`)."""
    store = open_store(path, "memmap", fingerprint=FP)
    try:
        writer = store.join(0, n)
    except GenerationCommitted:
        results.put((os.getpid(), 0, "committed before joining"))
        return
    mine = 0
    for k, i in enumerate(np.random.default_rng(seed).permutation(n).tolist()):
        if kill_after is not None and k == kill_after:
            claims = Claims(writer.path, n)
            assert claims.try_claim(i)  # holds a claim, and dies with it
            holding.set()
            go.wait(60)
            os.kill(os.getpid(), signal.SIGKILL)
        mine += writer.put(i, sample(i)) is PutResult.WRITTEN
    info = writer.commit()
    results.put((os.getpid(), mine, info is not None))


def run_jobs(path: Path, n: int, jobs: list[int | None]) -> list[tuple]:
    results = CTX.Queue()
    procs = [CTX.Process(target=writer_job, args=(str(path), n, seed, kill, results))
             for seed, kill in enumerate(jobs)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(90)
        assert p.exitcode is not None, "a writer hung"
    alive = [p for p in procs if p.exitcode == 0]
    return [results.get(timeout=10) for _ in alive]


def committed_values(path: Path, n: int) -> list[int]:
    with open_store(path) as store:
        reader = store.reader(0)
        try:
            return [int(reader[i]["y"]) for i in range(n)]
        finally:
            reader.close()


@pytest.mark.parametrize("jobs", [2, 3])
def test_processes_write_each_sample_once_and_the_last_one_commits(tmp_path, jobs):
    n = 200
    results = run_jobs(tmp_path / "s", n, [None] * jobs)
    assert sum(r[1] for r in results) == n, "each sample written by exactly one process"
    # One commit: by a member as it leaves, or (a job that started late, on a busy machine) by a joiner
    # that found the area complete and published it before the members' own commits could.
    commits = sum(r[2] is True for r in results)
    assert commits == 1 or (commits == 0 and any(r[2] == "committed before joining" for r in results)), \
        f"one commit: {results}"
    assert committed_values(tmp_path / "s", n) == list(range(n))
    assert sorted(os.listdir(tmp_path / "s")) == ["gen-000000", "store.json"]


def test_a_member_killed_with_a_claim_leaves_it_to_the_others(tmp_path):
    n, path, results = 120, tmp_path / "s", CTX.Queue()
    holding, go = CTX.Event(), CTX.Event()
    killed = CTX.Process(target=writer_job, args=(str(path), n, 0, 40, results, holding, go))
    killed.start()
    assert holding.wait(60), "the first writer never claimed its sample"
    survivor = CTX.Process(target=writer_job, args=(str(path), n, 1, None, results))
    survivor.start()
    go.set()  # dies now, holding a claim and 40 samples written
    killed.join(60)
    survivor.join(90)
    assert killed.exitcode == -signal.SIGKILL and survivor.exitcode == 0
    _, written, committed = results.get(timeout=10)
    assert committed is True and n - 40 <= written <= n
    assert committed_values(path, n) == list(range(n))


def test_claims_wait_for_their_holder_and_pass_on_at_its_death(tmp_path):
    create_claim_files(tmp_path, 4)
    a, b = Claims(tmp_path, 4), Claims(tmp_path, 4)
    assert a.try_claim(1) and not b.try_claim(1) and not b.done(1)
    a.finish([1], "shard-a")
    assert b.done(1) and not b.try_claim(1) and not b.wait_claim(1), "done: nothing to compute"
    assert done_map(tmp_path, 4).tolist() == [0, shard_tag("shard-a"), 0, 0]
    assert a.try_claim(2)
    a.close()  # as a death does: the claim goes, the sample is not done
    assert b.wait_claim(2) and 2 in b.held
    b.release()
    assert a.held == set() and b.held == set()
    b.close()


def test_joining_a_committed_generation_says_so(tmp_path):
    path = tmp_path / "s"
    run_jobs(path, 10, [None])
    with open_store(path, "memmap", fingerprint=FP) as store:
        with pytest.raises(GenerationCommitted):
            store.join(0, 10)


def test_a_writer_that_does_not_share_and_the_sharing_ones_exclude_each_other(tmp_path):
    path = tmp_path / "s"
    with open_store(path, "memmap", fingerprint=FP) as store, open_store(path, "memmap", fingerprint=FP) as other:
        shared = store.join(0, 4)
        with pytest.raises(StoreLockedError):
            other.writer(0, 4)
        assert other.lock_holder() == -2  # processes writing together
        assert other.prune(keep=5) == [], "a prune beside writers removes no debris"
        shared.put(0, sample(0))
        shared.keep()
        exclusive = other.writer(1, 4)
        with pytest.raises(StoreLockedError, match="does not share"):
            store.join(0, 4)
        exclusive.abort()


def test_a_partial_shared_area_is_kept_adopted_or_pruned(tmp_path):
    path = tmp_path / "s"
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, 6)
        for i in (0, 2, 4):
            writer.put(i, sample(i))
        area = writer.path
        assert has_members(area)
        writer.keep()
        assert not has_members(area) and area.exists() and members_path(area).exists()
        assert store.prune(keep=5) == [], "a partial generation of this producer is data, not debris"
        again = store.join(0, 6)
        assert again.present().tolist() == [0, 2, 4]
        again.keep()
        # A writer that does not share completes it too: only the copies the done map names count.
        exclusive = store.writer(0, 6, resume=True)
        assert exclusive.present().tolist() == [0, 2, 4]
        for i in (1, 3, 5):
            exclusive.put(i, sample(i))
        exclusive.commit()
    assert committed_values(path, 6) == list(range(6))
    assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(1, 6)
        writer.put(3, sample(3))
        writer.keep()
        removed = store.prune(partial=True)
        assert {Path(r.path).name for r in removed} >= {writer.path.name, members_path(writer.path).name}
    assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]
