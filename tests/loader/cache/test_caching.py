"""Caching semantics with real worker processes: which epochs call the dataset."""

from __future__ import annotations

import math
import multiprocessing as mp

import numpy as np
import pytest

from cachestore.errors import FingerprintMismatchError
from loader import CachedLoader

from ..datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(90)


def served(loader) -> dict[int, np.ndarray]:
    """One epoch: index -> x served for it."""
    out = {}
    for batch in loader:
        for y, x in zip(batch["y"].tolist(), batch["x"]):
            assert y not in out, "an index was served twice in one epoch"
            out[y] = np.array(x)
    return out


@pytest.mark.parametrize("backend,nb_worker", [("memmap", 2), ("lmdb", 2), ("memory", 2), ("memmap", 0)])
def test_dataset_called_only_in_refresh_epochs(no_leaks, backend, nb_worker):
    calls_dir = no_leaks / "calls"
    calls_dir.mkdir()
    n, k = 40, 3
    with CachedLoader(ArangeDataset, {"n": n, "counter_dir": str(calls_dir), "augment": True}, batch_size=6,
                      nb_worker=nb_worker, seed=3,
                      cache_setting={"prefix": str(no_leaks / "cache"), "update_frequency": k, "background_refresh": False,
                                     "backend": backend}) as loader:
        epochs = []
        counts = []
        for _ in range(7):
            epochs.append(served(loader))
            counts.append(len(read_calls(str(calls_dir))))
        modes = [s.mode for s in loader.epoch_stats]
    assert counts == [n, n, n, 2 * n, 2 * n, 2 * n, 3 * n]
    assert modes == ["generate", "read", "read", "generate", "read", "read", "generate"]
    for e in range(7):
        assert sorted(epochs[e]) == list(range(n))
        ref = epochs[e - e % k]
        assert all(np.array_equal(epochs[e][i], ref[i]) for i in range(n)), f"epoch {e} differs from its refresh"
    # Augmentation is random: a new refresh epoch serves new values.
    assert not all(np.array_equal(epochs[0][i], epochs[3][i]) for i in range(n))


def test_infinite_update_frequency_never_rewrites(no_leaks):
    calls_dir = no_leaks / "calls"
    calls_dir.mkdir()
    with CachedLoader(ArangeDataset, {"n": 20, "counter_dir": str(calls_dir)}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(no_leaks / "cache"), "update_frequency": math.inf}) as loader:
        for _ in range(5):
            served(loader)
        assert [s.mode for s in loader.epoch_stats] == ["generate"] + ["read"] * 4
    assert len(read_calls(str(calls_dir))) == 20


def _first_run(prefix: str, calls_dir: str) -> None:
    with CachedLoader(ArangeDataset, {"n": 30, "counter_dir": calls_dir}, batch_size=8, nb_worker=1,
                      cache_setting={"prefix": prefix, "update_frequency": 5}) as loader:
        for _ in loader:
            pass


def test_new_process_reuses_committed_generation(no_leaks):
    prefix = str(no_leaks / "cache")
    first_calls = no_leaks / "first"
    first_calls.mkdir()
    proc = mp.get_context("spawn").Process(target=_first_run, args=(prefix, str(first_calls)))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0
    assert len(read_calls(str(first_calls))) == 30
    calls_dir = no_leaks / "second"
    calls_dir.mkdir()
    # Same class and params (the counter directory is a param: give the same one).
    with CachedLoader(ArangeDataset, {"n": 30, "counter_dir": str(first_calls)}, batch_size=8, nb_worker=2,
                      cache_setting={"prefix": prefix, "update_frequency": 5, "background_refresh": False}) as loader:
        assert sorted(served(loader)) == list(range(30))
        assert loader.epoch_stats[0].mode == "read"
    assert len(read_calls(str(first_calls))) == 30  # zero new calls


def test_different_params_are_refused_not_served_stale(no_leaks):
    prefix = str(no_leaks / "cache")
    with CachedLoader(ArangeDataset, {"n": 10}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": prefix, "update_frequency": 2}) as loader:
        served(loader)
    with CachedLoader(ArangeDataset, {"n": 10, "shape": (5,)}, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": prefix, "update_frequency": 2}) as loader:
        with pytest.raises(FingerprintMismatchError, match="prune"):
            iter(loader)  # the store is opened, and the dataset fingerprinted, at the first iter()


def test_changed_dataset_source_is_refused(no_leaks, monkeypatch):
    import importlib
    import sys

    pkg = no_leaks / "src"
    pkg.mkdir()
    module = pkg / "changing_dataset.py"
    source = ("import numpy as np\nclass DS:\n    def __init__(self, n=6): self.n = n\n"
              "    def __len__(self): return self.n\n"
              "    def __getitem__(self, i): return np.full(2, i * {factor}, np.float32)\n")
    module.write_text(source.format(factor=1))
    monkeypatch.syspath_prepend(str(pkg))
    mod = importlib.import_module("changing_dataset")
    prefix = str(no_leaks / "cache")
    with CachedLoader(mod.DS, {}, batch_size=3, nb_worker=0, cache_setting={"prefix": prefix}) as loader:
        for _ in loader:
            pass
    module.write_text(source.format(factor=2))
    sys.modules.pop("changing_dataset")
    mod = importlib.import_module("changing_dataset")
    with CachedLoader(mod.DS, {}, batch_size=3, nb_worker=0, cache_setting={"prefix": prefix}) as loader:
        with pytest.raises(FingerprintMismatchError):
            iter(loader)
    sys.modules.pop("changing_dataset")
