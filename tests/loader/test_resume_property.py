"""Property: a run stopped at random batches and resumed (up to three times, each time by a new loader)
serves every sample exactly once per epoch, and the batches of the run that never stopped.

Drawn: map-style data or a stream, with or without a cache (and its read order), the batch size, the
stops, and for map-style data the number of workers of each leg (0, 1 or 3: the batches do not depend
on it). A stream's workers each iterate their own copy, so their number is its topology: drawn once per
run. ``make test`` runs a few examples; ``make check`` (the ``long`` marker) many more.

A second property changes the number of ranks from leg to leg (2 -> 1 -> 2 and the like, the ranks of
one node sharing the cache's store, each a loader with its ``consumer_index``): every epoch still
serves each sample exactly once across the ranks, and where the number of ranks never changed the
batches are those of the run that never stopped. A state follows the node's store, so ranks change
with a cache; without one, each rank's part is its own and a state names the number of consumers.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from collections import Counter

from loader import CachedLoader

from ..marks import long
from .datasets import ArangeDataset
from .streams.stream_datasets import Counting

EPOCHS = 2


@st.composite
def runs(draw):
    kind = draw(st.sampled_from(["map", "stream"]))
    cached = draw(st.booleans())
    n = draw(st.integers(8, 30))
    batch = draw(st.integers(1, 6))
    per_epoch = -(-n // batch)
    stops = sorted(draw(st.lists(st.integers(1, EPOCHS * per_epoch - 1), max_size=3, unique=True)))
    if kind == "map":
        workers = draw(st.lists(st.sampled_from([0, 1, 3]), min_size=len(stops) + 1, max_size=len(stops) + 1))
    else:
        workers = [draw(st.sampled_from([0, 1, 3]))] * (len(stops) + 1)
    order = draw(st.sampled_from(["random", "block"])) if cached else None
    return {"kind": kind, "cached": cached, "n": n, "batch": batch, "stops": stops, "workers": workers,
            "order": order}


def build(run: dict, workers: int, prefix) -> CachedLoader:
    kwargs: dict = {"batch_size": run["batch"], "num_workers": workers, "seed": 9, "timeout": 60}
    if run["cached"]:
        kwargs["cache_setting"] = {"prefix": str(prefix), "update_frequency": 2, "read_order": run["order"]}
    if run["kind"] == "map":
        return CachedLoader(ArangeDataset, {"n": run["n"], "shape": [1]}, shuffle=True, **kwargs)
    return CachedLoader(Counting(run["n"], width=1), shuffle=True if run["cached"] else None, **kwargs)


def labels(batch) -> list[int]:
    return np.asarray(batch["y"] if "y" in batch else batch["i"]).ravel().astype(int).tolist()


def check(run: dict, tmp_path) -> None:
    with build(run, run["workers"][0], tmp_path / "golden") as golden:
        expected = [[labels(b) for b in golden] for _ in range(EPOCHS)]  # epoch 1 reads what epoch 0 wrote
    flat = [(e, b) for e, epoch in enumerate(expected) for b in epoch]
    served: list[tuple[int, list[int]]] = []
    state = None
    for leg, stop in enumerate(run["stops"] + [len(flat)]):
        with build(run, run["workers"][leg], tmp_path / "resumed") as loader:
            if state is not None:
                loader.load_state_dict(json.loads(json.dumps(pickle.loads(state))))  # plain values
            while len(served) < stop:
                it = iter(loader)
                epoch = loader.epoch
                for batch in it:
                    served.append((epoch, labels(batch)))
                    if len(served) == stop:
                        break
            state = pickle.dumps(loader.state_dict())
    assert served == flat
    for e in range(EPOCHS):
        assert sorted(v for epoch, b in served if epoch == e for v in b) == list(range(run["n"]))


@st.composite
def rank_runs(draw):
    n = 2 * draw(st.integers(4, 14))
    batch = draw(st.integers(2, 5))  # (with one sample a batch, an uneven rest would repeat one: docs)
    legs = draw(st.integers(1, 4))
    ranks = draw(st.lists(st.sampled_from([1, 2]), min_size=legs, max_size=legs))
    steps = draw(st.lists(st.integers(1, 6), min_size=legs - 1, max_size=legs - 1))
    workers = draw(st.lists(st.sampled_from([0, 1]), min_size=legs, max_size=legs))
    order = draw(st.sampled_from(["random", "block"]))
    return {"n": n, "batch": batch, "ranks": ranks, "steps": steps, "workers": workers, "order": order}


def rank_loaders(run: dict, leg: int, prefix) -> list[CachedLoader]:
    ranks = run["ranks"][leg]
    return [CachedLoader(ArangeDataset, {"n": run["n"], "shape": [1]}, batch_size=run["batch"],
                         num_workers=run["workers"][leg], seed=9, timeout=60, nb_consumer=ranks, consumer_index=r,
                         cache_setting={"prefix": str(prefix), "update_frequency": 2, "read_order": run["order"]})
            for r in range(ranks)]


def run_ranks(run: dict, prefix, stops: list[int]) -> tuple[list[tuple[int, list[list[int]]]], Counter]:
    """``(epoch, one batch per rank)`` of every step until `EPOCHS` epochs are served, each leg a new node
    of `run["ranks"][leg]` loaders that loads the state the last leg left after its `stops[leg]` steps;
    and per epoch the samples a leg may serve twice: one that begins with fewer samples left than it has
    ranks pads the others (every rank serves as many batches, so DDP's collectives never wait)."""
    served: list[tuple[int, list[list[int]]]] = []
    padding: Counter = Counter()
    state = None
    for leg, ranks in enumerate(run["ranks"]):
        left = stops[leg] if leg < len(stops) else None
        loaders = rank_loaders(run, leg, prefix)
        try:
            if state is not None:
                for loader in loaders:
                    loader.load_state_dict(json.loads(json.dumps(state)))
            while left != 0:
                its = [iter(loader) for loader in loaders]
                epoch = loaders[0].epoch  # the one these iterators serve
                if epoch >= EPOCHS:
                    break
                rest = run["n"] - sum(len(b) for e, step in served if e == epoch for b in step)
                padding[epoch] += max(0, ranks - rest) if rest < run["n"] else 0
                while left != 0:
                    step = [next(it, None) for it in its]
                    if step[0] is None:
                        assert all(b is None for b in step), "every rank serves as many batches"
                        break
                    served.append((epoch, [labels(b) for b in step]))
                    left = None if left is None else left - 1
            state = loaders[0].state_dict()
        finally:
            for loader in loaders:
                loader.close()
    return served, padding


def check_ranks(run: dict, tmp_path) -> None:
    served, padding = run_ranks(run, tmp_path / "resumed", run["steps"])
    for e in range(EPOCHS):
        counts = Counter(v for epoch, step in served if epoch == e for b in step for v in b)
        assert set(counts) == set(range(run["n"])) and sum(counts.values()) - run["n"] <= padding[e], (e, counts)
    if len(set(run["ranks"])) == 1:  # the topology never changed: the batches of the run that never stopped
        golden, _ = run_ranks({**run, "ranks": run["ranks"][:1], "workers": run["workers"][:1]}, tmp_path / "golden", [])
        assert served == golden


SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])


@pytest.mark.timeout(600)
@settings(max_examples=4, **SETTINGS)
@given(run=runs())
def test_resumed_runs_serve_the_uninterrupted_batches(tmp_path_factory, run) -> None:
    check(run, tmp_path_factory.mktemp("run"))


@long
@pytest.mark.timeout(3600)
@settings(max_examples=60, **SETTINGS)
@given(run=runs())
def test_resumed_runs_serve_the_uninterrupted_batches_many(tmp_path_factory, run) -> None:
    check(run, tmp_path_factory.mktemp("run"))


@pytest.mark.timeout(600)
@settings(max_examples=4, **SETTINGS)
@given(run=rank_runs())
def test_resumed_runs_on_other_numbers_of_ranks_serve_each_sample_once(tmp_path_factory, run) -> None:
    check_ranks(run, tmp_path_factory.mktemp("run"))


@long
@pytest.mark.timeout(3600)
@settings(max_examples=60, **SETTINGS)
@given(run=rank_runs())
def test_resumed_runs_on_other_numbers_of_ranks_serve_each_sample_once_many(tmp_path_factory, run) -> None:
    check_ranks(run, tmp_path_factory.mktemp("run"))
