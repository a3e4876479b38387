"""Several consumers: in-process partitions, and a real two-rank torchrun job (gloo, CPU)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cachestore.cli import main as cli
from loader import CachedLoader

from ..marks import long
from .datasets import ArangeDataset, read_calls

SCRIPT = Path(__file__).with_name("ddp_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
#: torchrun jobs per case of the per-rank parameters test (10 to check it never fails by chance).
TORCHRUN_REPEATS = int(os.environ.get("CACHESTORE_TORCHRUN_REPEATS", "1"))


def consumer_epochs(n: int, k: int, epochs: int, **kwargs) -> list[list[list[int]]]:
    """Per consumer, per epoch, the indices served."""
    out = []
    for i in range(k):
        with CachedLoader(ArangeDataset, {"n": n}, batch_size=4, nb_worker=0, nb_consumer=k, consumer_index=i,
                          seed=3, **kwargs) as loader:
            out.append([[y for b in loader for y in b["y"].tolist()] for _ in range(epochs)])
    return out


@pytest.mark.parametrize("n,k", [(40, 2), (41, 3), (7, 4)])
def test_consumers_are_disjoint_cover_everything_and_have_equal_lengths(n, k):
    per = consumer_epochs(n, k, 3)
    lengths = {len(e) for consumer in per for e in consumer}
    assert lengths == {-(-n // k)}, "every consumer serves as many samples"
    for e in range(3):
        counts = Counter(y for consumer in per for y in consumer[e])
        assert set(counts) == set(range(n))
        assert max(counts.values()) <= 2  # padding repeats a few indices once
        assert sum(counts.values()) - n == -(-n // k) * k - n
    # Uncached and shuffled: the partition changes between epochs.
    assert set(per[0][0]) != set(per[0][1])


def test_cached_consumers_keep_their_partition_and_own_stores(tmp_path, capsys):
    prefix = str(tmp_path / "cache")
    per = consumer_epochs(30, 2, 3, cache_setting={"prefix": prefix, "update_frequency": 2, "scope": "rank"})
    for consumer in per:
        assert len({frozenset(e) for e in consumer}) == 1, "a cache pins the consumer's partition"
        assert consumer[0] != consumer[1], "but the order still changes"
    assert sorted(os.listdir(prefix)) == ["consumer-0-of-2", "consumer-1-of-2"]
    assert cli(["inspect", prefix]) == 0
    out = capsys.readouterr().out
    assert "consumer-0-of-2" in out and "consumer-1-of-2" in out


def test_deferred_start():
    loader = CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, worker_per_consumer=1, nb_consumer=2)
    with pytest.raises(RuntimeError, match="start"):
        iter(loader)
    loader.start(1, device="cpu")
    with pytest.raises(RuntimeError, match="already started"):
        loader.start(0)
    ys = [y for b in loader for y in b["y"].tolist()]
    assert len(ys) == 5
    loader.close()
    with pytest.raises(RuntimeError, match="already started"):
        CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, nb_consumer=2, consumer_index=0).start(1)


def _torchrun(out: Path, *extra: str, ranks: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(SCRIPT), str(out),
                           *extra], capture_output=True, text=True, timeout=170, env=env)


@pytest.mark.timeout(200)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize("ranks,workers", [(2, 2), pytest.param(4, 0, marks=long)])
def test_torchrun_ranks_share_the_node_store_and_split_it_anew_every_epoch(tmp_path, ranks, workers):
    run = _torchrun(tmp_path, "--cache", "--workers", str(workers), "--epochs", "4", ranks=ranks)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(ranks)]
    assert {r["world"] for r in results} == {ranks}
    assert len({r["len"] for r in results}) == 1, "every rank serves as many batches"
    for e in range(4):
        counts = Counter(y for r in results for y in r["epochs"][e])
        assert counts == Counter(range(45)), f"epoch {e}: every index once across the ranks"
    assert any(set(results[0]["epochs"][1]) != set(results[0]["epochs"][e]) for e in (2, 3)), \
        "a rank serves another part of the data from epoch to epoch"
    # update_frequency=2: generations 0 (epochs 0-1) and 1 (epochs 2-3), each computed once by the node.
    assert results[0]["calls"][1] == 45 and results[0]["calls"][3] == 90
    assert sum(r["computed"][0] + r["computed"][1] for r in results) == 45
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gen-000001", "store.json"]


@pytest.mark.timeout(600)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_torchrun_resumes_on_two_then_one_then_two_ranks_serving_each_sample_once(tmp_path):
    # A run stopped after 3 steps on 2 ranks, resumed for 4 steps on 1, then on
    # 2 again to the end: every epoch serves each of the 45 samples exactly once across ranks and legs.
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    script = Path(__file__).with_name("elastic_script.py")
    served: list[tuple[int, list[int]]] = []
    state = None
    for leg, (ranks, steps) in enumerate([(2, 3), (1, 4), (2, None)]):
        out = tmp_path / f"leg{leg}"
        cmd = [str(TORCHRUN), "--standalone", f"--nproc_per_node={ranks}", str(script), str(tmp_path / "cache"),
               str(out), *(["--steps", str(steps)] if steps is not None else []),
               *(["--state", str(state)] if state is not None else [])]
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=170, env=env)
        assert run.returncode == 0, run.stderr[-3000:]
        results = [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]
        assert len({len(r["served"]) for r in results}) == 1, "every rank serves as many batches"
        served += [(epoch, batch) for r in results for epoch, batch in r["served"]]
        state = tmp_path / f"state{leg}.json"
        state.write_text(json.dumps(results[0]["state"]))
    assert {epoch for epoch, _ in served} == {0, 1}
    for e in range(2):
        assert Counter(y for epoch, b in served if epoch == e for y in b) == Counter(range(45)), f"epoch {e}"


@pytest.mark.timeout(200 * TORCHRUN_REPEATS)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize("compared", ["torch.distributed", pytest.param("files", marks=long)])
def test_torchrun_ranks_whose_datasets_differ_keep_a_store_each(tmp_path, compared):
    # Each rank logs its dataset calls into a directory of its own: a parameter that differs by rank,
    # so the ranks cannot share the node's store. They compare their datasets over torch.distributed,
    # or, without a process group, through files in the prefix; every rank then keeps a store.
    for attempt in range(TORCHRUN_REPEATS):
        out = tmp_path / str(attempt)
        out.mkdir()
        run = _torchrun(out, "--cache", "--per-rank-params", *(["--no-dist"] if compared == "files" else []))
        assert run.returncode == 0, f"run {attempt + 1}: {run.stderr[-3000:]}"
        ranks = [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]
        assert [r["scope"] for r in ranks] == ["rank", "rank"]
        assert run.stderr.count("'counter_dir' differ") == 2, "one log line per rank says why"
        assert sorted(p.name for p in (out / "cache").iterdir()) == ["consumer-0-of-2", "consumer-1-of-2"]
        # update_frequency=2: epochs 0 and 2 compute 23 samples per rank; epoch 1 reads each rank's store.
        assert [r["computed"] for r in ranks] == [[23, 0, 23], [23, 0, 23]]
        assert [r["calls"] for r in ranks] == [[23, 23, 46], [23, 23, 46]], "no dataset call in a cached epoch"
        for e in range(3):
            assert set(ranks[0]["epochs"][e]) | set(ranks[1]["epochs"][e]) == set(range(45))


@pytest.mark.timeout(200)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@long  # test_shared_store.py checks scope="rank" in one process
def test_torchrun_rank_scope_keeps_a_store_per_rank(tmp_path):
    run = _torchrun(tmp_path, "--cache", "--scope", "rank")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["len"] == ranks[1]["len"] == -(-23 // 4)
    for e in range(3):
        served = [set(r["epochs"][e]) for r in ranks]
        assert served[0] | served[1] == set(range(45))
        assert len(served[0] & served[1]) <= 1  # 45 = 2 x 23 - 1: one padded index
    # update_frequency=2: epochs 0 and 2 call the dataset (23 samples per rank), epoch 1 reads the cache.
    assert [r["computed"] for r in ranks] == [[23, 0, 23], [23, 0, 23]]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["consumer-0-of-2", "consumer-1-of-2"]


@pytest.mark.timeout(200)
@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_torchrun_rank_that_raises_stops_both(tmp_path):
    run = _torchrun(tmp_path, "--fail-rank", "1")
    assert run.returncode != 0
    assert "cannot be decoded" in run.stderr
    assert not list(tmp_path.glob("rank*.json")), "no rank finished its epochs"
