"""The ranks of a node caching their streams into one generation: real torchrun jobs (gloo, CPU), and the
rendezvous they meet at, met here by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from cachestore import GenerationWriter, Store, open_store
from loader import CachedLoader
from loader.cache import stream_ranks
from loader.cache.stream_ranks import Abandoned, NodeStream, NodeStreamWriter, interleaved, moves
from loader.errors import RankFailedError, RanksTimeoutError

from ...marks import long
from ...remote.server import free_port
from .stream_datasets import Counting

SCRIPT = Path(__file__).with_name("ranks_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
needs_torchrun = pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")


@pytest.mark.parametrize("block", [1, 4, stream_ranks.BLOCK])
@pytest.mark.parametrize("counts", [[30, 20], [20, 30], [7, 7], [5, 0], [0, 5], [3, 1, 4], [1, 0, 0], [0, 0, 9]])
def test_moves_fill_the_holes_below_the_end(counts, block):
    ranks, total = len(counts), sum(counts)
    planned = moves(counts, block)
    final = []
    for r, count in enumerate(counts):
        written = [interleaved(k, r, ranks, block) for k in range(count)]
        mine = dict(planned[r])
        assert list(mine) == written[len(written) - len(mine):], "a rank moves the tail of its shard"
        final += [mine.get(i, i) for i in written]
    assert sorted(final) == list(range(total)), "every index below the end once"


@pytest.mark.parametrize("local,cache,refused", [
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


def _results(out: Path, ranks: int = 2) -> list[dict]:
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(ranks)]


@pytest.mark.timeout(150)
@needs_torchrun
def test_ranks_on_two_nodes_cache_their_streams_each_in_its_nodes_store(tmp_path):
    # Two torchrun invocations (--nnodes=2 on 127.0.0.1), two ranks each: every node's store holds its
    # own ranks' streams, its read epochs deal them between its ranks (refused before: one node only).
    port, sizes = free_port(), [30, 20, 12, 17]
    procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", "--nproc_per_node=2", f"--node_rank={k}",
                               "--master_addr=127.0.0.1", f"--master_port={port}", "--local_addr=127.0.0.1",
                               str(SCRIPT), str(tmp_path), "--sizes", ",".join(map(str, sizes)), "--epochs", "3",
                               "--workers", "1"], env={**os.environ, "OMP_NUM_THREADS": "1"},
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for k in range(2)]
    for p in procs:
        _, err = p.communicate(timeout=120)
        assert p.returncode == 0, err[-3000:]
    ranks = _results(tmp_path, 4)
    for r in ranks:
        assert "error" not in r, r["error"]
        assert r["computed"][1:] == [0, 0], "epochs 1 and 2 read the node's store"
    for node in range(2):
        mine = ranks[2 * node:2 * node + 2]
        expected = sorted(r * 1000 + k for r in (2 * node, 2 * node + 1) for k in range(sizes[r]))
        for epoch in range(3):
            assert sorted(i for r in mine for i in r["epochs"][epoch]) == expected, (node, epoch)
    assert sorted(os.listdir(tmp_path / "cache")) == ["node-0-of-2", "node-1-of-2"]


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
    # The store: one generation; streams shorter than a block: rank 0's samples, then rank 1's, moved there.
    with open_store(str(tmp_path / "cache")) as store:
        reader = store.reader()
        stored = [int(reader[i]["id"]) for i in range(len(reader))]
    assert Counter(stored) == everything
    assert Counter(stored[:sizes_of[0]]) == Counter(k for k in range(sizes_of[0]))
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
@long  # a variation of the first case: how its generate epoch ends
@pytest.mark.parametrize("breaking", [0, 1])
def test_a_rank_that_breaks_off_the_generate_epoch_leaves_it_uncommitted_not_failed(tmp_path, breaking):
    run = _torchrun(tmp_path, "--sizes", "30,20", "--workers", "1", "--epochs", "3", "--break-rank", str(breaking),
                    "--break-after", "2")
    assert run.returncode == 0, run.stderr[-3000:]
    ranks = _results(tmp_path)
    assert ranks[breaking]["batches"][0] == 2
    assert len(ranks[1 - breaking]["epochs"][0]) == (20 if breaking == 0 else 30), "the other serves its stream"
    assert [r["computed"][1:] for r in ranks] == [[30, 0], [20, 0]], "epoch 1 writes the generation again"
    everything = Counter([k for k in range(30)] + [1000 + k for k in range(20)])
    assert Counter(ranks[0]["epochs"][2] + ranks[1]["epochs"][2]) == everything
    assert sorted(p.name for p in (tmp_path / "cache").iterdir()) == ["gen-000000", "store.json"]


@pytest.mark.timeout(250)
@needs_torchrun
@long  # two torchrun jobs; resuming one rank is test_stream_resume.py's
def test_a_job_stopped_in_the_generate_epoch_resumes_on_both_ranks(tmp_path):
    stopped = _torchrun(tmp_path, "--sizes", "30,20", "--workers", "1", "--stop-after", "3")
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = _torchrun(tmp_path, "--sizes", "30,20", "--workers", "1", "--resume", "--epochs", "3")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    first = _results(tmp_path)
    then = [json.loads((tmp_path / f"rank{r}-resumed.json").read_text()) for r in range(2)]
    for r, n in enumerate((30, 20)):
        assert len(first[r]["epochs"][0]) == 12
        assert Counter(first[r]["epochs"][0] + then[r]["epochs"][0]) == Counter(r * 1000 + k for k in range(n)), \
            "the rest of the epoch, after what was served"
        assert then[r]["computed"] == [n, 0, 0], "its stream iterated again, the cached epochs read"
    everything = Counter([k for k in range(30)] + [1000 + k for k in range(20)])
    for e in (1, 2):
        assert Counter(then[0]["epochs"][e] + then[1]["epochs"][e]) == everything


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


def test_a_rank_that_is_gone_or_never_comes_is_an_error(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "by-hand")
    node = NodeStream(str(tmp_path), 0, 0, 2, 0)
    monkeypatch.setattr(stream_ranks, "JOIN_TIMEOUT", 0.2)
    node.post("count", {"count": 3})
    with pytest.raises(RanksTimeoutError, match="rank 1 of this node did not show up within 0 s to say its count"):
        node.gather("count")
    # Rank 1 showed up, then its process ended without a word.
    gone = int(subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                              text=True, timeout=30, check=True).stdout)
    (node.where / "pid-1.json").write_text(json.dumps({"pid": gone}))
    with pytest.raises(RankFailedError, match=f"rank 1 of this node \\(pid {gone}\\) is gone"):
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


def _rank(store: Store, rank: int, samples: list[int], out: dict, writer: GenerationWriter | None = None,
          breaks: bool = False) -> None:
    """One rank's side of the protocol, as a generate epoch runs it (local rank 0 holds `writer`)."""
    node = NodeStream(store.path, 0, 0, 2, rank)
    try:
        if writer is not None:
            node.publish_ticket(writer.token)
            ranked = NodeStreamWriter(node, writer.shard_spec(), store)
        else:
            ranked = NodeStreamWriter(node, node.ticket(store), store)
        out[rank] = [ranked.put(k, {"id": np.int64(s)}) for k, s in enumerate(samples)]
        if breaks:
            ranked.fail(GeneratorExit())
            return
        try:
            total = ranked.end(len(samples))
        except Abandoned as exc:
            out[f"abandoned-{rank}"] = str(exc)
            return
        if writer is not None:
            out["info"] = writer.commit()
            ranked.committed(0)
        else:
            ranked.await_commit()
        out[f"total-{rank}"] = total
    finally:
        node.close()


@pytest.mark.parametrize("sizes,breaking", [((9, 4), None), ((2, 7), None), ((5, 5), None), ((6, 3), 1),
                                            ((3, 6), 0)])
def test_the_ranks_end_commits_every_sample_once_or_nothing_when_one_broke_off(tmp_path, monkeypatch, sizes,
                                                                               breaking):
    """The protocol itself, both ranks in threads of this process: counts, moves, commit."""
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "threads")
    monkeypatch.setattr(stream_ranks, "BLOCK", 2)  # the ranks take turns by 2 samples
    path = str(tmp_path / "store")
    stores = [open_store(path), open_store(path)]  # each rank opens the node's store
    writer = stores[0].writer(0, None)
    samples = [[r * 100 + k for k in range(n)] for r, n in enumerate(sizes)]
    out: dict = {}
    threads = [threading.Thread(target=_rank, args=(stores[r], r, samples[r], out),
                                kwargs={"writer": writer if r == 0 else None, "breaks": r == breaking})
               for r in range(2)]
    for t in threads[::-1]:  # rank 1 first: it waits for the ticket
        t.start()
    for t in threads:
        t.join(30)
    assert not any(t.is_alive() for t in threads)
    if breaking is not None:
        assert out[f"abandoned-{1 - breaking}"].startswith(f"rank {breaking} of this node broke off its epoch")
        writer.abort()
        return
    assert out["total-0"] == out["total-1"] == sum(sizes)
    reader = stores[1].reader()
    stored = [int(reader[i]["id"]) for i in range(len(reader))]
    assert sorted(stored) == sorted(samples[0] + samples[1])
    common = min(sizes) // 2 * 2  # the blocks both ranks filled: rank 0's two samples, rank 1's two, ...
    assert stored[:2 * common] == [s for k in range(0, common, 2) for r in (0, 1) for s in samples[r][k:k + 2]]
    assert [p.name for p in Path(path).iterdir() if p.name.startswith(".stream-")] == []
    for store in stores:
        store.close()


def test_a_rank_whose_staging_area_went_with_rank_0_breaking_off_serves_on_unwritten(tmp_path, monkeypatch):
    # Local rank 0 broke off its epoch and went on to the next one, whose writer removed the staging area
    # the others were writing into: they serve the rest of their streams, writing nothing, and end unfailed.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "moved-on")
    monkeypatch.setattr(stream_ranks, "BLOCK", 1)
    store = open_store(str(tmp_path))
    writer = store.writer(0, None)
    first = NodeStream(store.path, 0, 0, 2, 0)
    first.publish_ticket(writer.token)
    second = NodeStream(store.path, 0, 0, 2, 1)
    ranked = NodeStreamWriter(second, second.ticket(store), store)
    first.fail(GeneratorExit())
    writer.abort()
    assert [ranked.put(k, {"id": np.int64(k)}) for k in range(3)] == [1, 3, 5]
    assert ranked.abandoned is not None and ranked.abandoned.startswith("rank 0 of this node broke off its epoch")
    with pytest.raises(Abandoned):
        ranked.end(3)
    ranked.close()
    # Without a rank that broke off, a write that fails is this rank's error.
    writer = store.writer(0, None)
    alone = NodeStream(store.path, 0, 1, 2, 0)
    alone.publish_ticket(writer.token)
    other = NodeStream(store.path, 0, 1, 2, 1)
    ranked = NodeStreamWriter(other, other.ticket(store), store)
    writer.abort()
    with pytest.raises(FileNotFoundError):
        ranked.put(0, {"id": np.int64(0)})
    ranked.close()
    store.close()


def test_a_rank_that_comes_after_rank_0_broke_off_and_moved_on_serves_unwritten(tmp_path, monkeypatch):
    # Rank 0 broke off and its next epoch removed the staging area before this rank opened its shard.
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "late")
    store = open_store(str(tmp_path))
    writer = store.writer(0, None)
    first = NodeStream(store.path, 0, 0, 2, 0)
    first.publish_ticket(writer.token)
    first.fail(GeneratorExit())
    writer.abort()
    late = NodeStream(store.path, 0, 0, 2, 1)
    ranked = NodeStreamWriter(late, late.ticket(store), store)
    assert ranked.abandoned is not None and ranked.put(0, {"id": np.int64(0)}) == stream_ranks.BLOCK
    with pytest.raises(Abandoned):
        ranked.end(1)
    ranked.close()
    # A ticket that names no staging area of this generation is refused.
    (first.where / "ticket-0.json").write_text(json.dumps({"staging": "gen-000000", "compress": False,
                                                           "allow_pickle": False}))
    with pytest.raises(RankFailedError, match="does not name a staging area"):
        late.ticket(store)
    store.close()


def test_a_streams_node_store_takes_ray_actors_as_its_workers(tmp_path, monkeypatch):
    # The rank writes what its stream copies give it: the copies may run on Ray's actors (refused before,
    # as a map-style dataset's workers, which write the node's staging area themselves, must be local).
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "ray")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    loader = CachedLoader(Counting(8), nb_consumer=2, consumer_index=0, executor="ray",
                          cache_setting={"prefix": str(tmp_path)})
    assert loader.settings.cache.scope == "node"
    loader.close()
