"""One epoch at a time: a newer iterator ends the older one loudly; drop_last with a cache; progress."""

from __future__ import annotations

import io
import sys

import numpy as np
import pytest

import loader.epochs.runner
from loader import CachedLoader

from .datasets import ArangeDataset

pytestmark = pytest.mark.timeout(60)


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_a_new_iterator_ends_the_old_one_with_an_error(no_leaks, nb_worker):
    with CachedLoader(ArangeDataset, {"n": 32}, batch_size=4, nb_worker=nb_worker) as cached:
        it1 = iter(cached)
        next(it1)
        it2 = iter(cached)
        with pytest.raises(RuntimeError, match="ended by a newer iter"):
            next(it1)
        assert sum(len(b["y"]) for b in it2) == 32  # the new epoch is whole


def test_zip_of_a_loader_with_itself_fails_instead_of_yielding_nothing(no_leaks):
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0) as cached:
        with pytest.raises(RuntimeError, match="one epoch at a time"):
            list(zip(cached, cached))


def test_an_iterator_ended_by_close_just_stops(no_leaks):
    cached = CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0)
    it = iter(cached)
    next(it)
    cached.close()
    with pytest.raises(StopIteration):
        next(it)


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_drop_last_still_caches_every_sample(no_leaks, nb_worker):
    prefix = str(no_leaks / "c")
    with CachedLoader(ArangeDataset, {"n": 30}, batch_size=8, nb_worker=nb_worker, drop_last=True,
                      cache_setting={"prefix": prefix, "update_frequency": 2,
                                     "background_refresh": False}) as cached:
        for epoch in range(3):
            served = np.concatenate([b["y"] for b in cached])
            assert len(served) == 24 and len(set(served.tolist())) == 24
        modes = [(s.mode, s.committed, s.samples) for s in cached.epoch_stats]
        assert modes == [("generate", True, 24), ("read", False, 24), ("generate", True, 24)]
        assert len(cached.store.reader()) == 30


def test_progress_is_shown_on_generate_epochs_only(no_leaks, monkeypatch):
    monkeypatch.setattr(loader.epochs.runner, "PROGRESS_DELAY", 0.0)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    with CachedLoader(ArangeDataset, {"n": 16}, batch_size=4, nb_worker=0, progress=True,
                      cache_setting={"prefix": str(no_leaks / "c")}) as cached:
        list(cached)
        generate = err.getvalue()
        list(cached)
    assert "epoch 0 (generate)" in generate and "16/16" in generate
    assert err.getvalue() == generate, "a cached epoch shows nothing"


def test_progress_false_and_not_a_terminal_show_nothing(no_leaks, monkeypatch):
    monkeypatch.setattr(loader.epochs.runner, "PROGRESS_DELAY", 0.0)
    err = io.StringIO()
    monkeypatch.setattr(sys, "stderr", err)
    for progress in (False, None):  # None: only on a terminal, and a StringIO is none
        with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0, progress=progress,
                          cache_setting={"prefix": str(no_leaks / f"c-{progress}")}) as cached:
            list(cached)
            assert cached.epoch_stats[0].mode == "generate"
    assert err.getvalue() == ""
