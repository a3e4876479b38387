"""Resuming as torchdata's StatefulDataLoader means it: random draws in the workers are the same after a
resume, a stream's iterator keeps its own state, and ``torch.manual_seed`` decides the order."""

from __future__ import annotations

import pytest
import torch

import cachestore

from loader import CachedLoader

from .stateful_datasets import CountsEpochs, OwnIterator, RandomMap, SetsUpInIter, StateMadeInIter

pytestmark = pytest.mark.timeout(180)


def values(batches) -> list:
    return [[list(map(int, sample)) for sample in zip(*batch)] if isinstance(batch, list) else batch.tolist()
            for batch in batches]


def run_and_resume(make, stop: int) -> tuple[list, list]:
    """The batches of an uninterrupted epoch, and those of one stopped after `stop` batches and resumed by a
    new loader (after other draws from torch's generator in this process)."""
    torch.manual_seed(8)  # an epoch iterated in this process draws from its generator
    with make() as loader:
        expected = values(loader)
    torch.manual_seed(8)
    with make() as loader:
        it = iter(loader)
        served = values(next(it) for _ in range(stop))
        state = loader.state_dict()
    torch.rand(17)  # the training process's generator moved on, as in a new process
    with make() as loader:
        loader.load_state_dict(state)
        served += values(loader)
    return expected, served


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_map_dataset_draws_the_same_after_a_resume(workers):
    def make():
        return CachedLoader(RandomMap(24), batch_size=4, num_workers=workers, shuffle=True, seed=3, device="cpu")

    expected, served = run_and_resume(make, 2)
    assert served == expected


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("stop", [0, 3])
def test_a_streams_iterator_keeps_its_state_and_its_draws(workers, stop):
    # stop=0: a state taken after iter(), before the first batch: in this process, the iterator (and its
    # generator's state) exists from iter() on, as torchdata's.
    def make():
        return CachedLoader(StateMadeInIter(20), batch_size=3, num_workers=workers, seed=4, device="cpu")

    expected, served = run_and_resume(make, stop)
    assert served == expected


def test_the_same_epoch_served_again_draws_the_same_in_the_workers():
    with CachedLoader(StateMadeInIter(20), batch_size=3, num_workers=2, device="cpu") as loader:
        start = loader.state_dict()
        first = values(loader)
        loader.load_state_dict(start)
        assert values(loader) == first


def test_torch_manual_seed_decides_the_order_and_the_state_records_it():
    def order():
        torch.manual_seed(0)
        with CachedLoader(RandomMap(30), batch_size=5, num_workers=0, shuffle=True, device="cpu") as loader:
            return [values(loader) for _ in range(2)], loader.state_dict()["seed"]

    (first, seed), (second, again) = order(), order()
    assert first == second and seed == again
    assert [s[0] for b in first[0] for s in b] != list(range(30))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_between_epochs_keeps_where_the_streams_copies_are(workers):
    # Each copy's epoch counter moved on at the end of its pass: the next epoch, resumed by a new loader
    # on a new object, yields the counter the uninterrupted run's next epoch yields.
    def make():
        return CachedLoader(CountsEpochs(12), batch_size=3, num_workers=workers, seed=1, device="cpu")

    with make() as loader:
        list(loader)
        state = loader.state_dict()
        expected = values(loader)
    with make() as loader:
        loader.load_state_dict(state)
        assert values(loader) == expected
    assert {s[1] for b in expected for s in b} == {1}


def test_a_state_taken_before_a_stream_in_this_process_began_keeps_where_it_was():
    # Taken right after iter(): the stream (its own iterator) was at its start; the loop then iterated it
    # to its end. A new loader on the same object resumes from the start, as torchdata's does.
    stream = OwnIterator(10)
    with CachedLoader(stream, batch_size=3, num_workers=0, device="cpu") as loader:
        it = iter(loader)
        state = loader.state_dict()
        expected = values(it)
    with CachedLoader(stream, batch_size=3, num_workers=0, device="cpu") as loader:
        loader.load_state_dict(state)
        assert values(loader) == expected and len(expected) == 4


@pytest.mark.parametrize("workers", [0, 2])
def test_a_stream_whose_position_is_set_up_in_iter_resumes_there(workers):
    # Its state exists only once __iter__ ran: loaded into what __iter__ returned, and the batches are
    # taken with next() alone (iter() again would set its position up anew).
    stream = SetsUpInIter(40)
    with CachedLoader(stream, batch_size=2, num_workers=workers, device="cpu") as loader:
        it = iter(loader)
        served = [s[0] for b in values(next(it) for _ in range(7)) for s in b]
        state = loader.state_dict()
    with CachedLoader(stream, batch_size=2, num_workers=workers, device="cpu") as loader:
        loader.load_state_dict(state)
        served += [s[0] for b in values(loader) for s in b]
    assert sorted(served) == list(range(40))


def test_a_cached_stream_iterated_here_has_its_iterator_from_iter_on(tmp_path):
    # With a cache and nothing committed, the first epoch iterates the stream in this process: its
    # iterator (whose state __iter__ makes) opens at iter(), as without a cache, so a state taken
    # before the first batch asks it (the stream's own state_dict() failed before __iter__ had run).
    stream = SetsUpInIter(12)
    cache = {"prefix": str(tmp_path), "update_frequency": 2}
    with CachedLoader(stream, batch_size=2, num_workers=0, device="cpu", cache_setting=cache) as loader:
        iter(loader)
        state = loader.state_dict()
    assert state["stream"]["states"] == [[None, {"cursor": {"at": 0, "end": 12}, "iter_calls": 1}]]
    with CachedLoader(SetsUpInIter(12), batch_size=2, num_workers=0, device="cpu", cache_setting=cache) as loader:
        loader.load_state_dict(state)
        assert sorted(s[0] for b in values(loader) for s in b) == list(range(12))


def test_a_state_taken_before_the_first_iter_pins_the_generation_another_writer_then_commits(tmp_path):
    # torchdata's meaning: a state is where the run is. Taken before the first iter(), it says which
    # generation the first epoch reads, and both this loader and one restored from it read that one,
    # though another writer of the prefix committed a newer generation in between (before, both moved
    # on to the newer one: the state did not say).
    def make():
        return CachedLoader(RandomMap(24), batch_size=4, num_workers=2, shuffle=True, seed=5, device="cpu",
                            cache_setting={"prefix": str(tmp_path), "update_frequency": 2})

    with make() as loader:
        first = values(loader)  # epoch 0 writes generation 0
    with make() as loader:
        state = loader.state_dict()
        with cachestore.open_store(str(tmp_path)) as store, store.writer(1, num_samples=24) as writer:
            for i in range(24):
                writer.put(i, [i, 1000 + i])  # numbers RandomMap never draws
            writer.commit()
        assert values(loader) == first
    with make() as restored:
        restored.load_state_dict(state)
        assert values(restored) == first
