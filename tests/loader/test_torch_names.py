"""torch's DataLoader arguments: the same names, the same meaning, the same errors for conflicts."""

from __future__ import annotations

import multiprocessing
import threading

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, DistributedSampler, RandomSampler, SequentialSampler, SubsetRandomSampler

from cachestore import FingerprintMismatchError, open_store
from loader import CachedLoader

from ..marks import long
from .datasets import ArangeDataset, read_calls

pytestmark = pytest.mark.timeout(120)


def ys(loader) -> list[int]:
    return [int(y) for batch in loader for y in batch["y"]]


# ---------------------------------------------------------------------------- conflicts, as torch says them
NOT_A_CONTEXT = object()


@pytest.mark.parametrize("kwargs, message", [
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False), "batch_size": 4}, "batch_sampler"),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False), "shuffle": True}, "batch_sampler"),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False), "drop_last": True}, "batch_sampler"),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False), "sampler": range(8)}, "batch_sampler"),
    ({"sampler": SequentialSampler(range(8)), "shuffle": True}, "sampler option is mutually exclusive with shuffle"),
    ({"batch_sampler": BatchSampler(SequentialSampler(range(8)), 2, False), "sampler": SequentialSampler(range(8)),
      "shuffle": 3}, "sampler option is mutually exclusive with shuffle"),
    ({"num_workers": 0, "prefetch_factor": 2}, "prefetch_factor option could only be specified in multiprocessing"),
    ({"num_workers": 0, "persistent_workers": True}, "persistent_workers option needs num_workers > 0"),
    ({"num_workers": 0, "multiprocessing_context": "fork"}, "multiprocessing_context can only be used"),
    ({"num_workers": 1, "multiprocessing_context": "bad"}, "should specify a valid start method in"),
    ({"num_workers": 1, "multiprocessing_context": NOT_A_CONTEXT}, "should be a valid context object"),
])
def test_conflicting_arguments_raise_torchs_errors(kwargs, message):
    # What torch says for the same pair, with the same exception type.
    with pytest.raises((ValueError, TypeError), match=message) as theirs:
        torch.utils.data.DataLoader(ArangeDataset(8), **kwargs)
    with pytest.raises(type(theirs.value), match=message) as ours:
        CachedLoader(ArangeDataset(8), **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_defaults_do_not_conflict():
    # shuffle defaults to off with a sampler, batch_size to 1 with a batch sampler: nothing passed, no conflict.
    with CachedLoader(ArangeDataset(8), sampler=SequentialSampler(range(8)), nb_worker=0) as loader:
        assert loader.shuffle is False and ys(loader) == list(range(8))
    with CachedLoader(ArangeDataset(8), batch_sampler=BatchSampler(SequentialSampler(range(8)), 3, False),
                      nb_worker=0) as loader:
        assert [b["y"].tolist() for b in loader] == [[0, 1, 2], [3, 4, 5], [6, 7]] and len(loader) == 3



def test_torch_names_map_onto_the_loader(tmp_path):
    generator = torch.Generator().manual_seed(1234)
    context = multiprocessing.get_context("spawn")
    with CachedLoader(ArangeDataset(16), batch_size=4, num_workers=2, generator=generator, persistent_workers=True,
                      prefetch_factor=3, multiprocessing_context=context) as loader:
        assert loader.nb_worker == 2 and loader.seed == 1234 and loader.start_method == "spawn"
        assert loader.max_queue_size == 6  # prefetch_factor batches per worker in flight
        assert sorted(ys(loader)) == list(range(16))
    with pytest.raises(ValueError, match="seed or generator"):
        CachedLoader(ArangeDataset(4), generator=generator, seed=3)
    with pytest.raises(ValueError, match="disagree"):
        CachedLoader(ArangeDataset(4), multiprocessing_context="fork", start_method="spawn")
    with pytest.raises(ValueError, match="max_queue_size or prefetch_factor"):
        CachedLoader(ArangeDataset(4), num_workers=2, prefetch_factor=3, max_queue_size=50)


# ---------------------------------------------------------------------------- torch's attributes
def served_order(loader) -> list[int]:
    return [int(y) for batch in loader for y in batch["y"]]


def test_torchs_attributes_hold_torchs_values():
    from loader.attributes import BatchSampler as OurBatchSampler, RandomSampler as OurRandomSampler

    dataset, generator = ArangeDataset(10), torch.Generator().manual_seed(3)
    theirs = torch.utils.data.DataLoader(dataset, batch_size=4, shuffle=True, generator=generator)
    with CachedLoader(dataset, batch_size=4, num_workers=0, shuffle=True, generator=generator) as loader:
        for name in ("dataset", "batch_size", "drop_last", "num_workers", "prefetch_factor", "generator",
                     "multiprocessing_context", "persistent_workers"):
            assert getattr(loader, name) is getattr(theirs, name) or getattr(loader, name) == getattr(theirs, name), name
        assert isinstance(loader.sampler, OurRandomSampler) and isinstance(loader.batch_sampler, OurBatchSampler)
        assert loader.sampler is loader.sampler and loader.batch_sampler.sampler is loader.sampler
        assert len(loader.sampler) == len(theirs.sampler) == 10 and loader.sampler.generator is generator
        assert len(loader.batch_sampler) == len(theirs.batch_sampler) == len(loader) == 3
        # The sampler's order is the one the next epoch serves, a new one every epoch.
        for _ in range(2):
            order = list(loader.sampler)
            assert [i for b in loader.batch_sampler for i in b] == order and sorted(order) == list(range(10))
            assert served_order(loader) == order
        assert list(loader.sampler) != order


def test_a_given_sampler_is_the_loaders_sampler():
    dataset = ArangeDataset(9)
    with CachedLoader(dataset, batch_size=2, num_workers=0, shuffle=False) as loader:
        assert list(loader.sampler) == list(range(9)) and len(loader.batch_sampler) == 5
        assert [len(b) for b in loader.batch_sampler] == [2, 2, 2, 2, 1]
    sampler = SubsetRandomSampler([1, 3, 5])
    with CachedLoader(dataset, batch_size=2, num_workers=0, sampler=sampler, drop_last=True) as loader:
        assert loader.sampler is sampler and loader.batch_sampler.sampler is sampler
        assert len(loader.batch_sampler) == len(loader) == 1
    batches = BatchSampler(SequentialSampler(dataset), 4, False)
    with CachedLoader(dataset, num_workers=0, batch_sampler=batches) as loader:
        assert loader.batch_sampler is batches and list(loader.sampler) == list(range(9))
    distributed = DistributedSampler(dataset, num_replicas=2, rank=1, seed=0)
    with CachedLoader(dataset, batch_size=2, num_workers=0, sampler=distributed) as loader:
        assert loader.sampler is distributed


def test_worker_attributes_hold_torchs_values():
    with CachedLoader(ArangeDataset(8), batch_size=4, num_workers=2, prefetch_factor=3, persistent_workers=True,
                      multiprocessing_context="spawn") as loader:
        assert (loader.num_workers, loader.prefetch_factor, loader.persistent_workers) == (2, 3, True)
        assert isinstance(loader.multiprocessing_context, multiprocessing.context.BaseContext)
        assert loader.multiprocessing_context.get_start_method() == "spawn" and loader.start_method == "spawn"
        assert sorted(ys(loader)) == list(range(8))
    with CachedLoader(ArangeDataset(8), batch_size=4, num_workers=2, max_queue_size=10) as loader:
        # Not given: the queue depth in torch's unit; workers persist whatever persistent_workers says.
        assert (loader.prefetch_factor, loader.persistent_workers, loader.multiprocessing_context) == (5, True, None)


@pytest.mark.parametrize("name", ["batch_size", "sampler", "batch_sampler", "drop_last", "dataset",
                                  "persistent_workers", "num_workers", "shuffle"])
def test_setting_an_attribute_torch_fixes_raises_valueerror(name):
    theirs = torch.utils.data.DataLoader(ArangeDataset(8))
    with CachedLoader(ArangeDataset(8), batch_size=4, nb_worker=0) as loader:
        before = getattr(loader, name)
        if name in ("batch_size", "sampler", "batch_sampler", "drop_last", "dataset", "persistent_workers"):
            with pytest.raises(ValueError, match=f"{name} attribute should not be set after") as said:
                setattr(theirs, name, 3)
            assert str(said.value).startswith(f"{name} attribute should not be set after DataLoader is initialized")
        with pytest.raises(ValueError, match=f"{name} attribute should not be set after CachedLoader is initialized"):
            setattr(loader, name, 3)
        with pytest.raises(AttributeError):  # Python's error for a read-only attribute, too
            setattr(loader, name, 3)
        assert getattr(loader, name) is before
        assert sorted(ys(loader)) == list(range(8))


# ---------------------------------------------------------------------------- batch_size=None
@pytest.mark.parametrize("workers", [0, 2])
def test_batch_size_none_serves_samples_one_by_one(tmp_path, workers):
    from .datasets import MixedDataset

    dataset = MixedDataset(5)
    theirs = list(torch.utils.data.DataLoader(dataset, batch_size=None))
    with CachedLoader(dataset, batch_size=None, num_workers=workers, shuffle=False, device="cpu",
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        assert loader.batch_size is None and loader.batch_sampler is None and len(loader) == 5
        for mode in ("generate", "read"):
            ours = list(loader)
            assert loader.epoch_stats[-1].mode == mode
            for mine, torchs in zip(ours, theirs, strict=True):
                # torch's default_convert: arrays become tensors, Python values stay what they are
                # (a tuple stays a tuple here, as in batches; torch makes lists of tuples in both).
                assert type(mine) is type(torchs) is dict and mine.keys() == torchs.keys()
                assert torch.equal(mine["img"], torchs["img"]) and torch.equal(mine["t"], torchs["t"])
                assert list(mine["pair"]) == torchs["pair"] and type(mine["pair"][0]) is int
                assert type(mine["flag"]) is bool and mine["name"] == torchs["name"]


def test_batch_size_none_applies_collate_fn_to_each_sample():
    with CachedLoader(ArangeDataset(4), batch_size=None, num_workers=0, shuffle=False,
                      collate_fn=lambda sample: sample["y"] * 10) as loader:
        assert list(loader) == [0, 10, 20, 30]
    with pytest.raises(ValueError, match="batch_size=None option disables auto-batching and is mutually exclusive"):
        CachedLoader(ArangeDataset(4), batch_size=None, drop_last=True)


# ---------------------------------------------------------------------------- a dataset that grows
class ListDataset(list):
    """A dataset torch users build: a list of samples, appended to between epochs."""


@pytest.mark.parametrize("workers", [0, 2])
def test_len_and_the_next_epoch_follow_a_dataset_that_grew(workers):
    dataset = ListDataset({"y": i} for i in range(4))
    theirs = torch.utils.data.DataLoader(dataset, batch_size=2)
    with CachedLoader(dataset, batch_size=2, num_workers=workers, shuffle=False) as loader:
        assert len(loader) == len(theirs) == 2 and ys(loader) == list(range(4))
        dataset.append({"y": 4})
        assert len(loader) == len(theirs) == 3  # asked each time, as torch does
        assert len(loader.sampler) == len(theirs.sampler) == 5
        assert ys(loader) == list(range(5))  # the workers were given the dataset as it is now
        assert len(loader) == 3 and loader.num_samples == 5
        dataset.extend([{"y": 5}, {"y": 6}])
        assert len(loader) == 4 and ys(loader) == list(range(7)) and loader.epoch == 2


def test_a_dataset_that_grew_is_another_dataset_for_its_cache(tmp_path):
    dataset = ListDataset({"y": i} for i in range(4))
    prefix = str(tmp_path / "c")
    with CachedLoader(dataset, batch_size=2, num_workers=0, shuffle=False, cache_setting={"prefix": prefix}) as loader:
        assert ys(loader) == list(range(4))
        dataset.append({"y": 4})
        assert len(loader) == 3
        with pytest.raises(FingerprintMismatchError, match=r"the length changed \(stored 4, now 5\)"):
            iter(loader)
    with open_store(prefix, readonly=True) as store:  # what was committed is intact
        assert [int(store.reader()[i]["y"]) for i in range(4)] == list(range(4))
    with CachedLoader(dataset, batch_size=2, num_workers=0, shuffle=False,
                      cache_setting={"prefix": prefix, "on_mismatch": "regenerate"}) as loader:
        assert ys(loader) == list(range(5))
        dataset.append({"y": 5})
        assert ys(loader) == list(range(6)) and loader.epoch_stats[-1].mode == "generate"


def test_torchs_timeout_0_means_no_limit():
    with CachedLoader(ArangeDataset(8), batch_size=4, num_workers=0, timeout=0) as loader:
        assert loader.timeout is None and sorted(ys(loader)) == list(range(8))


def test_a_distributed_samplers_seed_is_the_loaders():
    from torch.utils.data.distributed import DistributedSampler

    sampler = DistributedSampler(ArangeDataset(8), num_replicas=2, rank=0, seed=5)
    with CachedLoader(ArangeDataset(8), sampler=sampler, num_workers=0, seed=5) as loader:
        assert loader.seed == 5
    with pytest.raises(ValueError, match="disagree"):
        CachedLoader(ArangeDataset(8), sampler=sampler, num_workers=0, seed=6)
    with pytest.raises(ValueError, match="give no generator"):
        CachedLoader(ArangeDataset(8), sampler=sampler, num_workers=0, generator=torch.Generator().manual_seed(5))


def test_the_same_generator_seed_gives_the_same_order():
    orders = []
    for _ in range(2):
        with CachedLoader(ArangeDataset(16), batch_size=4, nb_worker=0,
                          generator=torch.Generator().manual_seed(7)) as loader:
            orders.append(ys(loader))
    assert orders[0] == orders[1] and orders[0] != list(range(16))


# ---------------------------------------------------------------------------- worker seeds
class GlobalRandom:
    """Draws from Python's, numpy's legacy and torch's global generators, as augmentations do."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> dict:
        import random

        return {"y": index, "r": np.array([random.random(), np.random.rand(), float(torch.rand(()))])}


def draws(workers: int, start_method: str, seed: int = 11) -> np.ndarray:
    with CachedLoader(GlobalRandom(), batch_size=1, num_workers=workers, shuffle=False, seed=seed,
                      start_method=start_method) as loader:
        return np.concatenate([batch["r"] for batch in loader])


@pytest.mark.parametrize("start_method", ["fork", pytest.param("spawn", marks=long)])
def test_workers_draw_their_own_random_numbers(start_method):
    # Forked workers inherit one state, spawned ones torch's fixed default seed: unseeded, they repeat
    # each other's numbers.
    assert all(len(np.unique(column)) == 8 for column in draws(2, start_method).T)


def test_a_worker_draws_the_same_numbers_again_with_the_same_seed():
    # (With several workers, which worker computes which batch depends on timing.) Forked: a worker
    # that kept the state it inherits would draw the same numbers whatever the seed.
    first = draws(1, "fork")
    assert np.array_equal(first, draws(1, "fork"))
    assert not np.array_equal(first, draws(1, "fork", seed=12))


# ---------------------------------------------------------------------------- worker_init_fn
def record_worker(worker_id: int) -> None:
    import os

    with open(os.environ["CACHESTORE_TEST_INIT_DIR"] + f"/init-{worker_id}-{os.getpid()}", "w"):
        pass


@pytest.mark.parametrize("workers", [0, 2])
def test_worker_init_fn_runs_once_in_each_worker_before_its_first_task(tmp_path, monkeypatch, workers):
    monkeypatch.setenv("CACHESTORE_TEST_INIT_DIR", str(tmp_path))
    with CachedLoader(ArangeDataset(12), batch_size=3, num_workers=workers, worker_init_fn=record_worker) as loader:
        for _ in range(2):
            assert sorted(ys(loader)) == list(range(12))
        pids = set(loader.worker_pids())
    made = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("init-"))
    if workers == 0:
        assert made == []  # as in torch: no worker, no worker_init_fn
    else:
        assert [name.split("-")[1] for name in made] == ["0", "1"]
        assert {int(name.split("-")[2]) for name in made} == pids


# ---------------------------------------------------------------------------- samplers
class EpochSampler(torch.utils.data.Sampler):
    """Draws a different subset every epoch through set_epoch, as DistributedSampler does."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        return iter(range(self.epoch % 2, self.n, 2))

    def __len__(self) -> int:
        return self.n // 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_is_asked_for_each_epoch_and_the_cache_completes(tmp_path, workers):
    calls = tmp_path / "calls"
    calls.mkdir()
    with CachedLoader(ArangeDataset(20, counter_dir=str(calls)), batch_size=4, num_workers=workers,
                      sampler=EpochSampler(20), cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        assert len(loader) == 3
        served = [ys(loader) for _ in range(8)]
        assert served[0] == list(range(0, 20, 2)) and served[1] == list(range(1, 20, 2))
        modes = [s.mode for s in loader.epoch_stats]
    # The generation holds every index once: what the sampler did not draw was computed beside it,
    # and nothing twice.
    assert sorted(read_calls(str(calls))) == list(range(20))
    assert "read" in modes and modes[:modes.index("read")] == ["generate"] * modes.index("read")
    assert modes[modes.index("read"):] == ["read"] * (8 - modes.index("read"))


@pytest.mark.parametrize("workers", [0, 2])
def test_an_index_drawn_twice_is_computed_once(tmp_path, workers):
    calls = tmp_path / "calls"
    calls.mkdir()
    sampler = RandomSampler(range(30), replacement=True, num_samples=60, generator=torch.Generator().manual_seed(0))
    with CachedLoader(ArangeDataset(30, counter_dir=str(calls)), batch_size=5, num_workers=workers, sampler=sampler,
                      cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        first = ys(loader)
        assert len(first) == 60 and len(set(first)) < 60  # it did draw some twice
        for _ in range(6):
            ys(loader)
        assert loader.epoch_stats[-1].mode == "read"
    counted = read_calls(str(calls))
    assert sorted(counted) == list(range(30)), "each index computed exactly once"


@pytest.mark.parametrize("workers", [0, 2])
def test_a_batch_sampler_serves_its_batches(tmp_path, workers):
    batch_sampler = BatchSampler(SubsetRandomSampler(list(range(0, 24, 3)),
                                                     generator=torch.Generator().manual_seed(3)), 3, False)
    with CachedLoader(ArangeDataset(24), batch_sampler=batch_sampler, num_workers=workers,
                      cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        for _ in range(3):
            batches = [b["y"].tolist() for b in loader]
            assert [len(b) for b in batches] == [3, 3, 2]
            assert sorted(sum(batches, [])) == list(range(0, 24, 3))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_over_part_of_the_dataset_completes_the_cache(tmp_path, workers):
    # A train split's sampler: the generate epoch computes the rest too, so epoch 1 reads a committed store.
    calls = tmp_path / "calls"
    calls.mkdir()
    part = list(range(0, 60, 3))
    sampler = SubsetRandomSampler(part, generator=torch.Generator().manual_seed(0))
    with CachedLoader(ArangeDataset(60, counter_dir=str(calls)), batch_size=4, num_workers=workers, sampler=sampler,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}) as loader:
        for _ in range(3):
            assert sorted(ys(loader)) == part
        assert [s.mode.value for s in loader.epoch_stats] == ["generate", "read", "read"]
        assert loader.epoch_stats[0].committed
    assert sorted(read_calls(str(calls))) == list(range(60)), "each index computed exactly once"
    with open_store(str(tmp_path / "c")) as store:
        assert len(store.reader()) == 60


def test_a_sampler_index_out_of_range_is_named():
    with CachedLoader(ArangeDataset(4), batch_size=2, nb_worker=0, sampler=[0, 1, 9]) as loader:
        with pytest.raises(IndexError, match="sampler drew index 9"):
            ys(loader)


def test_a_lock_in_a_sampler_stays_here():
    # The sampler runs in the training process: it is never sent to the workers.
    class Locked(SequentialSampler):
        def __init__(self, data):
            super().__init__(data)
            self.lock = threading.Lock()

    with CachedLoader(ArangeDataset(6), batch_size=3, num_workers=2, sampler=Locked(range(6))) as loader:
        assert ys(loader) == list(range(6))
        assert isinstance(np.asarray(next(iter(loader))["y"]), np.ndarray)


def test_a_state_from_a_sampler_that_draws_more_than_the_dataset_resumes():
    def sampler():
        return RandomSampler(range(8), replacement=True, num_samples=40, generator=torch.Generator().manual_seed(0))

    with CachedLoader(ArangeDataset(8), batch_size=4, num_workers=0, sampler=sampler()) as loader:
        it = iter(loader)
        for _ in range(6):  # past the 2 batches of the dataset itself
            next(it)
        state = loader.state_dict()
        it.close()
    with CachedLoader(ArangeDataset(8), batch_size=4, num_workers=0, sampler=sampler()) as loader:
        loader.load_state_dict(state)
        assert sum(1 for _ in loader) == 10 - 6


class Counting(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


@pytest.mark.parametrize("kwargs, message", [
    ({"num_workers": -1}, "num_workers option should be non-negative"),
    ({"timeout": -1}, "timeout option should be non-negative"),
    ({"dataset": Counting(), "shuffle": True}, "DataLoader with IterableDataset: expected unspecified shuffle"),
    ({"dataset": Counting(), "sampler": [0, 1]}, "DataLoader with IterableDataset: expected unspecified sampler"),
    ({"dataset": Counting(), "batch_sampler": [[0, 1]]},
     "DataLoader with IterableDataset: expected unspecified batch_sampler"),
])
def test_bad_arguments_raise_torchs_words(kwargs, message):
    kwargs = {"dataset": ArangeDataset(8), **kwargs}
    with pytest.raises(ValueError, match=message):
        torch.utils.data.DataLoader(**kwargs)
    with pytest.raises(ValueError, match=message):
        CachedLoader(**kwargs)
