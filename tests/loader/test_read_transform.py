"""read_transform: fresh random augmentation on every epoch, on top of the cache.

The store keeps what the dataset computed; every sample served goes through
``read_transform(sample, rng)``, its random streams seeded by (seed, epoch, index),
so the augmented stream is the same with any workers, and after a resume.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from cachestore import open_store
from loader import CachedLoader

from .datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(120)


class Jitter(Exception):
    pass


def jitter(sample, rng):
    """numpy's rng, Python's and torch's global generators: all three must repeat."""
    sample["x"] = sample["x"] + rng.random(sample["x"].shape, dtype=np.float32)
    sample["py"] = random.random()
    sample["torch"] = float(torch.rand(1))
    return sample


def crop_or_fail(sample, rng):
    if sample["y"] == 7:
        raise Jitter(f"cannot augment sample {sample['y']}")
    return sample


def stream(loader, epochs: int) -> list[list[tuple]]:
    out = []
    for _ in range(epochs):
        out.append([(int(y), tuple(np.round(x, 6).tolist()), round(float(p), 9), round(float(t), 6))
                    for b in loader for y, x, p, t in zip(b["y"], b["x"], b["py"], b["torch"])])
    return out


def make(tmp_path, name: str, **kwargs) -> CachedLoader:
    calls = tmp_path / f"calls-{name}"
    calls.mkdir(exist_ok=True)
    settings = dict(batch_size=5, seed=11, read_transform=jitter,
                    cache_setting={"prefix": str(tmp_path / f"c-{name}"), "update_frequency": 3})
    settings.update(kwargs)
    return CachedLoader(ArangeDataset(20, shape=(3,), counter_dir=str(calls)), **settings)


@pytest.mark.parametrize("workers", [0, 2])
def test_epochs_differ_while_the_dataset_is_called_once_per_generation(tmp_path, workers):
    with make(tmp_path, "a", nb_worker=workers,
              cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 3,
                             "background_refresh": False}) as loader:
        epochs = stream(loader, 3)
        assert [s.mode for s in loader.epoch_stats] == ["generate", "read", "read"]
    assert sorted(read_calls(str(tmp_path / "calls-a"))) == list(range(20))
    by_index = [dict((y, (x, p, t)) for y, x, p, t in epoch) for epoch in epochs]
    for i in range(20):
        assert by_index[0][i] != by_index[1][i] != by_index[2][i]
        assert all(i <= v < i + 1 for v in by_index[0][i][0])  # the dataset's value, jittered
    # The store keeps what the dataset computed, untransformed.
    with open_store(tmp_path / "c", readonly=True) as store, store.reader() as reader:
        assert [reader[i]["x"].tolist() for i in range(3)] == [[0.0] * 3, [1.0] * 3, [2.0] * 3]


def test_the_stream_is_the_same_with_any_workers_and_in_another_run(tmp_path):
    runs = {}
    for name, kwargs in [("none", {"nb_worker": 0}), ("processes", {"nb_worker": 2}),
                         ("threads", {"nb_worker": 2, "use_threading": True}), ("again", {"nb_worker": 2})]:
        with make(tmp_path, name, **kwargs) as loader:
            runs[name] = stream(loader, 4)  # generate, read, read, and generation 1
    assert runs["none"] == runs["processes"] == runs["threads"] == runs["again"]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_run_continues_the_same_augmented_stream(tmp_path, workers):
    with make(tmp_path, "whole", nb_worker=workers) as loader:
        whole = stream(loader, 2)
    with make(tmp_path, "cut", nb_worker=workers) as loader:
        it = iter(loader)
        first = [next(it) for _ in range(2)]
        state = loader.state_dict()
        it.close()
    with make(tmp_path, "cut", nb_worker=workers) as loader:
        loader.load_state_dict(state)
        rest = stream(loader, 2)
    served = [(int(y), tuple(np.round(x, 6).tolist()), round(float(p), 9), round(float(t), 6))
              for b in first for y, x, p, t in zip(b["y"], b["x"], b["py"], b["torch"])]
    assert served + rest[0] == whole[0] and rest[1] == whole[1]


def test_a_changed_transform_keeps_the_cache(tmp_path):
    with make(tmp_path, "a", nb_worker=0) as loader:
        stream(loader, 1)
    with make(tmp_path, "a", nb_worker=0, read_transform=lambda s, rng: {**s, "x": s["x"] * 2, "py": 0.0,
                                                                        "torch": 0.0}) as loader:
        epoch = stream(loader, 1)[0]
        assert loader.epoch_stats[0].mode == "read"
    assert sorted(x[0] for _, x, _, _ in epoch) == [2.0 * i for i in range(20)]
    assert len(read_calls(str(tmp_path / "calls-a"))) == 20


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("epoch", ["generate", "read"])
def test_an_error_in_read_transform_is_raised_with_its_type_and_index(tmp_path, workers, epoch):
    setting = {"prefix": str(tmp_path / "c")}
    if epoch == "read":
        with CachedLoader(ArangeDataset(10), batch_size=5, nb_worker=0, cache_setting=setting) as loader:
            list(loader)
    with CachedLoader(ArangeDataset(10), batch_size=5, nb_worker=workers, read_transform=crop_or_fail,
                      cache_setting=setting) as loader:
        with pytest.raises(Jitter, match="cannot augment sample 7") as info:
            list(loader)
    assert info.value.sample_index == 7
    notes = "\n".join(getattr(info.value, "__notes__", []))
    assert "read_transform" in notes and "sample 7" in notes
    if workers:
        assert "Worker traceback" in notes and "crop_or_fail" in notes


def test_rotation_epochs_are_transformed_per_serve(tmp_path):
    with CachedLoader(ArangeDataset(12, shape=(3,)), batch_size=4, nb_worker=2, seed=5, read_transform=jitter,
                      rotation_setting={"medium": "memory", "rotation": 2, "size": 6}) as loader:
        served = [(int(y), tuple(x.tolist())) for b in loader for y, x in zip(b["y"], b["x"])]
    assert sorted(y for y, _ in served) == sorted(list(range(12)) * 2)
    for i in range(12):
        first, second = [x for y, x in served if y == i]
        assert first != second and all(i <= v < i + 1 for v in first + second)


def negate_in_place(sample, rng):
    """An in-place augmentation, as many are (``img *= -1``)."""
    sample[0].mul_(-1)
    return sample


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("backend", ["memmap", "lmdb", "memory"])
def test_an_in_place_transform_changes_neither_the_dataset_nor_the_store(tmp_path, workers, backend):
    from torch.utils.data import TensorDataset

    data = torch.arange(24, dtype=torch.float32).reshape(24, 1)
    dataset = TensorDataset(data.clone(), torch.arange(24))  # __getitem__ returns views of these tensors
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "backend": backend}
    with CachedLoader(dataset, batch_size=4, nb_worker=workers, shuffle=False, cache_setting=cache, seed=0,
                      read_transform=negate_in_place, use_threading=False) as loader:
        for _ in range(4):  # generate, read, generate, read
            assert [float(x) for b in loader for x in b[0][:, 0]] == [-float(i) for i in range(24)]
        assert torch.equal(dataset.tensors[0], data), "the dataset's own tensors were changed"
        store = loader.store
        reader = store.reader()
        assert [float(reader[i][0][0]) for i in range(24)] == [float(i) for i in range(24)], "the store changed"
        reader.close()


def draws_globally(sample, rng):
    sample["py"], sample["torch"] = random.random(), float(torch.rand(1))
    return sample


@pytest.mark.parametrize("threads", [False, True], ids=["in-process", "threads"])
def test_read_transform_gives_the_loops_generators_back(threads):
    """The loop's own draws depend on its seed, not on the transform's reseeding."""
    def loop_draws(seed: int) -> list[float]:
        torch.manual_seed(seed)
        random.seed(seed)
        draws = []
        with CachedLoader(ArangeDataset(8), batch_size=2, nb_worker=2 if threads else 0, use_threading=threads,
                          shuffle=False, seed=0, read_transform=draws_globally) as loader:
            for _ in loader:
                draws += [float(torch.rand(1)), random.random()]
        return draws

    assert loop_draws(1) != loop_draws(2)
    torch.manual_seed(1)
    random.seed(1)
    expected = []
    for _ in range(4):
        expected += [float(torch.rand(1)), random.random()]
    if not threads:  # threads' draws interleave with the loop's, but never reseed it
        assert loop_draws(1) == expected
