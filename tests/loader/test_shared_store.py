"""One store written together by the processes that need it: concurrent jobs, and the ranks of a node."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
from torch.utils.data import DistributedSampler

from cachestore import FingerprintMismatchError, StoreLockedError, open_store
from loader import CachedLoader

from ..marks import long
from .datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[2]


def start_job(tmp: Path, **config) -> tuple[subprocess.Popen, Path]:
    out = tmp / f"job-{config['id']}.json"
    config = {"out": str(out), **config}
    proc = subprocess.Popen([sys.executable, "-m", "tests.loader.shared_script", json.dumps(config)], cwd=ROOT,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    return proc, out


def finish(proc: subprocess.Popen, out: Path) -> dict:
    _, err = proc.communicate(timeout=150)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.read_text())


def alone(n: int, seed: int, batch_size: int, epochs: int, prefix: Path) -> list[list[list[int]]]:
    """The batches a job serves with the store to itself."""
    with CachedLoader(ArangeDataset, {"n": n}, batch_size=batch_size, nb_worker=0, seed=seed,
                      cache_setting={"prefix": str(prefix), "fingerprint": "arange"}) as loader:
        return [[b["y"].tolist() for b in loader] for _ in range(epochs)]


@pytest.mark.parametrize("jobs", [2, pytest.param(3, marks=long)])
def test_jobs_started_together_compute_each_sample_once(no_leaks, jobs):
    n, calls, barrier = 90, no_leaks / "calls", no_leaks / "barrier"
    calls.mkdir()
    barrier.mkdir()
    configs = [{"id": j, "jobs": jobs, "barrier": str(barrier), "prefix": str(no_leaks / "cache"), "n": n,
                "calls": str(calls), "seed": 10 + j, "batch_size": (8, 5, 12)[j], "workers": (1, 0, 2)[j],
                "delay": 0.01, "epochs": 2} for j in range(jobs)]
    started = [start_job(no_leaks, **c) for c in configs]
    results = [finish(*s) for s in started]
    logged = read_calls(str(calls))
    assert sorted(logged) == list(range(n)), "every sample computed once, by one of the jobs"
    for config, result in zip(configs, results):
        # What a job serves is what it would serve alone: cooperation only changes who computes.
        assert result["epochs"] == alone(n, config["seed"], config["batch_size"], 2, no_leaks / f"alone-{config['id']}")
        first, second = result["stats"]
        assert first["computed"] + first["read"] == n and first["waited"] <= first["read"]
        # Read, or read back from the area the other jobs are still writing (it joins them again).
        assert second["computed"] == 0 and second["read"] == n
    assert sum(r["stats"][0]["computed"] for r in results) == n
    assert sum(r["stats"][0]["committed"] for r in results) <= 1, "one commit publishes the generation"
    store = open_store(no_leaks / "cache")
    assert [g.id for g in store.generations()] == [0] and store.generations()[0].committed
    reader = store.reader(0)
    assert [int(reader[i]["y"]) for i in range(n)] == list(range(n))
    reader.close()
    store.close()


def test_a_killed_cooperator_leaves_its_claims_to_the_others(no_leaks):
    n, calls, prefix = 60, no_leaks / "calls", no_leaks / "cache"
    calls.mkdir()
    # The first job dies (SIGKILL, in the middle of a batch it claimed) when it computes sample 33.
    proc, out = start_job(no_leaks, id=0, prefix=str(prefix), n=n, calls=str(calls), seed=1, batch_size=6,
                          workers=0, kill_at=33, epochs=1)
    proc.communicate(timeout=150)
    assert proc.returncode == -signal.SIGKILL
    before = Counter(read_calls(str(calls)))
    assert 0 < len(before) < n
    survivor = finish(*start_job(no_leaks, id=1, prefix=str(prefix), n=n, calls=str(calls), seed=2, batch_size=6,
                                 workers=1, epochs=2))
    after = Counter(read_calls(str(calls)))
    assert set(after) == set(range(n))
    twice = [i for i, c in after.items() if c > 1]
    assert len(twice) <= 6, "only what the dead job had not marked written (its last batch) is computed again"
    first = survivor["stats"][0]
    assert first["computed"] == n - (len(before) - len(twice)) and first["committed"]
    assert Counter(y for b in survivor["epochs"][1] for y in b) == Counter(range(n))
    store = open_store(prefix)
    reader = store.reader(0)
    assert [int(reader[i]["y"]) for i in range(n)] == list(range(n))
    reader.close()
    assert sorted(os.listdir(prefix)) == ["gen-000000", "store.json"]
    store.close()


def test_another_fingerprint_is_refused_while_a_generation_is_written(no_leaks):
    prefix, calls = no_leaks / "cache", no_leaks / "calls"
    calls.mkdir()
    proc, out = start_job(no_leaks, id=0, prefix=str(prefix), n=40, calls=str(calls), seed=1, batch_size=4,
                          workers=0, delay=0.05, epochs=1)
    try:
        deadline = time.monotonic() + 60
        while not read_calls(str(calls)):  # until the job writes its first samples
            assert proc.poll() is None and time.monotonic() < deadline, "the job never started writing"
            try:
                proc.wait(timeout=0.02)
            except subprocess.TimeoutExpired:
                pass
        with pytest.raises(FingerprintMismatchError, match="another dataset"):
            with CachedLoader(ArangeDataset, {"n": 41}, batch_size=4, nb_worker=0,
                              cache_setting={"prefix": str(prefix)}) as other:
                next(iter(other))
    finally:
        finish(proc, out)
    store = open_store(prefix)
    assert [g.id for g in store.generations() if g.committed] == [0]
    store.close()


def test_ranks_of_a_node_split_a_new_permutation_every_epoch(no_leaks):
    n, ranks, prefix = 50, 3, str(no_leaks / "cache")
    calls = no_leaks / "calls"
    calls.mkdir()
    loaders = [CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls)}, batch_size=4, nb_worker=0, seed=5,
                            nb_consumer=ranks, consumer_index=r, cache_setting={"prefix": prefix})
               for r in range(ranks)]
    with loaders[0], loaders[1], loaders[2]:
        assert {len(loader) for loader in loaders} == {-(-(-(-n // ranks)) // 4)}
        parts = []
        for epoch in range(3):
            served = [[b["y"].tolist() for b in loader] for loader in loaders]
            assert len({len(batches) for batches in served}) == 1, "every rank serves as many batches"
            assert Counter(y for batches in served for b in batches for y in b) == Counter(range(n))
            parts.append([frozenset(y for b in batches for y in b) for batches in served])
        assert parts[0] != parts[1] != parts[2], "a rank's samples change from epoch to epoch"
        assert sorted(read_calls(str(calls))) == list(range(n)), "computed once, by the node's ranks together"
    assert sorted(os.listdir(prefix)) == ["gen-000000", "store.json"], "one store for the node"


def test_a_distributed_sampler_maps_onto_the_node_split(no_leaks):
    n, prefix = 21, str(no_leaks / "cache")
    dataset = ArangeDataset(n)
    loaders = [CachedLoader(dataset, batch_size=2, sampler=DistributedSampler(dataset, num_replicas=2, rank=r, seed=9),
                            cache_setting={"prefix": prefix}) for r in range(2)]
    with loaders[0], loaders[1]:
        assert [(ld.nb_consumer, ld.consumer_index, ld.seed, ld.shuffle) for ld in loaders] == [
            (2, 0, 9, True), (2, 1, 9, True)]
        for _ in range(2):
            served = [[y for b in ld for y in b["y"].tolist()] for ld in loaders]
            assert Counter(served[0] + served[1]) == Counter(range(n))


def test_an_elastic_resume_on_fewer_ranks_serves_the_rest_of_the_epoch(no_leaks):
    n, prefix = 64, str(no_leaks / "cache")
    calls = no_leaks / "calls"
    calls.mkdir()

    def node(ranks: int) -> list[CachedLoader]:
        return [CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls)}, batch_size=4, nb_worker=0, seed=3,
                             nb_consumer=ranks, consumer_index=r, cache_setting={"prefix": prefix})
                for r in range(ranks)]

    four = node(4)
    for loader in four:
        list(loader)  # epoch 0 writes generation 0 together
    served = []
    for loader in four:
        it = iter(loader)
        served += [y for _ in range(2) for y in next(it)["y"].tolist()]
    state = four[0].state_dict()
    assert state["ranks"] == 4 and state["batches_served"] == 2
    for loader in four:
        loader.close()
    computed = len(read_calls(str(calls)))
    two = node(2)
    for loader in two:
        loader.load_state_dict(state)
        served += [y for b in loader for y in b["y"].tolist()]
    assert Counter(served) == Counter(range(n)), "the epoch goes on where the four ranks stopped, each sample once"
    assert len(read_calls(str(calls))) == computed == n, "nothing computed again for the generation it resumes"
    nxt = [[y for b in loader for y in b["y"].tolist()] for loader in two]
    assert Counter(nxt[0] + nxt[1]) == Counter(range(n)) and len(nxt[0]) == len(nxt[1])
    for loader in two:
        loader.close()


def test_rank_scope_keeps_a_store_per_rank(no_leaks):
    prefix = str(no_leaks / "cache")
    for r in range(2):
        with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, nb_consumer=2, consumer_index=r,
                          seed=1, cache_setting={"prefix": prefix, "scope": "rank"}) as loader:
            parts = [frozenset(y for b in loader for y in b["y"].tolist()) for _ in range(2)]
            assert parts[0] == parts[1]
    assert sorted(os.listdir(prefix)) == ["consumer-0-of-2", "consumer-1-of-2"]


@pytest.mark.parametrize("setting", [{"backend": "lmdb"}, {"shared": False}])
def test_ranks_that_cannot_write_together_keep_a_store_each(no_leaks, setting):
    prefix = str(no_leaks / "cache")
    loaders = [CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, nb_consumer=2, consumer_index=r,
                            seed=1, cache_setting={"prefix": prefix, **setting}) for r in range(2)]
    try:
        assert [loader.cache.scope for loader in loaders] == ["rank", "rank"]
        its = [iter(loader) for loader in loaders]  # both write at once
        served = [y for batches in zip(*its) for b in batches for y in b["y"].tolist()]
        assert sorted(served) == list(range(10))
    finally:
        for loader in loaders:
            loader.close()
    assert sorted(os.listdir(prefix)) == ["consumer-0-of-2", "consumer-1-of-2"]
    with pytest.raises(ValueError, match="scope='rank'"):
        CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, nb_consumer=2, consumer_index=0,
                     cache_setting={"prefix": prefix, "scope": "node", **setting})


def test_bad_scope_and_shared_values():
    for key, value in (("scope", "machine"), ("shared", "yes")):
        with pytest.raises(ValueError, match=key):
            CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, cache_setting={"prefix": "/tmp/x", key: value})


def test_a_second_writer_that_does_not_share_fails_clearly(no_leaks):
    prefix = str(no_leaks / "cache")
    with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0,
                      cache_setting={"prefix": prefix, "shared": False}) as first:
        it = iter(first)
        next(it)
        with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0,
                          cache_setting={"prefix": prefix}) as second:
            with pytest.raises(StoreLockedError, match="does not share"):
                next(iter(second))
        assert len([next(it)] + list(it)) == 4
