"""Property: a run stopped at random batches and resumed (up to three times, each time by a new loader)
serves every sample exactly once per epoch, and the batches of the run that never stopped.

Drawn: map-style data or a stream, with or without a cache (and its read order), the batch size, the
stops, and for map-style data the number of workers of each leg (0, 1 or 3: the batches do not depend
on it). A stream's workers each iterate their own copy, so their number is its topology: drawn once per
run. ``make test`` runs a few examples; ``make check`` (the ``long`` marker) many more.
"""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

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
