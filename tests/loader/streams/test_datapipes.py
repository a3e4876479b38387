"""torch's datapipes, driven as torch's DataLoader drives them: shuffle, one seed per epoch, shards."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper
from torch.utils.data.datapipes.map import SequenceWrapper

from loader import CachedLoader

from ...marks import long

pytestmark = pytest.mark.timeout(120)


def shuffled_shards(n: int):
    # A shuffler before the sharding filter: each worker keeps its share of one permutation only if
    # every worker's shuffler draws the same one.
    return IterableWrapper(list(range(n))).shuffle(buffer_size=7).sharding_filter()


def served(loader) -> list[int]:
    return [int(x) for batch in loader for x in batch.reshape(-1)]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_shuffled_sharded_datapipe_serves_each_sample_once_and_repeats_under_one_torch_seed(workers):
    with CachedLoader(shuffled_shards(40), batch_size=3, shuffle=True, nb_worker=workers, device="cpu") as loader:
        first = served(loader)
        assert sorted(first) == list(range(40))
        assert first != list(range(40))
        runs = []
        for seed in (123, 123, 321):
            torch.manual_seed(seed)  # torch draws each epoch's seed from its global generator at iter()
            runs.append(served(loader))
        assert runs[0] == runs[1]
        assert runs[2] != runs[0] and sorted(runs[2]) == list(range(40))


def test_shuffle_false_turns_a_datapipes_shuffler_off_and_true_adds_one():
    with CachedLoader(shuffled_shards(20), batch_size=4, shuffle=False, nb_worker=0, device="cpu") as loader:
        assert served(loader) == list(range(20))
    with pytest.warns(UserWarning, match="Adding one at the end"):
        loader = CachedLoader(IterableWrapper(list(range(20))), batch_size=4, shuffle=True, nb_worker=0,
                              device="cpu")
    with loader:
        out = served(loader)
        assert sorted(out) == list(range(20)) and out != list(range(20))


def test_a_datapipe_with_a_seed_repeats_its_epochs_across_loaders():
    def epochs() -> list[list[int]]:
        with CachedLoader(shuffled_shards(30), batch_size=5, shuffle=True, nb_worker=2, seed=7,
                          device="cpu") as loader:
            return [served(loader) for _ in range(2)]

    a, b = epochs(), epochs()
    assert a == b and a[0] != a[1]
    assert sorted(a[0]) == sorted(a[1]) == list(range(30))


def test_a_datapipes_seed_sharding_and_iteration_are_not_its_identity():
    from loader.cache.fingerprint import state_hash
    from loader.datapipes import seed_pipes, shard

    # Each shuffler holds a random.Random seeded by the OS: two equal pipes hold different states.
    pipe = shuffled_shards(10)
    assert state_hash(pipe) == state_hash(shuffled_shards(10))
    before = state_hash(pipe)
    seed_pipes(pipe, 5)
    shard(pipe, 1, 0, (1, 0))
    assert sorted(pipe) == list(range(10))
    assert state_hash(pipe) == before
    other = shuffled_shards(10)
    other.source_datapipe.set_shuffle(False)  # shuffle= stays part of it: another arrival order
    changed = [IterableWrapper(list(range(11))).shuffle(buffer_size=7).sharding_filter(),
               IterableWrapper(list(range(10))).shuffle(buffer_size=8).sharding_filter(), other]
    assert len({before, *map(state_hash, changed)}) == 4
    # A map-style datapipe's shuffler: the permutation it drew is its seed's, not part of it.
    mapped = SequenceWrapper(list(range(10))).shuffle()
    before = state_hash(mapped)
    assert before == state_hash(SequenceWrapper(list(range(10))).shuffle())
    seed_pipes(mapped, 5)
    assert sorted(mapped) == list(range(10)) and state_hash(mapped) == before


@pytest.mark.parametrize("workers", [0, pytest.param(2, marks=long)])
def test_a_cached_datapipe_keeps_its_store_across_epochs_and_runs(tmp_path, workers):
    # With no workers the training process seeds, shards and iterates the user's own datapipe: its
    # fingerprint, taken again at the next iter(), must still name the store epoch 0 wrote.
    def run() -> tuple[list[list[int]], list[str]]:
        with CachedLoader(shuffled_shards(30), batch_size=4, shuffle=True, nb_worker=workers, device="cpu",
                          cache_setting={"prefix": str(tmp_path)}) as loader:
            out = [served(loader) for _ in range(2)]
            return out, [s.mode.value for s in loader.epoch_stats]

    epochs, modes = run()
    assert modes == ["generate", "read"]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(30))
    epochs, modes = run()  # a new run, a new but equal datapipe: the same store, read
    assert modes == ["read", "read"]
    assert sorted(epochs[0]) == list(range(30))
