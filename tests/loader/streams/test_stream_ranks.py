"""The ranks of a node caching their streams into one generation: real torchrun jobs (gloo, CPU), and the
rendezvous they meet at, met here by hand."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from cachestore import open_store
from loader import CachedLoader
from loader.cache import stream_ranks
from loader.cache.stream_ranks import NodeStream, interleaved, moves
from loader.errors import RankFailedError, RanksTimeoutError

from ...marks import long
from .stream_datasets import Counting

SCRIPT = Path(__file__).with_name("ranks_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")


@pytest.mark.parametrize("counts", [[30, 20], [20, 30], [7, 7], [5, 0], [0, 5], [3, 1, 4], [1, 0, 0], [0, 0, 9]])
def test_moves_fill_the_holes_below_the_end(counts):
    ranks, total = len(counts), sum(counts)
    planned = moves(counts)
    final = []
    for r, count in enumerate(counts):
        written = [interleaved(k, r, ranks) for k in range(count)]
        mine = dict(planned[r])
        assert list(mine) == written[len(written) - len(mine):], "a rank moves the tail of its shard"
        final += [mine.get(i, i) for i in written]
    assert sorted(final) == list(range(total)), "every index below the end once"


@pytest.mark.parametrize("local,cache,refused", [
    ("1", {}, "ranks on several nodes"),
    ("2", {"scope": "rank"}, "which they cannot here: scope='rank'"),
    ("2", {"backend": "lmdb"}, "the 'lmdb' backend does not support writing together"),
])
def test_a_stream_cache_the_ranks_cannot_write_together_is_refused(tmp_path, monkeypatch, local, cache, refused):
    # torchrun's environment for rank 0 of 2 (WORLD_SIZE left out: nothing to compare datasets with)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "refused")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", local)
    with pytest.raises(ValueError, match=refused):
        CachedLoader(Counting(8), nb_consumer=2, consumer_index=0, cache_setting={"prefix": str(tmp_path), **cache})
    assert list(tmp_path.iterdir()) == [], "refused before anything is written"


def _torchrun(out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT), str(out), *extra],
                          capture_output=True, text=True, timeout=120, env=env)


def _results(out: Path) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]


@pytest.mark.timeout(150)
@needs_torchrun
@pytest.mark.parametrize("sizes,workers", [("30,20", 2), pytest.param("13,0", 0, marks=long)])
def test_uneven_streams_make_one_generation_dealt_to_both_ranks(tmp_path, sizes, workers):
    run = _torchrun(tmp_path, "--sizes", sizes, "--workers", str(workers), "--epochs", "4")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = _results(tmp_path)
    sizes_of = [int(n) for n in sizes.split(",")]
    everything = Counter([r * 1000 + k for r, n in enumerate(sizes_of) for k in range(n)])
    # The generate epoch: each rank serves its own stream, iterated once (by each of its workers).
    assert [Counter(r["epochs"][0]) for r in ranks] == [Counter(r * 1000 + k for k in range(n))
                                                        for r, n in enumerate(sizes_of)]
    assert [r["computed"] for r in ranks] == [[n, 0, 0, 0] for n in sizes_of]
    for r in ranks:
        assert len(set(r["iterations"])) == 1, "no iteration of the stream in a cached epoch"
    # Cached epochs: the node's whole generation, each sample once across the ranks, a new order each epoch.
    for e in (1, 2, 3):
        assert Counter(ranks[0]["epochs"][e] + ranks[1]["epochs"][e]) == everything, f"epoch {e}"
        assert ranks[0]["batches"][e] == ranks[1]["batches"][e] == ranks[0]["len"][e - 1], "as many batches"
    assert len({tuple(ranks[0]["epochs"][e] + ranks[1]["epochs"][e]) for e in (1, 2, 3)}) == 3
    assert ranks[0]["len"] == ranks[1]["len"]
    # The store: one generation, rank r's k-th sample at k x 2 + r below the shorter stream's end.
    with open_store(str(tmp_path / "cache")) as store:
        reader = store.reader()
        stored = [int(reader[i]["id"]) for i in range(len(reader))]
    assert Counter(stored) == everything
    if min(sizes_of):
        assert stored[:2] == [0, 1000]
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gen-000000", "store.json"]


@pytest.mark.timeout(150)
@needs_torchrun
@long  # the first case above checks the generation; this one that the ranks write the next one together
def test_update_frequency_writes_the_next_generation_together(tmp_path):
    run = _torchrun(tmp_path, "--sizes", "9,14", "--workers", "1", "--epochs", "5", "--k", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = _results(tmp_path)
    everything = Counter([k for k in range(9)] + [1000 + k for k in range(14)])
    assert [r["computed"] for r in ranks] == [[9, 0, 9, 0, 9], [14, 0, 14, 0, 14]]
    assert [r["iterations"] for r in ranks] == [[1, 1, 2, 2, 3]] * 2, "iterated in epochs 0, 2 and 4 only"
    for e in (1, 3):
        assert Counter(ranks[0]["epochs"][e] + ranks[1]["epochs"][e]) == everything, f"epoch {e}"
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gen-000002", "store.json"]


@pytest.mark.timeout(150)
@needs_torchrun
@pytest.mark.parametrize("failing", [1, pytest.param(0, marks=long)])
def test_a_rank_whose_stream_raises_stops_both(tmp_path, failing):
    # The other rank's stream would take long to end: it stops at its next look, not at its end.
    sizes = "200000,20" if failing == 1 else "20,200000"
    run = _torchrun(tmp_path, "--sizes", sizes, "--fail-rank", str(failing), "--fail-after", "8")
    assert run.returncode != 0
    ranks = _results(tmp_path)
    assert ranks[failing]["error"] == f"LookupError: rank {failing} lost its shard at sample 8"
    other = ranks[1 - failing]
    assert other["error"].startswith(f"RankFailedError: rank {failing} of this node failed")
    assert other["error"].endswith(ranks[failing]["error"])
    assert other["computed"][0] < 100000, "it stopped long before its stream's end"
    leftovers = [p.name for p in (tmp_path / "cache").iterdir() if p.name.startswith((".stream-", ".staging-"))]
    assert leftovers == []


def _exit() -> None:
    pass


def test_a_rank_that_is_gone_or_never_comes_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "by-hand")
    node = NodeStream(str(tmp_path), 0, 0, 2, 0)
    monkeypatch.setattr(stream_ranks, "JOIN_TIMEOUT", 0.2)
    node.post("count", {"count": 3})
    with pytest.raises(RanksTimeoutError, match="rank 1 of this node did not show up within 0 s to say its count"):
        node.gather("count")
    # Rank 1 showed up, then its process ended without a word.
    gone = multiprocessing.get_context("spawn").Process(target=_exit)
    gone.start()
    gone.join(30)
    (node.where / "pid-1.json").write_text(json.dumps({"pid": gone.pid}))
    with pytest.raises(RankFailedError, match=f"rank 1 of this node \\(pid {gone.pid}\\) is gone"):
        node.gather("count")
    # Its error, when it wrote one, says more.
    (node.where / "error-1.json").write_text(json.dumps({"error": "OSError: disk full"}))
    with pytest.raises(RankFailedError, match="OSError: disk full"):
        node.check(now=True)
    node.close()
    (node.where / "done-1").touch()
    node.close()
    assert not node.where.exists(), "the last rank done removes the rendezvous"


def test_a_rendezvous_of_ranks_that_were_killed_is_swept(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "killed")
    killed = NodeStream(str(tmp_path), 0, 0, 2, 1)  # its ranks died before they were done
    (killed.where / "pid-1.json").write_text(json.dumps({"pid": 2**22 + 1}))  # above any pid_max: none lives
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "live")
    live = NodeStream(str(tmp_path), 0, 0, 2, 1)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "next")
    NodeStream(str(tmp_path), 0, 0, 2, 0)
    assert killed.where.exists(), "a young one may still be starting"
    old = os.stat(killed.where).st_mtime - 2 * stream_ranks.STALE_AFTER
    for where in (killed.where, live.where):
        os.utime(where, (old, old))
    NodeStream(str(tmp_path), 0, 0, 2, 0)
    assert not killed.where.exists()
    assert live.where.exists(), "this process, one of its ranks, lives"
