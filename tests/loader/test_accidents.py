"""Ordinary accidents a new user meets: each handled, with a clear word where something cannot be done.

set_epoch going back, damaged states, a read-only cache, two Ctrl-C, the prefix removed during an
epoch, a generation pruned under a reader, ``~`` in a prefix, an unreachable Ray cluster, and an
iterator a framework starts and drops.
"""

from __future__ import annotations

import glob
import json
import logging
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from cachestore import CacheStoreError, GenerationNotFoundError, open_store
from loader import CachedLoader
from loader.errors import ClusterUnreachableError

from .conftest import kept_partial, partials
from .datasets import ArangeDataset, read_calls

ROOT = Path(__file__).resolve().parents[2]


def served(loader: CachedLoader) -> list[int]:
    return sorted(int(y) for batch in loader for y in batch["y"])


# ---------------------------------------------------------------------------- set_epoch going back
@pytest.mark.timeout(120)
@pytest.mark.parametrize("sequence, generations", [
    ([0, 1, 2, 3, 4, 0, 5], [0, 0, 0, 0, 0, 0, 1]),
    ([10, 4, 10, 11], [2, 2, 2, 2]),  # epoch 4's generation 0 was never written: it reads this run's
])
def test_set_epoch_going_back_reads_this_runs_generations(no_leaks, caplog, sequence, generations):
    caplog.set_level(logging.INFO, logger="loader")
    with CachedLoader(ArangeDataset, {"n": 40, "shape": [2]}, batch_size=8, nb_worker=2, seed=0,
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": 5}) as loader:
        for epoch in sequence:
            loader.set_epoch(epoch)
            assert served(loader) == list(range(40))
        assert [s.generation for s in loader.epoch_stats] == generations
    assert "another run" not in caplog.text  # it is this run that moved ahead


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cache", [False, True])
def test_an_epoch_broken_off_then_served_again_takes_none_of_its_old_results(no_leaks, cache):
    # The broken-off run's tasks are still running when the same epoch starts over: their results carry
    # the same (epoch, batch) and must not be taken for the new run's.
    cache_setting = {"prefix": str(no_leaks / "c")} if cache else None
    with CachedLoader(ArangeDataset, {"n": 64, "shape": [2], "delay": 0.01}, batch_size=4, nb_worker=2, seed=0,
                      cache_setting=cache_setting) as loader:
        for _ in range(3):
            loader.set_epoch(0)
            next(iter(loader))
        loader.set_epoch(0)
        batches = list(loader)
        assert sorted(int(y) for b in batches for y in b["y"]) == list(range(64))
        assert all(np.array_equal(b["x"][:, 0], b["y"]) for b in batches)


# ---------------------------------------------------------------------------- damaged states
def _state(tmp_path: Path) -> tuple[dict, dict]:
    settings = dict(batch_size=4, nb_worker=0, seed=3, cache_setting={"prefix": str(tmp_path / "c")})
    with CachedLoader(ArangeDataset, {"n": 20}, **settings) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        it.close()
    return state, settings


@pytest.mark.parametrize("field, value", [
    ("batches_served", 10**6), ("batches_served", -1), ("batches_served", "2"), ("epoch", 1.5), ("seed", True),
    ("cache", None), ("cache", {"base": -1, "off": False, "refresh_off": False}),
    ("cache", {"base": 0, "off": "no", "refresh_off": False}),
    ("rotation_fallback", {"medium": "tape", "rotation": 2, "size": 4, "prefix": None}),
    ("rotation_window", 7),
])
def test_a_damaged_state_is_refused_naming_its_field(tmp_path, field, value):
    state, settings = _state(tmp_path)
    state[field] = value
    with CachedLoader(ArangeDataset, {"n": 20}, **settings) as loader:
        with pytest.raises(ValueError, match=field):
            loader.load_state_dict(state)


def test_a_sound_state_is_taken(tmp_path):
    state, settings = _state(tmp_path)
    with CachedLoader(ArangeDataset, {"n": 20}, **settings) as loader:
        loader.load_state_dict(state)
        assert sum(1 for _ in loader) == 5 - state["batches_served"]


class _Locked(ArangeDataset):
    """A dataset holding what cannot be hashed by value (a lock): fine to load, not to fingerprint."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        import threading

        self.lock = threading.Lock()


def test_a_state_of_an_uncached_loader_needs_no_fingerprint_of_its_dataset():
    with CachedLoader(_Locked(20), batch_size=4, nb_worker=0, seed=3) as loader:
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        it.close()
    with CachedLoader(_Locked(20), batch_size=4, nb_worker=0, seed=3) as loader:
        loader.load_state_dict(state)
        assert sum(1 for _ in loader) == 4


# ---------------------------------------------------------------------------- a read-only file system
@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs this test mounts (root only), unmounted at the end."""
    where = tmp_path / "mnt"
    where.mkdir()
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=32m", "tmpfs", str(where)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_cache_on_a_read_only_file_system_is_served_and_nothing_written(tmpfs, caplog, backend, workers):
    prefix = str(tmpfs / "c")
    counter = tmpfs.parent / "calls"
    counter.mkdir()
    params = {"n": 24, "shape": [3], "counter_dir": str(counter)}
    with CachedLoader(ArangeDataset, params, batch_size=8, nb_worker=workers,
                      cache_setting={"prefix": prefix, "backend": backend}) as loader:
        assert served(loader) == list(range(24))
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    caplog.set_level(logging.INFO, logger="loader")
    with CachedLoader(ArangeDataset, params, batch_size=8, nb_worker=workers,
                      cache_setting={"prefix": prefix, "backend": backend, "update_frequency": 2}) as loader:
        for _ in range(3):  # epoch 2 would write generation 1: it reads generation 0
            assert served(loader) == list(range(24))
        assert {s.mode for s in loader.epoch_stats} == {"read"}
    assert "read-only file system" in caplog.text and "nothing is written" in caplog.text
    assert len(read_calls(str(counter))) == 24  # the first run's only


def test_a_read_only_prefix_without_a_cache_says_so(tmpfs):
    subprocess.run(["mount", "-o", "remount,ro", str(tmpfs)], check=True)
    # The store opens at the first iter(), as workers start then (torch's DataLoader starts nothing before).
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": str(tmpfs / "c")}) as loader:
        with pytest.raises(FileNotFoundError, match="read-only file system and holds no cache"):
            iter(loader)


# ---------------------------------------------------------------------------- two Ctrl-C
SIGINT_SCRIPT = """
import sys
from loader import CachedLoader
from tests.loader.datasets import ArangeDataset

with CachedLoader(ArangeDataset, {"n": 200, "delay": 0.01, "counter_dir": sys.argv[2]}, batch_size=8,
                  nb_worker=2, cache_setting={"prefix": sys.argv[1]}) as loader:
    for i, batch in enumerate(loader):
        if i == 3:
            print("ready", flush=True)
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("second", [None, 0.1])
def test_ctrl_c_once_or_twice_keeps_the_partial_generation(tmp_path, second):
    prefix, counter = str(tmp_path / "c"), tmp_path / "calls"
    counter.mkdir()
    proc = subprocess.Popen([sys.executable, "-c", SIGINT_SCRIPT, prefix, str(counter)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGINT)
        if second is not None:
            try:
                proc.wait(timeout=second)  # a timed wait, not a sleep: the process may be gone already
            except subprocess.TimeoutExpired:
                proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert "KeyboardInterrupt" in err
    staged = partials(prefix)
    assert len(staged) == 1 and kept_partial(staged[0]), staged
    # The next run adopts it: the samples it holds are not computed again.
    before = len(read_calls(str(counter)))
    with CachedLoader(ArangeDataset, {"n": 200, "delay": 0.01, "counter_dir": str(counter)}, batch_size=8,
                      nb_worker=0, cache_setting={"prefix": prefix}) as loader:
        assert served(loader) == list(range(200))
        adopted = loader.epoch_stats[0].extra.get("adopted", 0)
    assert adopted >= 24
    assert len(read_calls(str(counter))) - before == 200 - adopted


# ---------------------------------------------------------------------------- the prefix removed
@pytest.mark.timeout(180)
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_removing_the_prefix_during_a_refreshed_epoch_writes_the_next_generation_in_its_epoch(no_leaks, caplog,
                                                                                               backend):
    prefix = str(no_leaks / "c")
    with CachedLoader(ArangeDataset, {"n": 200, "shape": [64]}, batch_size=8, nb_worker=2, seed=0,
                      cache_setting={"prefix": prefix, "backend": backend, "update_frequency": 2}) as loader:
        assert served(loader) == list(range(200))
        seen = []
        for i, batch in enumerate(loader):  # a read epoch, generation 1 refreshed in the background
            seen += batch["y"].tolist()
            if i == 5:
                for _ in range(5):  # workers writing the refresh race rm: run it again, as a user would
                    subprocess.run(["rm", "-rf", prefix], capture_output=True)
                    if not os.path.exists(prefix):
                        break
        assert sorted(seen) == list(range(200))
        for _ in range(2):
            assert served(loader) == list(range(200))
        assert [s.mode for s in loader.epoch_stats] == ["generate", "read", "generate", "read"]
    assert "gave up" in caplog.text or "stops" in caplog.text


# ---------------------------------------------------------------------------- a pruned generation
def test_a_pruned_generation_is_said_to_be_removed_not_being_written(tmp_path):
    store = open_store(tmp_path / "s", "memmap")
    for generation in range(2):
        with store.writer(generation, 2) as w:
            for i in range(2):
                w.put(i, np.zeros(2))
    store.prune(keep=1)
    with pytest.raises(GenerationNotFoundError) as err:
        store.reader(0)
    assert "removed since" in str(err.value) and "being written" not in str(err.value)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_generation_pruned_and_written_again_is_read_anew(no_leaks, backend, workers):
    # Readers kept open from epoch to epoch (the training process's, the workers') must not serve the
    # removed generation's files once it is written again under the same id.
    settings = dict(batch_size=4, nb_worker=workers, seed=0,
                    cache_setting={"prefix": str(no_leaks / "c"), "backend": backend})
    with CachedLoader(ArangeDataset, {"n": 16, "augment": True}, **settings) as loader:
        def values() -> dict[int, float]:
            return {int(y): float(x[0]) for b in loader for x, y in zip(b["x"], b["y"])}

        first = values()
        assert values() == first  # read back
        loader.store.prune(keep=0)
        again = values()  # written again: other random values
        assert [s.mode for s in loader.epoch_stats] == ["generate", "read", "generate"]
        assert again != first
        assert values() == again


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_generation_another_run_replaces_as_an_epoch_opens_it_is_read_from_the_newer_one(no_leaks, workers):
    """The ranks of a node share its store: one that ran ahead commits the next generation and prunes
    the one another rank's epoch is about to open. That epoch reads the rest from the newer one."""
    # No background refresh: the read epoch is the plain one, whose path opens the generation.
    setting = {"prefix": str(no_leaks / "c"), "update_frequency": 2, "background_refresh": False}
    params = {"n": 24}
    with CachedLoader(ArangeDataset, params, batch_size=4, nb_worker=workers, shuffle=True,
                      cache_setting=setting) as slow:
        assert sorted(y for b in slow for y in b["y"].tolist()) == list(range(24))  # generation 0
        reads = slow._runner.ctx.reads
        choose = reads.choose

        def ahead_then_choose(*args, **kwargs):
            reads.choose = choose
            with CachedLoader(ArangeDataset, params, batch_size=4, nb_worker=0, cache_setting=setting) as fast:
                for _ in range(3):  # generation 0 read, then generation 1 written, committed, and 0 pruned
                    list(fast)
                assert [s.generation for s in fast.epoch_stats] == [0, 0, 1]
            assert [g.id for g in slow.store.generations() if g.committed] == [1]
            return choose(*args, **kwargs)

        reads.choose = ahead_then_choose
        batches = list(slow)
        stats = slow.epoch_stats[-1]
        assert sorted(y for b in batches for y in b["y"].tolist()) == list(range(24))
        assert all(np.array_equal(np.asarray(b["x"])[:, 0], np.asarray(b["y"], dtype=np.float32)) for b in batches)
        assert stats.mode.value == "read" and stats.generation == 1 and stats.extra["removed_while_read"] == 0
        assert stats.computed == 0


# ---------------------------------------------------------------------------- "~" in a prefix
def test_a_prefix_starting_with_a_tilde_is_in_the_home_directory(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.chdir(tmp_path)
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0, cache_setting={"prefix": "~/cache"}) as l:
        assert served(l) == list(range(8))
        assert l.store.path == str(tmp_path / "home" / "cache")
    assert (tmp_path / "home" / "cache" / "store.json").exists() and not (tmp_path / "~").exists()
    assert open_store("~/cache", readonly=True).path == str(tmp_path / "home" / "cache")


# ---------------------------------------------------------------------------- an unreachable Ray cluster
@pytest.mark.timeout(60)
@pytest.mark.parametrize("address", ["127.0.0.1:6399", "no-such-host.invalid:6379", "ray://127.0.0.1:6399"])
def test_an_unreachable_ray_address_fails_fast_naming_it(address):
    pytest.importorskip("ray")
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, executor="ray",
                      executor_options={"address": address, "start_timeout": 5}) as loader:
        with pytest.raises(ClusterUnreachableError, match=address.replace(".", r"\.")):
            iter(loader)  # the actors start with the first epoch


# ---------------------------------------------------------------------------- an iterator dropped unused
def test_an_iterator_that_served_nothing_consumes_no_epoch(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0, seed=1,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        for expected in range(4):
            iter(loader)  # started and dropped before the loop, as Lightning's Trainer.fit does
            it = iter(loader)
            assert it.epoch == expected
            assert sorted(y for b in it for y in b["y"].tolist()) == list(range(8))
        assert [s.epoch for s in loader.epoch_stats] == [0, 1, 2, 3]
        assert [s.generation for s in loader.epoch_stats] == [0, 0, 1, 1]


def test_zip_of_one_loader_still_fails_loudly(tmp_path):
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0) as loader:
        with pytest.raises(RuntimeError, match="one epoch at a time"):
            list(zip(loader, loader))


# ---------------------------------------------------------------------------- a lambda in the parameters
LAMBDA_SCRIPT = textwrap.dedent("""
    from loader import CachedLoader
    from tests.loader.datasets import TransformDataset

    if __name__ == "__main__":
        with CachedLoader(TransformDataset, {"n": 6, "transform": lambda x: x * 3}, batch_size=3,
                          nb_worker=2, shuffle=False) as loader:
            print(sorted(int(v) for batch in loader for v in batch))
""")


@pytest.mark.timeout(120)
def test_a_lambda_in_the_dataset_parameters_reaches_the_workers(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(LAMBDA_SCRIPT)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=100, cwd=ROOT,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == [0, 3, 6, 9, 12, 15]


@pytest.mark.timeout(120)
def test_close_releases_every_part_when_one_of_them_fails(no_leaks, monkeypatch):
    from loader.executors.process.slots import SlotPool

    close_slots = SlotPool.close

    def failing_close(self):
        close_slots(self)
        raise OSError("the slots could not be unmapped")

    monkeypatch.setattr(SlotPool, "close", failing_close)
    prefix = str(no_leaks / "c")
    # K=2: the workers and their slots stay for the next generation, so close() is what releases them.
    loader = CachedLoader(ArangeDataset, {"n": 16}, batch_size=4, nb_worker=2,
                          cache_setting={"prefix": prefix, "update_frequency": 2})
    assert sorted(int(y) for b in loader for y in b["y"]) == list(range(16))
    with pytest.raises(OSError, match="unmapped"):
        loader.close()
    # The store after the slots was closed all the same: its writer lock is free for the next run.
    with CachedLoader(ArangeDataset, {"n": 16}, batch_size=4, nb_worker=0, cache_setting={"prefix": prefix}) as again:
        assert sorted(int(y) for b in again for y in b["y"]) == list(range(16))
        assert again.epoch_stats[-1].mode == "read"


def test_a_store_written_by_hand_for_other_data_is_refused_clearly(tmp_path):
    prefix = tmp_path / "c"
    store = open_store(prefix, "memmap")  # no fingerprint: the loader adopts it
    with store.writer(0, num_samples=5) as writer:
        for i in range(5):
            writer.put(i, {"x": np.zeros(4, np.float32), "y": i})
        writer.commit()
    store.close()
    with CachedLoader(ArangeDataset, {"n": 10}, batch_size=2, nb_worker=0,
                      cache_setting={"prefix": str(prefix)}) as loader:
        with pytest.raises(CacheStoreError, match="holds 5 samples"):
            list(loader)


# ---------------------------------------------------------------------------- flags read from a config file
@pytest.mark.parametrize("name", ["drop_last", "shuffle", "pin_memory", "use_threading"])
@pytest.mark.parametrize("value", ["False", "no", 0, None, [True]])
def test_a_flag_that_is_not_a_boolean_is_refused(name, value):
    if value is None and name == "shuffle":
        return  # shuffle=None is the default: on without a sampler
    with pytest.raises(ValueError, match=re.escape(f"{name} should be a boolean value, but got {name}={value!r}")) as info:
        CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=0, **{name: value})
    if isinstance(value, str):
        assert "convert it first" in str(info.value)


def test_persistent_workers_is_taken_for_its_truth_value_as_torch_takes_it():
    # Workers persist anyway: the flag only says that there are workers (torchdata's own tests pass (False,)).
    with CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=1, persistent_workers=(False,)) as loader:
        assert len(list(loader)) == 4
    with pytest.raises(ValueError, match="persistent_workers option needs num_workers > 0"):
        CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=0, persistent_workers=(False,))


def test_drop_last_is_refused_as_torch_refuses_it():
    import torch

    with pytest.raises(ValueError, match="drop_last should be a boolean value") as theirs:
        torch.utils.data.DataLoader(ArangeDataset(8), batch_size=2, drop_last="False")
    with pytest.raises(ValueError) as ours:
        CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=0, drop_last="False")
    # torch's words; the value as its repr, which shows that it is a string
    assert str(theirs.value) == "drop_last should be a boolean value, but got drop_last=False"
    assert str(ours.value).startswith("drop_last should be a boolean value, but got drop_last='False'")


def test_numpy_booleans_are_booleans():
    with CachedLoader(ArangeDataset(5), batch_size=2, nb_worker=0, drop_last=np.True_, shuffle=np.False_) as loader:
        assert loader.drop_last is True and loader.shuffle is False and served(loader) == [0, 1, 2, 3]


# ---------------------------------------------------------------------------- pickling a loader
def test_pickling_a_loader_says_what_to_send_instead(tmp_path):
    import copy
    import pickle

    from loader.errors import NotPicklableError

    with CachedLoader(ArangeDataset(8), batch_size=4, nb_worker=0, cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        served(loader)
        for attempt in (pickle.dumps, copy.deepcopy):
            with pytest.raises(TypeError, match="cannot be pickled") as info:
                attempt(loader)
            assert isinstance(info.value, (NotPicklableError, CacheStoreError))
            assert "dataset" in str(info.value) and "SimpleQueue" not in str(info.value)
            assert f"open_store({loader.store.path!r}).reader()" in str(info.value)
        # What it says works: the committed cache read without a loader.
        with open_store(loader.store.path, readonly=True) as store:
            assert sorted(int(store.reader()[i]["y"]) for i in range(8)) == list(range(8))
