"""A stream's next generation written in the background: its workers iterate it while the cached epochs read."""

from __future__ import annotations

import os
import time
from pathlib import Path

import numpy as np
import pytest

from cachestore import Store
from loader import CachedLoader

from ...marks import long
from .stream_datasets import Augmented, Counting, FailsOnceArmed, StallsAfterFirst, iterations


def epoch_samples(loader: CachedLoader) -> dict[int, float]:
    """One epoch: sample index -> its noise; fails when a sample is served twice."""
    got: dict[int, float] = {}
    for batch in loader:
        noise = np.asarray(batch["noise"]).ravel() if "noise" in batch else np.zeros(len(batch["i"]))
        for i, value in zip(np.asarray(batch["i"]).ravel(), noise):
            assert int(i) not in got, f"sample {int(i)} served twice in one epoch"
            got[int(i)] = float(value)
    return got


def test_every_k_epochs_the_stream_is_iterated_once_in_the_background(tmp_path) -> None:
    """K=2 over 5 epochs, 2 workers: only the first epoch writes; each generation is the stream iterated once,
    served whole every epoch, and its random draws are its own."""
    log = str(tmp_path / "log")
    with CachedLoader(Augmented(30, log), batch_size=4, num_workers=2, shuffle=True, timeout=60,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        epochs = [epoch_samples(loader) for _ in range(5)]
        stats = loader.epoch_stats
    assert [s.mode.value for s in stats] == ["generate", "read", "read", "read", "read"]
    assert [s.generation for s in stats] == [0, 0, 1, 1, 2]
    assert all(sorted(e) == list(range(30)) for e in epochs)  # every sample exactly once each epoch
    assert epochs[0] == epochs[1] and epochs[2] == epochs[3]  # one generation, the same samples
    assert epochs[0] != epochs[2] and epochs[2] != epochs[4]  # a new iteration of the stream: new draws
    assert stats[2].extra["stream_refresh"] in ("ready", "waited") and "stream_refresh_wait" in stats[2].extra
    # Generations 0, 1, 2, each iterated once by each worker; generation 3's refresh (begun in epoch 4) may
    # have started before the close.
    assert 6 <= iterations(log) <= 8


def test_closing_during_a_refresh_leaves_nothing_behind(no_leaks) -> None:
    """The refresh's stream never ends: close stops its thread, its workers and its generation."""
    log, prefix = str(no_leaks / "log"), no_leaks / "c"
    loader = CachedLoader(StallsAfterFirst(20, log, 2), batch_size=4, num_workers=2, timeout=60,
                          cache_setting={"prefix": str(prefix), "update_frequency": 2})
    assert len(epoch_samples(loader)) == 20  # generation 0
    batches = iter(loader)
    next(batches)  # epoch 1 reads generation 0; its refresh of generation 1 starts
    deadline = time.monotonic() + 60
    while iterations(log) < 4 and time.monotonic() < deadline:  # both workers are in the endless iteration
        time.sleep(0.05)
    assert iterations(log) == 4
    loader.close()
    assert not any(loader_threads())
    assert sorted(p.name for p in prefix.iterdir() if p.name.startswith("gen-")) == ["gen-000000"]


def loader_threads() -> list[str]:
    import threading

    return [t.name for t in threading.enumerate() if t.name.startswith("cachestore-stream-refresh")]


def test_without_background_refresh_each_generation_is_written_in_its_epoch(tmp_path) -> None:
    log = str(tmp_path / "log")
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": False}
    with CachedLoader(Counting(20, log), batch_size=4, num_workers=2, shuffle=True, timeout=60,
                      cache_setting=cache) as loader:
        counts = []
        for _ in range(5):
            assert sorted(epoch_samples(loader)) == list(range(20))
            counts.append(iterations(log))
        assert [s.mode.value for s in loader.epoch_stats] == ["generate", "read", "generate", "read", "generate"]
    assert counts == [2, 2, 4, 4, 6]


@long
def test_a_failed_refresh_leaves_its_epoch_to_iterate_the_stream(tmp_path) -> None:
    log, armed = str(tmp_path / "log"), str(tmp_path / "armed")
    with CachedLoader(FailsOnceArmed(20, log, armed), batch_size=4, num_workers=2, timeout=60,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        assert sorted(epoch_samples(loader)) == list(range(20))
        Path(armed).touch()  # the refresh that epoch 1 starts fails
        for _ in range(3):
            assert sorted(epoch_samples(loader)) == list(range(20))
        stats = loader.epoch_stats
    assert os.path.exists(armed + ".fired")
    assert [s.mode.value for s in stats] == ["generate", "read", "generate", "read"]
    assert stats[2].extra["stream_refresh"] == "failed" and stats[2].committed


@long
def test_a_refresh_takes_the_first_stream_samples(tmp_path) -> None:
    log = str(tmp_path / "log")
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "stream_samples": 12}
    with CachedLoader(Augmented(30, log), batch_size=4, num_workers=2, shuffle=True, timeout=60,
                      cache_setting=cache) as loader:
        epochs = [epoch_samples(loader) for _ in range(5)]
        assert [s.mode.value for s in loader.epoch_stats] == ["generate"] + ["read"] * 4
        assert len(loader) == 3
    assert all(len(e) == 12 for e in epochs) and epochs[0] != epochs[2] != epochs[4]


@long
def test_no_background_refresh_without_workers(tmp_path) -> None:
    with pytest.raises(ValueError, match="no worker to iterate the stream"):
        CachedLoader(Counting(8), batch_size=4, num_workers=0,
                     cache_setting={"prefix": str(tmp_path), "update_frequency": 2, "background_refresh": True})


def test_a_refresh_whose_generation_another_loader_committed_first_reads_that_one(tmp_path, monkeypatch) -> None:
    """Two loaders open on one prefix: the other commits generation 1 between this one's plan of the
    refresh and the refresh's writer (the race forced here). The refresh steps aside (no
    ``GenerationCommitted``), and the epochs of generation 1 read what the other committed."""
    log = str(tmp_path / "log")
    kw = dict(batch_size=4, num_workers=1, shuffle=True, timeout=60,
              cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2})
    committed_by_other: dict[int, float] = {}
    raced: list[int] = []
    with CachedLoader(Augmented(20, log), **kw) as loader:
        assert sorted(epoch_samples(loader)) == list(range(20))  # generation 0
        writer = Store.writer

        def other_commits_first(store, generation, *args, **kwargs):
            if generation == 1 and not raced:
                raced.append(generation)
                # The other keeps generation 0, which this loader's epoch 1 is about to read: its prune
                # removing a generation another job reads is another matter than this race.
                with monkeypatch.context() as keep, CachedLoader(Augmented(20, log), **kw) as other:
                    keep.setattr(Store, "prune", lambda *args, **kwargs: [])
                    other.set_epoch(2)  # generation 1's first epoch: it iterates the stream and commits
                    committed_by_other.update(epoch_samples(other))
                    assert other.epoch_stats[-1].committed
            return writer(store, generation, *args, **kwargs)

        monkeypatch.setattr(Store, "writer", other_commits_first)
        first = epoch_samples(loader)  # reads generation 0; its refresh of generation 1 meets the other's
        monkeypatch.undo()
        second, third = epoch_samples(loader), epoch_samples(loader)
        stats = loader.epoch_stats
    assert sorted(committed_by_other) == list(range(20))
    assert [s.mode.value for s in stats] == ["generate", "read", "read", "read"]
    assert [s.generation for s in stats] == [0, 0, 1, 1]
    assert "stream_refresh_of" not in stats[1].extra
    assert sorted(first) == list(range(20)) and second == third == committed_by_other
