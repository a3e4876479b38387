"""SwiftLoader splits the data as swift_loader does: contiguous runs, the last ones shorter.

The multi-consumer cases are those of swift_loader's own suite (every consumer built and started in
one process, epochs taken consumer after consumer): each consumer serves its run in order, and the
runs joined are the dataset.
"""

from __future__ import annotations

import numpy as np
import pytest

from loader.compat import SwiftLoader

from ...marks import long
from ..compat_datasets import IndexDataset


def served(loader: SwiftLoader) -> list[int]:
    return [i for batch in loader for i in np.asarray(batch).tolist()]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("n, batch, consumers, workers", [
    (50, 5, 2, 1), (47, 4, 3, 2), (97, 5, 4, 1),
    *(pytest.param(*case, marks=long) for case in [(50, 4, 2, 2), (47, 5, 3, 1), (97, 4, 4, 2), (50, 3, 2, 3)]),
])
def test_unshuffled_consumers_get_contiguous_runs_in_order(n, batch, consumers, workers):
    run = -(-n // consumers)
    loaders = [SwiftLoader(IndexDataset, {"size": n}, batch, consumers, workers, shuffle=False, benchmark=False)
               for _ in range(consumers)]
    try:
        for c, loader in enumerate(loaders):
            loader.start(c)
        for _ in range(2):
            everything = []
            for c, loader in enumerate(loaders):
                got = served(loader)
                assert got == list(range(c * run, min((c + 1) * run, n)))
                assert len(loader) == -(-len(got) // batch)
                everything += got
            assert everything == list(range(n))
    finally:
        for loader in loaders:
            loader.close()


@pytest.mark.timeout(120)
def test_shuffled_consumers_get_disjoint_runs_that_move_every_epoch():
    n, consumers, workers = 97, 4, 2
    loaders = [SwiftLoader(IndexDataset, {"size": n}, 4, consumers, workers, shuffle=True, benchmark=False)
               for _ in range(consumers)]
    try:
        for c, loader in enumerate(loaders):
            loader.start(c)
        window = -(-n // (consumers * workers))
        firsts = []
        for epoch in range(3):
            runs = [served(loader) for loader in loaders]
            # swift_loader's sizes: runs of `workers` windows of ceil(n / (consumers * workers)), the last short.
            assert [len(r) for r in runs] == [26, 26, 26, 19]
            assert sorted(i for r in runs for i in r) == list(range(n))
            for c, r in enumerate(runs):
                start = (c * workers * window + epoch * window) % n
                assert set(r) == {(start + j) % n for j in range(len(r))}
            firsts.append(runs[0])
        assert firsts[0] != firsts[1] != firsts[2]
    finally:
        for loader in loaders:
            loader.close()


def test_a_consumer_left_without_samples_is_refused():
    loader = SwiftLoader(IndexDataset, {"size": 9}, 2, 4, 0, shuffle=False, benchmark=False)
    try:
        with pytest.raises(ValueError, match="without samples"):
            loader.start(3)
    finally:
        loader.close()
