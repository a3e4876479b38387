"""Resumable runs: state_dict() mid-epoch, a fresh process continues the exact stream."""

from __future__ import annotations

import collections
import json
import os
import pickle
import subprocess
import sys

import pytest

from loader import CachedLoader

from ..marks import covering, long
from .datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(180)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def leg(tmp, name, setting, load=None, stop_after=None, epochs=5, die=False, stats=False):
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "tests.loader.resume_script", str(out), "--setting", json.dumps(setting),
           "--epochs", str(epochs)]
    if load is not None:
        state_file = tmp / f"{name}.state"
        state_file.write_bytes(pickle.dumps(load))
        cmd += ["--load", str(state_file)]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    if die:
        cmd += ["--die"]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    if stats:
        return doc["stream"], pickle.loads(bytes.fromhex(doc["state"])), doc["stats"]
    return doc["stream"], pickle.loads(bytes.fromhex(doc["state"]))


SETTINGS = {
    "memmap-0": {"backend": "memmap", "nb_worker": 0},
    "memmap-2": {"backend": "memmap", "nb_worker": 2},
    "lmdb-0": {"backend": "lmdb", "nb_worker": 0},
    "memory-0": {"backend": "memory", "nb_worker": 0},
}


def setting_for(tmp, backend, nb_worker, name):
    return {"params": {"n": 37, "shape": [2]}, "batch_size": 5, "nb_worker": nb_worker, "seed": 11,
            "cache": {"prefix": str(tmp / name), "update_frequency": 2, "backend": backend}}


# Stopped mid generate, at the first batch of a read, ..., at an epoch boundary.
@covering("stop_after,case", [3, 8, 17, 19], list(SETTINGS))
def test_resumed_stream_equals_the_uninterrupted_one(no_leaks, case, stop_after):
    backend, nb_worker = SETTINGS[case]["backend"], SETTINGS[case]["nb_worker"]
    golden, _ = leg(no_leaks, "golden", setting_for(no_leaks, backend, nb_worker, "golden"))
    setting = setting_for(no_leaks, backend, nb_worker, "resumed")
    first, state = leg(no_leaks, "first", setting, stop_after=stop_after)
    assert len(first) == stop_after
    second, _ = leg(no_leaks, "second", setting, load=state)
    resumed = first + second
    assert [(e, idx) for e, _, idx, _ in resumed] == [(e, idx) for e, _, idx, _ in golden]
    assert [v for *_, v in resumed] == [v for *_, v in golden]  # values: index-encoded, from the same generation
    modes = [m for _, m, _, _ in golden]
    assert modes.count("generate") and modes.count("read")


@pytest.mark.parametrize("case", ["memmap-2", "lmdb-0", pytest.param("memmap-0", marks=long),
                                  pytest.param("lmdb-2", marks=long)])
def test_resume_mid_generate_epoch_adopts_what_was_written(no_leaks, case):
    """Random augmentation: a recomputed sample would differ, so equal values prove adoption."""
    backend, workers = case.split("-")
    nb_worker = int(workers)
    calls, golden_calls = no_leaks / "calls", no_leaks / "golden-calls"
    calls.mkdir()
    golden_calls.mkdir()

    def setting(name, counter):
        s = setting_for(no_leaks, backend, nb_worker, name)
        s["params"].update(augment=True, counter_dir=str(counter))
        s["cache"]["background_refresh"] = False  # the call counts below are those of write-through
        return s

    golden, _ = leg(no_leaks, "golden", setting("golden", golden_calls))
    first, state, first_stats = leg(no_leaks, "first", setting("resumed", calls), stop_after=3, stats=True)
    called_first = collections.Counter(read_calls(str(calls)))
    second, _, stats = leg(no_leaks, "second", setting("resumed", calls), load=state, stats=True)
    called_second = collections.Counter(read_calls(str(calls))) - called_first
    resumed = first + second
    assert [(e, idx) for e, _, idx, _ in resumed] == [(e, idx) for e, _, idx, _ in golden]
    # Generation 0 is written in epoch 0 and read in epoch 1 (K=2): every value epoch 1 serves is the
    # one epoch 0 delivered - those of the first leg included, so its samples were adopted, not recomputed.
    served = {e: {} for e in (0, 1)}
    for e, _, idx, vals in resumed:
        if e in served:
            served[e].update(zip(idx, vals))
    assert len(served[0]) == 37 and served[1] == served[0]
    # Dataset calls: generation 0 took exactly 37 in all, each sample once, across the two processes.
    epoch0 = stats[0]
    assert (epoch0[0], epoch0[1], epoch0[5]) == (0, "generate", True)
    adopted = epoch0[4]
    assert adopted >= 15 and epoch0[2] == 37 - adopted and epoch0[3] == 22 - epoch0[2]
    assert sum(called_first.values()) == adopted, "every sample the first leg computed was kept"
    assert first_stats[0][2] >= 15  # it served 15; workers computed (and wrote) ahead
    # Then generations 1 and 2 (epochs 2 and 4), each computed once; read epochs compute nothing.
    assert sum(called_second.values()) == 37 - adopted + 2 * 37
    assert [s[2] for s in stats[1:]] == [0, 37, 0, 37]


def test_rotation_resumes_mid_epoch(no_leaks):
    setting = {"params": {"n": 23, "shape": [2]}, "batch_size": 4, "nb_worker": 0, "seed": 5,
               "rotation": {"medium": "memory", "rotation": 3, "size": 6}}
    golden, _ = leg(no_leaks, "golden", setting, epochs=2)
    first, state = leg(no_leaks, "first", setting, stop_after=7, epochs=2)
    second, _ = leg(no_leaks, "second", setting, load=state, epochs=2)
    assert [(e, idx, v) for e, _, idx, v in first + second] == [(e, idx, v) for e, _, idx, v in golden]


@pytest.mark.parametrize("die", [True, False])
def test_a_disk_rotation_window_survives_a_stopped_run(no_leaks, die):
    """Stopped right after its checkpoint (preempted), the window is adopted: nothing is computed twice."""
    calls = no_leaks / "calls"
    calls.mkdir()
    window = no_leaks / "window"
    setting = {"params": {"n": 23, "shape": [2], "counter_dir": str(calls)}, "batch_size": 4, "nb_worker": 0,
               "seed": 5, "rotation": {"medium": "disk", "rotation": 3, "size": 6, "prefix": str(window)}}
    golden_setting = {**setting, "params": {"n": 23, "shape": [2]},
                      "rotation": {**setting["rotation"], "prefix": str(no_leaks / "golden-window")}}
    golden, _ = leg(no_leaks, "golden", golden_setting, epochs=1)
    first, state = leg(no_leaks, "first", setting, stop_after=7, epochs=1, die=die)
    first_calls = len(read_calls(str(calls)))
    second, _ = leg(no_leaks, "second", setting, load=state, epochs=1)
    assert [(e, idx, v) for e, _, idx, v in first + second] == [(e, idx, v) for e, _, idx, v in golden]
    total = len(read_calls(str(calls)))
    if die:
        assert total == 23, "the adopted window's samples were computed again"
    else:
        assert total > 23 and first_calls < 23  # closed normally: the window is gone, the epoch replays it
    assert not [p for p in window.iterdir() if p.name.startswith("rotation-")] if window.exists() else True


def test_state_is_small_plain_and_pickles(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 3}) as cached:
        it = iter(cached)
        next(it)
        next(it)
        state = cached.state_dict()
    assert state["epoch"] == 0 and state["batches_served"] == 2
    assert len(pickle.dumps(state)) < 4096
    json.dumps(state)  # plain values only


def test_between_epochs_the_state_points_at_the_next_epoch(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0) as cached:
        list(cached)
        assert cached.epoch == 0
        state = cached.state_dict()
        assert (state["epoch"], state["batches_served"]) == (1, 0)
        cached.set_epoch(5)
        assert cached.epoch == 5
        list(cached)
        assert cached.epoch_stats[-1].epoch == 5 and cached.epoch == 5


@pytest.mark.parametrize("change,name", [
    ({"batch_size": 3}, "batch_size"),
    ({"dataset_params": {"n": 21}}, "dataset"),
    ({"cache_setting": {"update_frequency": 4}}, "update_frequency"),
    ({"nb_consumer": 2, "consumer_index": 1, "cache_setting": {"scope": "rank"}}, "nb_consumer"),
    ({"seed": 99}, "seed"),
])
def test_a_state_from_other_arguments_is_refused(tmp_path, change, name):
    def build(**kw):
        args = {"dataset_params": {"n": 20}, "batch_size": 4, "nb_worker": 0, "seed": 1,
                "cache_setting": {"prefix": str(tmp_path / "c"), "update_frequency": 3}}
        for key, value in kw.items():
            args[key] = {**args[key], **value} if isinstance(value, dict) and key in args else value
        return CachedLoader(ArangeDataset, **args)

    with build() as cached:
        state = cached.state_dict()
    with build(**change) as other:
        with pytest.raises(ValueError, match=name):
            other.load_state_dict(state)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_loads_into_a_loader_that_has_iterated(tmp_path, workers):
    # As torchdata's loader: a rewind (or a reload after a failed step) takes effect at the next iter(),
    # and the live iterator ends (it serves nothing more).
    with CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=workers, seed=1) as loader:
        start = loader.state_dict()
        first = [b["y"].tolist() for b in loader]
        it = iter(loader)
        middle = [next(it)["y"].tolist() for _ in range(2)]
        state = loader.state_dict()
        second = middle + [b["y"].tolist() for b in it]
        loader.load_state_dict(start)
        assert [b["y"].tolist() for b in loader] == first
        it = iter(loader)
        next(it)
        loader.load_state_dict(state)
        assert next(it, None) is None  # ended, as a closed generator
        assert middle + [b["y"].tolist() for b in loader] == second


def test_a_cached_loaders_state_taken_before_it_iterated_loads_into_one_that_has(tmp_path):
    # Taken before the first iter(), the state has no cache plan yet: loaded, the loader plans as a new
    # one does (here: it reads the generation the first one wrote) and serves that epoch from its start.
    def make():
        return CachedLoader(ArangeDataset, {"n": 20}, batch_size=4, nb_worker=2, seed=1,
                            cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2})

    with make() as first:
        start = first.state_dict()
        expected = [b["y"].tolist() for b in first]
    with make() as loader:
        it = iter(loader)
        for _ in range(3):
            next(it)
        loader.load_state_dict(start)
        assert loader.state_dict() == start
        assert [b["y"].tolist() for b in loader] == expected
        assert loader.epoch_stats[-1].mode == "read"


def test_a_state_taken_after_the_last_batch_resumes_the_rest_of_that_epoch():
    # As torchdata's: inside the loop after its last batch, the epoch's rest (nothing) comes first, then the
    # next epoch; after the loop, the next epoch.
    def build():
        return CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=0, seed=2)

    with build() as loader:
        for _ in loader:
            inside = loader.state_dict()
        after = loader.state_dict()
        following = [b["y"].tolist() for b in loader]
    assert (inside["epoch"], inside["batches_served"], after["epoch"], after["batches_served"]) == (0, 3, 1, 0)
    with build() as resumed:
        resumed.load_state_dict(inside)
        assert list(resumed) == [] and [b["y"].tolist() for b in resumed] == following
    with build() as resumed:
        resumed.load_state_dict(after)
        assert [b["y"].tolist() for b in resumed] == following


def test_a_state_taken_after_break_resumes_the_rest_of_that_epoch(tmp_path):
    def build():
        return CachedLoader(ArangeDataset, {"n": 30}, batch_size=4, nb_worker=0, seed=3,
                            cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2})

    with build() as golden:
        expected = [b["y"].tolist() for b in golden]
    prune = __import__("cachestore").open_store(tmp_path / "c")
    prune.prune(keep=0)
    prune.close()
    with build() as first:
        served = []
        for batch in first:  # the loop's own iterator is gone once it breaks
            served.append(batch["y"].tolist())
            if len(served) == 3:
                break
        state = first.state_dict()
    assert (state["epoch"], state["batches_served"]) == (0, 3)
    with build() as second:
        second.load_state_dict(state)
        served += [b["y"].tolist() for b in second]
    assert served == expected


def test_every_rank_resumes_its_own_part(tmp_path):
    """Two consumers (ranks), each with its own state: resumed together, they continue in step."""
    def build(rank, prefix):
        return CachedLoader(ArangeDataset, {"n": 30}, batch_size=4, nb_worker=0, seed=9, nb_consumer=2,
                            consumer_index=rank, cache_setting={"prefix": str(prefix), "update_frequency": 2,
                                                                "scope": "rank"})

    def stream(loader, epochs, stop=None):
        out = []
        for _ in range(epochs):
            for batch in loader:
                out.append((loader.epoch, batch["y"].tolist()))
                if stop is not None and len(out) == stop:
                    return out
        return out

    golden = {}
    for rank in (0, 1):
        with build(rank, tmp_path / "golden") as loader:
            golden[rank] = stream(loader, 3)
    states, first = {}, {}
    for rank in (0, 1):
        with build(rank, tmp_path / "run") as loader:
            first[rank] = stream(loader, 3, stop=5)
            states[rank] = loader.state_dict()
    assert states[0]["arguments"]["consumer_index"] == 0 and states[1]["arguments"]["consumer_index"] == 1
    with build(0, tmp_path / "run") as other:
        with pytest.raises(ValueError, match="consumer_index"):
            other.load_state_dict(states[1])
    for rank in (0, 1):
        with build(rank, tmp_path / "run") as loader:
            loader.load_state_dict(states[rank])
            rest = stream(loader, 3 - loader.epoch)
        assert first[rank] + rest == golden[rank]
    assert len(golden[0]) == len(golden[1])  # the same number of batches on every rank


@pytest.mark.parametrize("order", ["block", "random"])
def test_a_generate_epochs_state_resumed_once_its_generation_is_committed_keeps_its_order(tmp_path, order):
    # Another loader on the prefix completes and commits the generation after the stop, so the resumed
    # epoch reads. It serves the rest of the order the generate epoch began in, not a block order of its
    # own (which served samples 2 and 10 again and never 0 and 1).
    def loader(workers: int) -> CachedLoader:
        return CachedLoader(ArangeDataset, {"n": 14, "shape": [1]}, batch_size=3, num_workers=workers, seed=9,
                            cache_setting={"prefix": str(tmp_path / "c"), "read_order": order})

    with loader(1) as first:
        it = iter(first)
        head = [y for _ in range(4) for y in next(it)["y"].tolist()]
        state = first.state_dict()
    with loader(0) as other:
        list(other)
        assert other.store.latest() == 0  # committed (by the first loader at close, or by this one)
    with loader(0) as resumed:
        resumed.load_state_dict(state)
        rest = [y for b in resumed for y in b["y"].tolist()]
        assert resumed.epoch_stats[-1].mode.value == "read"
    assert sorted(head + rest) == list(range(14)), (head, rest)


def test_a_damaged_ranks_history_or_block_order_is_refused(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, seed=1,
                      cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        list(loader)
        state = loader.state_dict()
    for name, bad in (("ranks_history", [[0, 1]]), ("ranks_history", [[2, 9]]), ("ranks_history", "x"),
                      ("ranks_history", [[2, 1], [1, 0]]), ("block_order", "yes")):
        with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0, seed=1,
                          cache_setting={"prefix": str(tmp_path / "c")}) as other:
            with pytest.raises(ValueError, match=name):
                other.load_state_dict({**state, name: bad})


def test_a_version_1_state_loads_unless_it_holds_a_streams_position():
    def make():
        return CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=0, seed=2)

    with make() as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        rest = [b["y"].tolist() for b in it]
    assert state["version"] == 2
    old = {**state, "version": 1}
    with make() as loader:
        loader.load_state_dict(old)
        assert [b["y"].tolist() for b in loader] == rest
    with make() as loader, pytest.raises(ValueError, match="version 1.*format this version no longer reads"):
        loader.load_state_dict({**old, "stream": {"states": [{"i": 3}], "ended": [False], "next": 0, "arrived": 4}})
