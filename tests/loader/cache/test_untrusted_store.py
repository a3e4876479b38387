"""A loader reading a cached epoch never runs the code of whoever wrote the store.

The store under the loader's prefix holds samples with a pickled leaf whose unpickling writes a
file (the same dataset, cached by a run that passed ``allow_pickle``). A loader that did not pass
``allow_pickle`` refuses to read them, naming the option, and no file appears.
"""

from __future__ import annotations

import os

import pytest

from cachestore import PickleRefusedError
from loader import CachedLoader

from ..datasets import PlantedDataset

pytestmark = pytest.mark.timeout(90)


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_a_cached_epoch_with_a_pickled_leaf_is_refused_without_allow_pickle(no_leaks, nb_worker):
    marker = str(no_leaks / "marker")
    params = {"marker": marker, "n": 8}
    prefix = str(no_leaks / "cache")
    with CachedLoader(PlantedDataset, params, batch_size=4, nb_worker=0,
                      cache_setting={"prefix": prefix, "allow_pickle": True}) as loader:
        assert sorted(y for b in loader for y in b["y"].tolist()) == list(range(8))
        assert loader.epoch_stats[0].mode == "generate"
    if os.path.exists(marker):
        os.unlink(marker)  # the writer's own run may unpickle its own objects (its batches are copied)
    with CachedLoader(PlantedDataset, params, batch_size=4, nb_worker=nb_worker,
                      cache_setting={"prefix": prefix}) as loader:
        with pytest.raises(PickleRefusedError, match="generation 0 .* pickled leaf.* allow_pickle=True"):
            list(loader)
    assert not os.path.exists(marker), "the store's pickled leaf ran in the reading loader"
