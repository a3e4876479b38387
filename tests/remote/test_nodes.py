"""Several nodes, one generation: two torchrun invocations (``--nnodes=2`` on 127.0.0.1), separate local
prefixes, one remote; and a node killed before it publishes its part."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from cachestore import open_store

from ..marks import long
from .conftest import KEY, SECRET
from .server import free_port

SCRIPT = Path(__file__).with_name("node_script.py")
TORCHRUN = Path(sys.executable).with_name("torchrun")
N = 48

pytestmark = pytest.mark.timeout(300)


def node_env(weed, endpoint: str | None = None) -> dict[str, str]:
    return {**os.environ, "OMP_NUM_THREADS": "1", "AWS_ENDPOINT_URL": endpoint or weed.endpoint, "AWS_ACCESS_KEY_ID": KEY,
            "AWS_SECRET_ACCESS_KEY": SECRET, "AWS_REGION": "us-east-1"}


def finish(procs: list[subprocess.Popen], timeout: float = 240) -> list[tuple[int, str]]:
    out = []
    try:
        for p in procs:
            _, err = p.communicate(timeout=timeout)
            out.append((p.returncode, err))
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    return out


def stores_hold_everything(prefixes: list[Path]) -> None:
    for prefix in prefixes:
        assert sorted(os.listdir(prefix)) == ["gen-000000", "store.json"]  # nothing else left behind
        with open_store(prefix, readonly=True) as store:
            gens = [g for g in store.generations() if g.committed]
            assert [(g.id, g.num_samples) for g in gens] == [(0, N)], (prefix, gens)
            reader = store.reader(0)
            assert all(int(reader[i]["y"]) == i and np.all(reader[i]["x"] == i) for i in range(N))
            reader.close()


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize("per_node", [1, pytest.param(2, marks=long)])
def test_two_torchrun_nodes_compute_each_sample_once_and_hold_the_whole_generation(tmp_path, weed, remote_url,
                                                                                     per_node):
    port, world, epochs = free_port(), 2 * per_node, 1 + 2 * per_node
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]
    procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", f"--nproc_per_node={per_node}", f"--node_rank={k}",
                               "--master_addr=127.0.0.1", f"--master_port={port}", "--local_addr=127.0.0.1",
                               str(SCRIPT), str(tmp_path), str(prefixes[k]), remote_url, "--epochs", str(epochs)],
                              env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
    results = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(world)]
    calls = sorted(c for r in results for c in r["calls"])
    assert calls == list(range(N))  # each sample computed once across the nodes (and their ranks)
    for k in range(2):  # node k computed its part: samples k*N//2 .. (k+1)*N//2 - 1
        node_calls = sorted(c for r in results[k * per_node:(k + 1) * per_node] for c in r["calls"])
        assert node_calls == list(range(k * N // 2, (k + 1) * N // 2))
    for r in results:
        assert r["modes"] == ["generate"] + ["read"] * (epochs - 1)
        assert r["computed"][1:] == [0] * (epochs - 1)
        assert all(len(e) == len(r["epochs"][0]) for e in r["epochs"])  # as many samples every epoch
        # The cached epochs deal the whole cluster's samples: a rank sees them all in world_size epochs.
        assert sorted(set().union(*r["epochs"][1:1 + world])) == list(range(N))
    for epoch in range(1, epochs):  # the ranks of an epoch are dealt disjoint shares covering everything
        assert sorted(c for r in results for c in r["epochs"][epoch]) == list(range(N))
    assert results[0]["epochs"][1] != results[0]["epochs"][2]  # a new deal every epoch
    assert {r["store"] for r in results} == {str(p) for p in prefixes}  # prefix itself: no node-<k>-of-<m>/
    stores_hold_everything(prefixes)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_generations_after_the_first_are_computed_in_parts_too(tmp_path, weed, remote_url):
    # update_frequency=2 with workers: no node refreshes in the background while nodes compute in parts
    # (no node can compute the next generation alone; the loader logs so): epoch 2 computes generation
    # 1 in parts as epoch 0 did generation 0, each sample once per generation across the nodes.
    port = free_port()
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]
    procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={k}",
                               "--master_addr=127.0.0.1", f"--master_port={port}", "--local_addr=127.0.0.1",
                               str(SCRIPT), str(tmp_path), str(prefixes[k]), remote_url, "--epochs", "4",
                               "--k", "2", "--workers", "2"],
                              env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for k in range(2)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
    results = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(2)]
    calls = sorted(c for r in results for c in r["calls"])
    assert calls == sorted(list(range(N)) * 2), "each sample once per generation, across the nodes"
    for epoch in range(4):
        assert sorted(i for r in results for i in r["epochs"][epoch]) == list(range(N)), epoch
    for k, r in enumerate(results):
        assert r["modes"] == ["generate", "read", "generate", "read"]
        assert sorted(r["calls"]) == sorted(list(range(k * N // 2, (k + 1) * N // 2)) * 2), "each node its part"
    for prefix in prefixes:
        with open_store(prefix, readonly=True) as store:
            assert [(g.id, g.num_samples) for g in store.generations() if g.committed] == [(1, N)]


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_a_generate_epoch_computed_in_parts_resumes_exactly_on_both_nodes(tmp_path, weed, remote_url):
    # Both nodes stop after 3 batches of the generate epoch (each a state), and new processes resume: each
    # node serves the rest of its part, computing only what it had not, and epoch 1 reads the whole.
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]

    def run(*extra: str) -> None:
        port = free_port()
        procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={k}",
                                   "--master_addr=127.0.0.1", f"--master_port={port}", "--local_addr=127.0.0.1",
                                   str(SCRIPT), str(tmp_path), str(prefixes[k]), remote_url, *extra],
                                  env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in range(2)]
        for code, err in finish(procs):
            assert code == 0, err[-3000:]

    run("--epochs", "1", "--stop-after", "3")
    first = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(2)]
    run("--epochs", "2", "--resume")
    rest = [json.loads((tmp_path / f"node{r}-resumed.json").read_text()) for r in range(2)]
    for k in range(2):
        part = list(range(k * N // 2, (k + 1) * N // 2))
        assert len(first[k]["epochs"][0]) == 12
        assert sorted(first[k]["epochs"][0] + rest[k]["epochs"][0]) == part, "the rest of its part, once"
        # The calls are counted in files both runs add to: those of the first run, and then of both.
        assert sorted(rest[k]["calls"]) == part and first[k]["computed"][0] + rest[k]["computed"][0] == 24, \
            "each sample of its part computed once"
        assert rest[k]["modes"] == ["generate", "read"]
    assert sorted(i for r in rest for i in r["epochs"][1]) == list(range(N))
    stores_hold_everything(prefixes)


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
def test_streams_on_two_nodes_publish_each_nodes_generation_and_a_second_job_computes_nothing(tmp_path, weed,
                                                                                              remote_url):
    # Each node's store holds its own ranks' streams, so each node publishes under its own place of the
    # remote (<remote>/node-<k>-of-2); a second job on fresh local prefixes fetches its node's generation.
    stream_script = Path(__file__).parents[1] / "loader" / "streams" / "ranks_script.py"

    def job(name: str) -> list[dict]:
        # One OUT for both (the stream's log path in it is part of its identity), a prefix each.
        port, out = free_port(), tmp_path
        procs = [subprocess.Popen([str(TORCHRUN), "--nnodes=2", "--nproc_per_node=1", f"--node_rank={k}",
                                   "--master_addr=127.0.0.1", f"--master_port={port}", "--local_addr=127.0.0.1",
                                   str(stream_script), str(out), "--sizes", "30,20", "--epochs", "2", "--workers", "1",
                                   "--prefix", str(out / name / f"node{k}"), "--remote", remote_url],
                                  env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
                 for k in range(2)]
        for code, err in finish(procs):
            assert code == 0, err[-3000:]
        return [json.loads((out / f"rank{r}.json").read_text()) for r in range(2)]

    first, second = job("first"), job("second")
    for r, size in enumerate((30, 20)):
        mine = sorted(r * 1000 + k for k in range(size))
        assert first[r]["computed"] == [size, 0]
        assert second[r]["computed"] == [0, 0], "the second job fetched its node's generation"
        assert [sorted(e) for e in first[r]["epochs"] + second[r]["epochs"]] == [mine] * 4


def test_a_node_killed_before_publishing_has_its_part_computed_by_the_other(tmp_path, weed, remote_url):
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]

    def node(k: int, *extra: str) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), str(prefixes[k]), remote_url,
                                 "--node", str(k), "--nodes", "2", "--epochs", "2", "--part-timeout", "3", *extra],
                                env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    killed = node(1, "--kill-at", str(N - 3))  # in its own part (24..47), after some of it was computed
    (code, err), = finish([killed])
    assert code == -9, err[-3000:]
    (code, err), = finish([node(0)])
    assert code == 0, err[-3000:]
    result = json.loads((tmp_path / "node0.json").read_text())
    assert result["calls"] == list(range(N))  # its own part, then the dead node's
    assert result["modes"] == ["generate", "read"]
    stores_hold_everything(prefixes[:1])
    # The killed node, run again, finds the generation complete on the remote and fetches it.
    (code, err), = finish([node(1)])
    assert code == 0, err[-3000:]
    again = json.loads((tmp_path / "node1.json").read_text())
    assert again["modes"] == ["read", "read"] and again["computed"] == [0, 0]
    stores_hold_everything(prefixes)


@long
def test_nodes_that_cannot_reach_the_remote_each_compute_everything(tmp_path, weed, remote_url):
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), str(prefixes[k]), remote_url, "--node",
                               str(k), "--nodes", "2", "--epochs", "2", "--start-timeout", "1"],
                              env=node_env(weed, "http://127.0.0.1:9"), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for k in range(2)]
    for code, err in finish(procs):
        assert code == 0, err[-3000:]
        assert err.count("cannot be reached") == 1  # one warning
    results = [json.loads((tmp_path / f"node{k}.json").read_text()) for k in range(2)]
    for r in results:
        assert r["calls"] == list(range(N))  # its part served, the rest computed unserved
        assert r["modes"] == ["generate", "read"] and len(r["epochs"][0]) == len(r["epochs"][1]) == N // 2
    assert sorted(results[0]["epochs"][1] + results[1]["epochs"][1]) == list(range(N))
    stores_hold_everything(prefixes)


def test_server_stopped_while_a_node_waits_for_the_others_part(tmp_path, weed, remote_url):
    from cachestore.remote import open_remote

    from .conftest import options

    prefix = tmp_path / "node0" / "cache"
    node = subprocess.Popen([sys.executable, str(SCRIPT), str(tmp_path), str(prefix), remote_url, "--node", "0",
                             "--nodes", "2", "--epochs", "2", "--part-timeout", "120", "--retry-timeout", "2"],
                            env=node_env(weed), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        while not any(0 in g.published for g in _generations(open_remote, remote_url, options(weed))):  # its part is out: it waits for part 1
            assert node.poll() is None and time.monotonic() < deadline, node.communicate()[1][-3000:]
            time.sleep(0.1)  # another process's progress on the server: nothing to wait on but a look
        weed.stop()
        (code, err), = finish([node])
    finally:
        if weed.proc is None:
            weed.start()
    assert code == 0, err[-3000:]
    assert "computing the 24 samples this node lacks" in err
    result = json.loads((tmp_path / "node0.json").read_text())
    assert result["calls"] == list(range(N)) and result["modes"] == ["generate", "read"]
    stores_hold_everything([prefix])


def _generations(open_remote, url, opts):
    try:
        return open_remote(url, opts).remote_generations()  # the root's one store, once it is there
    except (OSError, ValueError):
        return []


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@long
def test_one_node_of_two_ranks_publishes_what_it_computed(tmp_path, weed, remote_url):
    from cachestore.remote import open_remote

    from .conftest import options

    prefix = tmp_path / "cache"
    run = subprocess.run([str(TORCHRUN), "--standalone", "--nproc_per_node=2", str(SCRIPT), str(tmp_path), str(prefix),
                          remote_url, "--epochs", "2"], env=node_env(weed), capture_output=True, text=True, timeout=240)
    assert run.returncode == 0, run.stderr[-3000:]
    results = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(2)]
    assert sorted(results[0]["calls"] + results[1]["calls"]) == list(range(N))  # the ranks split the work
    assert all(r["modes"] == ["generate", "read"] for r in results)
    stores_hold_everything([prefix])
    with open_store(prefix, readonly=True) as store:
        assert open_remote(remote_url, options(weed), local=store).generation_ids() == [0]  # whichever committed


@pytest.mark.skipif(not TORCHRUN.exists(), reason="torchrun is not installed next to this Python")
@pytest.mark.parametrize("stopped_in", ["generate", pytest.param("read", marks=long)])
def test_an_epoch_of_nodes_resumes_on_another_number_of_ranks(tmp_path, weed, remote_url, stopped_in):
    # Two nodes of one rank stop after 3 batches of the generate epoch (computed in parts) or of the read
    # epoch after it; rank 0's state is loaded on every rank of two nodes of two ranks each. The epoch goes
    # on where the two ranks stopped (each sample served once across both runs, none computed twice). On
    # one node the state is refused, saying why: the nodes split the generation by their number.
    prefixes = [tmp_path / f"node{k}" / "cache" for k in range(2)]

    def run(nodes: int, per_node: int, *extra: str) -> list[tuple[int, str]]:
        port = free_port()
        return finish([subprocess.Popen([str(TORCHRUN), f"--nnodes={nodes}", f"--nproc_per_node={per_node}",
                                         f"--node_rank={k}", "--master_addr=127.0.0.1", f"--master_port={port}",
                                         "--local_addr=127.0.0.1", str(SCRIPT), str(tmp_path), str(prefixes[k]),
                                         remote_url, *extra], env=node_env(weed), stdout=subprocess.PIPE,
                                        stderr=subprocess.PIPE, text=True)
                       for k in range(nodes)])

    e = 0 if stopped_in == "generate" else 1
    for code, err in run(2, 1, "--epochs", str(e + 1), "--stop-after", "3", "--stop-epoch", str(e)):
        assert code == 0, err[-3000:]
    first = [json.loads((tmp_path / f"node{r}.json").read_text()) for r in range(2)]
    if not e:
        (code, err), = run(1, 1, "--epochs", "2", "--resume-from", "0")
        assert code != 0 and "taken on a job of another number of nodes (2; this one has 1)" in err, err[-3000:]
    for code, err in run(2, 2, "--epochs", str(2 - e), "--resume-from", "0"):
        assert code == 0, err[-3000:]
    rest = [json.loads((tmp_path / f"node{r}-resumed.json").read_text()) for r in range(4)]
    served = [i for r in first for i in r["epochs"][e]] + [i for r in rest for i in r["epochs"][0]]
    assert sorted(served) == list(range(N)), "the rest of the epoch, each sample once"
    assert len({len(r["epochs"][0]) for r in rest}) == 1, "every rank serves as many batches"
    if not e:
        for k in range(2):  # each node the rest of its own part
            assert sorted(first[k]["epochs"][0] + rest[2 * k]["epochs"][0] + rest[2 * k + 1]["epochs"][0]) == list(
                range(k * N // 2, (k + 1) * N // 2))
    calls = [c for r in rest for c in r["calls"]]  # those of both runs (the files are added to)
    assert sorted(calls) == list(range(N)), "each sample computed once"
    assert all(r["modes"] == ["generate", "read"][e:] for r in rest)
    if not e:  # the next epoch reads the whole
        assert sorted(i for r in rest for i in r["epochs"][1]) == list(range(N))
    stores_hold_everything(prefixes)
