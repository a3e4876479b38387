"""Read orders of cached epochs: random, block, auto; and a generation larger than memory read with explicit I/O.

Every order serves each index once per epoch, is the same for the same (seed, epoch), changes from
epoch to epoch, resumes through state_dict(), and works per consumer.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import loader.cache.controller as controller
from loader import CachedLoader

from ..datasets import ArangeDataset

pytestmark = pytest.mark.timeout(180)
ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(params=[False, True], ids=["fits", "larger-than-memory"])
def larger(request, monkeypatch):
    """Whether generations look larger than the memory room (then streamed, in block order by default)."""
    if request.param:
        monkeypatch.setattr(controller, "fits", lambda nbytes, fraction=0.5: False)
    return request.param


def epochs(loader, n: int) -> list[list[int]]:
    return [[int(y) for batch in loader for y in batch["y"]] for _ in range(n)]


@pytest.mark.parametrize("backend", ["memmap", "lmdb", "memory"])
@pytest.mark.parametrize("workers", [0, 2])
def test_block_order_serves_each_index_once_differently_every_epoch(tmp_path, larger, backend, workers):
    n = 700  # 48 KiB samples: blocks of 22, a window of 16 blocks holds 352
    settings = dict(batch_size=32, nb_worker=workers, seed=4,
                    cache_setting={"prefix": str(tmp_path / "c"), "backend": backend, "read_order": "block"})
    with CachedLoader(ArangeDataset(n, shape=(3, 64, 64)), **settings) as loader:
        served = epochs(loader, 4)
        stats = loader.epoch_stats
    for order in served:
        assert sorted(order) == list(range(n))
    assert len({tuple(order) for order in served[1:]}) == 3
    assert [s.extra.get("read_order") for s in stats] == [None, "block", "block", "block"]
    stream = larger and backend == "memmap"
    assert {s.extra["gather"] for s in stats[1:]} == ({"stream"} if stream else {s.extra["gather"] for s in stats[1:]})
    # Blocks: neighbours in the order mostly come from few blocks, and a batch mixes several.
    first = np.array(served[1])
    batch = first[:32] // 22
    assert 2 <= len(np.unique(batch)) <= 16
    with CachedLoader(ArangeDataset(n, shape=(3, 64, 64)), **settings) as again:
        assert epochs(again, 4)[1:] == served[1:]  # the same seed, the same orders


def test_block_order_resumes_through_the_state(tmp_path, larger):
    settings = dict(batch_size=16, nb_worker=0, seed=9,
                    cache_setting={"prefix": str(tmp_path / "c"), "read_order": "block"})
    dataset = ArangeDataset(300, shape=(3, 64, 64))
    with CachedLoader(dataset, **settings) as loader:
        whole = epochs(loader, 3)
    with CachedLoader(dataset, **settings) as loader:
        epochs(loader, 1)
        it = iter(loader)
        head = [int(y) for _ in range(5) for y in next(it)["y"]]
        state = loader.state_dict()
        it.close()
    with CachedLoader(dataset, **settings) as loader:
        loader.load_state_dict(state)
        rest = epochs(loader, 2)
    assert head + rest[0] == whole[1] and rest[1] == whole[2]


@pytest.mark.parametrize("scope", ["node", "rank"])
def test_block_order_per_consumer(tmp_path, larger, scope):
    per_rank = []
    for rank in range(2):
        with CachedLoader(ArangeDataset(200, shape=(3, 64, 64)), batch_size=10, nb_worker=0, seed=2, nb_consumer=2,
                          consumer_index=rank, cache_setting={"prefix": str(tmp_path / "c"), "read_order": "block",
                                                              "scope": scope}) as loader:
            served = epochs(loader, 3)
            assert served[1] != served[2]
            if scope == "rank":  # each rank keeps its part; the node's ranks split a new one every epoch
                assert all(sorted(e) == sorted(served[0]) for e in served)
            per_rank.append(served)
    for epoch in range(3):
        halves = [set(per_rank[r][epoch]) for r in range(2)]
        assert halves[0] | halves[1] == set(range(200)) and not halves[0] & halves[1]
    assert (set(per_rank[0][1]) != set(per_rank[0][2])) == (scope == "node")


@pytest.mark.parametrize("workers", [0, 2])
def test_auto_is_random_when_it_fits_and_block_when_it_does_not(tmp_path, larger, caplog, workers):
    caplog.set_level(logging.INFO, logger="loader")
    with CachedLoader(ArangeDataset(120, shape=(3, 64, 64)), batch_size=16, nb_worker=workers,
                      cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        for order in epochs(loader, 3):
            assert sorted(order) == list(range(120))
        assert [s.extra.get("read_order") for s in loader.epoch_stats][1:] == ["block" if larger else "random"] * 2
    said = [r.getMessage() for r in caplog.records if "memory room" in r.getMessage()]
    assert len(said) == 1 and ("does not fit" in said[0]) == larger


def test_random_order_streams_when_it_does_not_fit(tmp_path, monkeypatch):
    monkeypatch.setattr(controller, "fits", lambda nbytes, fraction=0.5: False)
    with CachedLoader(ArangeDataset(150, shape=(3, 64, 64)), batch_size=16, nb_worker=2, seed=1,
                      cache_setting={"prefix": str(tmp_path / "c"), "read_order": "random"}) as loader:
        served = epochs(loader, 3)
        assert [s.extra.get("gather") for s in loader.epoch_stats[1:]] == ["stream", "stream"]
    assert all(sorted(e) == list(range(150)) for e in served) and served[1] != served[2]


class BadCrop(Exception):
    pass


def failing_transform(sample, rng):
    if sample["y"] == 7:
        raise BadCrop("sample 7 cannot be cropped")
    return sample


def test_a_read_transform_error_of_a_streamed_epoch_is_raised_as_itself(tmp_path, monkeypatch):
    monkeypatch.setattr(controller, "fits", lambda nbytes, fraction=0.5: False)
    settings = dict(batch_size=8, nb_worker=0, seed=1, cache_setting={"prefix": str(tmp_path / "c")})
    with CachedLoader(ArangeDataset(40, shape=(3, 8, 8)), **settings) as loader:
        epochs(loader, 1)
    with CachedLoader(ArangeDataset(40, shape=(3, 8, 8)), read_transform=failing_transform, **settings) as loader:
        with pytest.raises(BadCrop, match="sample 7") as caught:
            epochs(loader, 1)
        assert loader.epoch_stats[-1].extra.get("gather") == "stream"
    assert any("sample 7" in note or "index 7" in note for note in getattr(caught.value, "__notes__", []))


# ---------------------------------------------------------------------------- a real memory limit
READER = """
import json, sys
from loader import CachedLoader
from tests.loader.datasets import ArangeDataset
from cachestore.space.room import memory_room

with CachedLoader(ArangeDataset(int(sys.argv[2]), shape=(3, 64, 64)), batch_size=64, nb_worker=0, seed=0,
                  cache_setting={"prefix": sys.argv[1]}) as loader:
    out = []
    for _ in range(2):
        ys = sorted(int(y) for batch in loader for y in batch["y"])
        s = loader.epoch_stats[-1]
        out.append([s.mode, s.extra.get("read_order"), s.extra.get("gather"), ys == list(range(int(sys.argv[2])))])
print(json.dumps({"room": memory_room(), "epochs": out}))
"""


def _child_cgroup(limit: int) -> Path:
    """A child memory cgroup of this process's own (v1 or v2), with `limit` bytes; skips when refused."""
    if os.geteuid() != 0:
        pytest.skip("creating a memory cgroup needs root")
    lines = Path("/proc/self/cgroup").read_text().splitlines()
    v1 = next((line.split(":", 2)[2] for line in lines if "memory" in line.split(":")[1].split(",")), None)
    if v1 is not None and Path("/sys/fs/cgroup/memory").is_dir():
        base, limit_file = Path("/sys/fs/cgroup/memory") / v1.strip("/"), "memory.limit_in_bytes"
    else:
        v2 = next((line.split(":", 2)[2] for line in lines if line.startswith("0::")), None)
        if v2 is None:
            pytest.skip("no memory cgroup found for this process")
        base, limit_file = Path("/sys/fs/cgroup") / v2.strip("/"), "memory.max"
    child = base / f"cachestore-test-{os.getpid()}"
    try:
        child.mkdir()
        (child / limit_file).write_text(str(limit))
    except OSError as exc:
        if child.exists():
            child.rmdir()
        pytest.skip(f"cannot create a memory cgroup under {base}: {exc}")
    return child


@pytest.mark.timeout(300)
def test_a_generation_three_times_the_memory_limit_is_read_in_blocks(tmp_path):
    limit, n = 160 << 20, 10_000  # 10,000 samples of 48 KiB: about 3 times the limit
    prefix = str(tmp_path / "c")
    with CachedLoader(ArangeDataset(n, shape=(3, 64, 64)), batch_size=256, nb_worker=0, seed=0,
                      cache_setting={"prefix": prefix}) as loader:
        for _ in loader:
            pass
    child = _child_cgroup(limit)
    try:
        script = f"echo $$ > {child}/cgroup.procs && exec {sys.executable} -c '{READER}' {prefix} {n}"
        done = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=250, cwd=ROOT,
                              env={**os.environ, "PYTHONPATH": str(ROOT)})
    finally:
        for _ in range(50):  # the child has exited; the kernel may take a moment to release it
            try:
                child.rmdir()
                break
            except OSError:
                subprocess.run(["sync"], check=False)
    assert done.returncode == 0, done.stderr[-3000:]
    import json

    report = json.loads(done.stdout.strip().splitlines()[-1])
    assert report["room"] < limit
    assert report["epochs"] == [["read", "block", "stream", True]] * 2


@pytest.mark.parametrize("kwargs, used", [({"shuffle": False}, "sequential"), ({"nearby_shuffle": 8}, "nearby"),
                                          ({"sampler": range(39, -1, -1)}, "sampler")])
def test_stats_say_which_order_an_epoch_served_in(tmp_path, kwargs, used):
    # The block order applies to a plain shuffle; what overrides it is what the stats report.
    with CachedLoader(ArangeDataset(40), batch_size=8, nb_worker=0, seed=1,
                      cache_setting={"prefix": str(tmp_path / "c"), "read_order": "block"}, **kwargs) as loader:
        epochs(loader, 2)
        assert loader.epoch_stats[1].extra["read_order"] == used
