"""A stream without a cache is served as torch's DataLoader serves an IterableDataset."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from loader import CachedLoader
from loader.errors import WorkerError

from .stream_datasets import Counting, Dying, Failing, Plain, Sized, Uneven, iterations

# torch's own loaders here use 3 workers on a machine that may have 2 cores
pytestmark = pytest.mark.filterwarnings("ignore:This DataLoader will create")


def values(batches: object) -> list:
    """Every batch as plain nested lists (tensors and arrays alike)."""
    out = []
    for b in batches:  # type: ignore[attr-defined]
        if isinstance(b, dict):
            b = b["i"]
        out.append(np.asarray(b).tolist())
    return out


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("batch_size,drop_last", [(4, False), (4, True), (None, False)])
def test_order_is_torchs(workers: int, batch_size: int | None, drop_last: bool) -> None:
    stream = Counting(23)
    expected = values(DataLoader(stream, batch_size=batch_size, num_workers=workers, drop_last=drop_last))
    with CachedLoader(stream, batch_size=batch_size, num_workers=workers, drop_last=drop_last) as loader:
        assert values(loader) == expected
        assert values(loader) == expected  # every epoch iterates the stream again


def test_workers_running_out_at_different_times_leave_the_turn() -> None:
    stream = Uneven([1, 7, 3])
    expected = values(DataLoader(stream, batch_size=2, num_workers=3))
    with CachedLoader(stream, batch_size=2, num_workers=3) as loader:
        assert values(loader) == expected


def test_an_iterable_that_is_not_a_torch_dataset(tmp_path) -> None:
    # torch takes an object that is not an IterableDataset for a map-style one: the turn, by hand
    with CachedLoader(Plain(10), batch_size=3, num_workers=2) as loader:
        assert values(loader) == [[0, 2, 4], [1, 3, 5], [6, 8], [7, 9]]


def test_dataset_class_with_params(tmp_path) -> None:
    log = str(tmp_path / "log")
    with CachedLoader(dataset_class=Counting, dataset_params={"n": 9, "log": log}, batch_size=4,
                      num_workers=2) as loader:
        assert sorted(v for b in values(loader) for v in b) == list(range(9))
    assert iterations(log) == 2  # one iterator per worker


def test_length_as_torch() -> None:
    with CachedLoader(Counting(10), batch_size=4, num_workers=0) as loader:
        with pytest.raises(TypeError, match="has no len"):
            len(loader)
    for drop_last in (False, True):
        with CachedLoader(Sized(10), batch_size=4, num_workers=0, drop_last=drop_last) as loader:
            assert len(loader) == len(DataLoader(Sized(10), batch_size=4, drop_last=drop_last))


@pytest.mark.parametrize("name,value", [("shuffle", True), ("sampler", [0, 1])])
def test_refused_as_torch_without_a_cache(name: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"expected unspecified {name}"):
        CachedLoader(Counting(4), batch_size=2, **{name: value})


def test_an_exception_in_a_worker_is_raised_here() -> None:
    with CachedLoader(Failing(5), batch_size=2, num_workers=2, timeout=60) as loader:
        with pytest.raises(LookupError, match="sample 5 is missing"):
            list(loader)


def test_a_worker_killed_mid_stream_fails_the_epoch() -> None:
    with CachedLoader(Dying(40, after=3), batch_size=2, num_workers=2, timeout=60) as loader:
        with pytest.raises(WorkerError, match="exited unexpectedly"):
            list(loader)


def test_a_broken_off_epoch_does_not_leak_into_the_next() -> None:
    stream = Counting(40)
    expected = values(DataLoader(stream, batch_size=2, num_workers=2))
    with CachedLoader(stream, batch_size=2, num_workers=2) as loader:
        for k, _ in enumerate(loader):
            if k == 3:
                break
        assert values(loader) == expected


def test_tensors_from_workers_are_torchs() -> None:
    with CachedLoader(Uneven([3, 3]), batch_size=2, num_workers=2) as loader:
        first = next(iter(loader))
    assert isinstance(first, torch.Tensor) and first.tolist() == [[0, 0], [0, 1]]
