"""Rotation: each generated sample served R times from a bounded window, with real workers."""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import signal
from collections import Counter

import numpy as np
import pytest

from cachestore.cli import main as cli
from cachestore.errors import BudgetExceededError
from cachestore.space.disk import allocated_bytes
from loader import CachedLoader
from loader.epochs.rotation import rotation_schedule

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(90)


def epoch(loader) -> list[tuple[int, np.ndarray]]:
    return [(y, np.array(x)) for batch in loader for y, x in zip(batch["y"].tolist(), batch["x"])]


@pytest.mark.parametrize("medium,nb_worker", [("memory", 0), ("memory", 2), ("disk", 1), ("disk", 2)])
def test_each_sample_served_r_times_and_dataset_called_n_times(no_leaks, medium, nb_worker):
    calls = no_leaks / "calls"
    calls.mkdir()
    n, r, size, bs = 60, 3, 16, 8
    with CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls), "augment": True}, batch_size=bs,
                      nb_worker=nb_worker, seed=5,
                      rotation_setting={"medium": medium, "rotation": r, "size": size,
                                        "prefix": str(no_leaks / "rot")}) as loader:
        assert len(loader) == -(-r * n // bs)
        orders = []
        for e in range(2):
            served = epoch(loader)
            assert len(served) == r * n
            assert Counter(y for y, _ in served) == {i: r for i in range(n)}
            # The R serves of one index are the same generated sample (augmentation is random).
            by_index: dict[int, list[np.ndarray]] = {}
            for y, x in served:
                by_index.setdefault(y, []).append(x)
            assert all(all(np.array_equal(xs[0], x) for x in xs) for xs in by_index.values())
            assert len(read_calls(str(calls))) == n * (e + 1), "fresh samples every epoch, N calls each"
            assert loader.epoch_stats[-1].extra["window_peak"] <= size
            orders.append([y for y, _ in served])
        assert orders[0] != orders[1]


def test_repeats_never_share_a_batch_and_follow_the_seed(tmp_path):
    kwargs = dict(batch_size=10, nb_worker=2, seed=11,
                  rotation_setting={"medium": "memory", "rotation": 4, "size": 30})
    with CachedLoader(ArangeDataset, {"n": 100}, **kwargs) as loader:
        first = [[b["y"].tolist() for b in loader] for _ in range(2)]
    for batches in first:
        assert all(len(set(b)) == len(b) for b in batches)
    with CachedLoader(ArangeDataset, {"n": 100}, **kwargs) as loader:
        assert [[b["y"].tolist() for b in loader] for _ in range(2)] == first


@pytest.mark.parametrize("n,r,size,bs", [(100, 2, 10, 10), (300, 4, 24, 8), (500, 3, 64, 32), (50, 5, 200, 7),
                                         (1000, 4, 128, 128), (97, 3, 20, 6)])
def test_schedule_properties(n, r, size, bs):
    for seed in range(5):
        batches = list(rotation_schedule(n, r, size, bs, False, np.random.default_rng(seed)))
        assert [len(b) for b in batches[:-1]] == [bs] * (len(batches) - 1)
        assert Counter(s.sample for b in batches for s in b) == {i: r for i in range(n)}
        assert all(len({s.sample for s in b}) == len(b) for b in batches)
        live: set[int] = set()
        for b in batches:
            for s in b:
                if not s.fresh and s.last:
                    live.discard(s.sample)
            for s in b:
                if s.fresh and not s.last:
                    live.add(s.sample)
            assert len(live) <= size


def test_disk_window_bytes_stay_bounded_and_are_removed(no_leaks):
    prefix = no_leaks / "rot"
    shape = (32, 32)  # 4 KiB samples
    size = 12
    with CachedLoader(ArangeDataset, {"n": 80, "shape": shape}, batch_size=6, nb_worker=2,
                      rotation_setting={"medium": "disk", "rotation": 3, "size": size,
                                        "prefix": str(prefix)}) as loader:
        record = 4096 + 256  # a sample plus its record header, rounded up
        peak = 0
        for _ in loader:
            peak = max(peak, sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(prefix) for f in fs))
        assert 0 < peak <= size * record
        assert allocated_bytes(prefix) <= size * 8192 + 4096
    assert not prefix.exists(), "the window, and the prefix directory the loader made, are removed on close"


def _rotate_and_hang(prefix: str, conn) -> None:
    with CachedLoader(ArangeDataset, {"n": 40}, batch_size=4, nb_worker=1,
                      rotation_setting={"medium": "disk", "rotation": 2, "size": 8, "prefix": prefix}) as loader:
        for step, _ in enumerate(loader):
            if step == 3:
                conn.send("mid-epoch")
                conn.recv()


def test_crash_leftovers_are_cleaned_by_next_start_or_prune(no_leaks, capsys):
    prefix = str(no_leaks / "rot")
    ctx = mp.get_context("spawn")
    for cleaner in ("prune", "next start"):
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_rotate_and_hang, args=(prefix, child))
        proc.start()
        assert parent.poll(60) and parent.recv() == "mid-epoch"
        os.kill(proc.pid, signal.SIGKILL)
        proc.join(10)
        assert [p.name for p in (no_leaks / "rot").iterdir()][0].startswith("rotation-")
        if cleaner == "prune":
            assert cli(["prune", prefix]) == 0
            assert "rotation" in capsys.readouterr().out
        else:
            with CachedLoader(ArangeDataset, {"n": 10}, batch_size=4, nb_worker=0,
                              rotation_setting={"medium": "disk", "rotation": 2, "size": 8,
                                                "prefix": prefix}) as loader:
                # Swept at the first epoch, not at construction: a resumed run adopts its window first.
                list(loader)
                assert len(list((no_leaks / "rot").iterdir())) == 1  # only its own window
        assert not any((no_leaks / "rot").iterdir())


@pytest.mark.parametrize("n,bs,size,drop_last,shuffle,nb_worker", [
    (5, 8, 16, False, True, 2),    # N < batch_size
    (12, 4, 50, False, False, 1),  # N < S, no shuffle
    (30, 7, 10, True, True, 2),    # drop_last
    (1, 3, 4, False, True, 0),     # a single sample
])
def test_tiny_and_edge_configurations(n, bs, size, drop_last, shuffle, nb_worker):
    r = 3
    with CachedLoader(ArangeDataset, {"n": n}, batch_size=bs, nb_worker=nb_worker, shuffle=shuffle,
                      drop_last=drop_last, rotation_setting={"medium": "memory", "rotation": r, "size": size}) as loader:
        batches = [b["y"].tolist() for b in loader]
        assert len(batches) == len(loader)
        ys = [y for b in batches for y in b]
        if drop_last:
            assert all(len(b) == bs for b in batches) and len(ys) == (r * n) // bs * bs
            assert max(Counter(ys).values()) <= r
        else:
            assert Counter(ys) == {i: r for i in range(n)}
        for b in batches:
            assert all((np.array(b) >= 0) & (np.array(b) < n))


@pytest.mark.parametrize("setting,key", [
    ({"medium": "memory", "rotation": 1}, "rotation"),
    ({"medium": "tape", "rotation": 2}, "medium"),
    ({"medium": "disk", "rotation": 2, "size": 4}, "prefix"),
    ({"medium": "disk", "rotation": 2, "prefix": "x"}, "size"),
    ({"medium": "memory", "rotation": 2, "size": 0}, "size"),
    ({"medium": "memory", "rotation": 2, "speed": 3}, "speed"),
])
def test_bad_rotation_settings(setting, key):
    with pytest.raises(ValueError, match=key):
        CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, nb_worker=0, rotation_setting=setting)


def test_cache_with_rotation_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="on_budget_exceeded"):
        CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, nb_worker=0,
                     cache_setting={"prefix": str(tmp_path / "c")},
                     rotation_setting={"medium": "memory", "rotation": 2})


def test_budget_rotate_switches_to_a_disk_window_that_fits(no_leaks, caplog):
    prefix = no_leaks / "c"
    with caplog.at_level(logging.WARNING):
        with CachedLoader(ArangeDataset, {"n": 120, "shape": (64, 64)}, batch_size=8, nb_worker=2,
                          cache_setting={"prefix": str(prefix), "update_frequency": 3, "disk_budget": "256KiB",
                                         "on_budget_exceeded": "rotate"}) as loader:
            assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(120))
            assert loader.rotation is not None and loader.rotation.medium == "disk"
            assert loader.rotation.rotation == 3
            assert len(loader) == -(-3 * 120 // 8)
            peak = 0
            ys = []
            for batch in loader:
                ys += batch["y"].tolist()
                peak = max(peak, allocated_bytes(prefix))
            assert Counter(ys) == {i: 3 for i in range(120)}
            assert 0 < peak <= 256 * 1024
    assert any("switching to disk rotation" in r.getMessage() for r in caplog.records)


def test_memory_window_larger_than_the_memory_room_is_refused(tmp_path, monkeypatch):
    import cachestore.space.room
    import loader.epochs.windows as windows

    room = (64 * 64 * 4 + 8) * 30  # room for 30 samples (x float32, y int64); half of it for 15
    monkeypatch.setattr(cachestore.space.room, "memory_room", lambda *a, **k: room)
    monkeypatch.setattr(windows, "memory_room", lambda *a, **k: room)
    with CachedLoader(ArangeDataset, {"n": 100, "shape": (64, 64)}, batch_size=4, nb_worker=0,
                      rotation_setting={"medium": "memory", "rotation": 2, "size": 20}) as loader:
        with pytest.raises(BudgetExceededError, match=r"rotation_setting\['size'\] to at most 15"):
            next(iter(loader))
    with CachedLoader(ArangeDataset, {"n": 100, "shape": (64, 64)}, batch_size=4, nb_worker=0,
                      rotation_setting={"medium": "memory", "rotation": 2, "size": 15}) as loader:
        assert Counter(y for b in loader for y in b["y"].tolist()) == {i: 2 for i in range(100)}


@pytest.mark.timeout(60)
@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_error_among_fresh_samples_ends_the_rotation_epoch_with_that_error(no_leaks, workers):
    # The window's slots of a failed batch would stay empty: the epoch ends with the dataset's own error.
    with CachedLoader(ArangeDataset, {"n": 24, "fail_at": 13}, batch_size=4, nb_worker=workers, shuffle=False,
                      rotation_setting={"medium": "memory", "rotation": 2, "size": 8}) as loader:
        with pytest.raises(KeyError, match="sample 13 is broken"):
            list(loader)
