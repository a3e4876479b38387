"""torch's datapipes, driven as torch's DataLoader drives them: shuffle, one seed per epoch, shards."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data.datapipes.iter import IterableWrapper

from loader import CachedLoader

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
