"""A stream with a cache: iterated once into a generation in arrival order, then read in a new order each epoch."""

from __future__ import annotations

import numpy as np
import pytest

from loader import CachedLoader

from .stream_datasets import Counting, Endless, iterations


def served(loader: CachedLoader) -> list[int]:
    return [int(v) for b in loader for v in np.asarray(b["i"]).ravel()]


@pytest.mark.parametrize("workers", [0, 2])
def test_generate_then_cached_epochs(tmp_path, workers: int) -> None:
    log = str(tmp_path / "log")
    cache = {"prefix": str(tmp_path / "cache")}
    with CachedLoader(Counting(37, log), batch_size=4, num_workers=workers, shuffle=True,
                      cache_setting=cache) as loader:
        with pytest.raises(TypeError, match="has no len"):
            len(loader)
        orders = []
        for epoch in range(4):
            order = served(loader)
            assert sorted(order) == list(range(37)), epoch  # every sample exactly once
            orders.append(order)
            assert len(loader) == 10  # exact once a generation exists
        stats = loader.epoch_stats
        assert [s.mode.value for s in stats] == ["generate", "read", "read", "read"]
        assert stats[0].written == 37 and stats[0].committed
        assert [s.computed for s in stats[1:]] == [0, 0, 0]
    assert iterations(log) == max(workers, 1)  # 0 dataset iterations in cached epochs
    assert len({tuple(o) for o in orders}) == 4  # a new order every epoch


def test_arrival_order_is_the_index_and_unshuffled_epochs_serve_it(tmp_path) -> None:
    """Index = arrival position, the workers' batches in torch's turn: unshuffled, every epoch serves the
    generate epoch's order again."""
    with CachedLoader(Counting(10), batch_size=2, num_workers=2, cache_setting={"prefix": str(tmp_path)}) as loader:
        first = served(loader)
        assert first == [0, 2, 1, 3, 4, 6, 5, 7, 8, 9]
        assert served(loader) == first
        with loader.store.reader() as reader:  # type: ignore[union-attr]
            assert [int(reader[k]["i"]) for k in range(10)] == first


def test_a_new_loader_reads_what_a_stream_wrote(tmp_path) -> None:
    log = str(tmp_path / "log")
    cache = {"prefix": str(tmp_path / "cache")}
    with CachedLoader(Counting(12, log), batch_size=5, num_workers=2, cache_setting=cache) as loader:
        served(loader)
    with CachedLoader(Counting(12, log), batch_size=5, num_workers=2, shuffle=True, cache_setting=cache) as loader:
        assert len(loader) == 3
        assert sorted(served(loader)) == list(range(12))
        assert loader.epoch_stats[0].mode.value == "read"
    assert iterations(log) == 2


def test_shuffle_buffer_in_the_generate_epoch(tmp_path) -> None:
    cache = {"prefix": str(tmp_path), "stream_buffer": 8}
    with CachedLoader(Counting(40), batch_size=4, num_workers=0, shuffle=True, seed=3,
                      cache_setting=cache) as loader:
        first = served(loader)
    assert sorted(first) == list(range(40)) and first != list(range(40))
    # a buffer of 8 lets a sample come out at most 8 places early
    assert all(pos >= i - 8 for pos, i in enumerate(first))
    cache = {"prefix": str(tmp_path / "b"), "stream_buffer": 0}
    with CachedLoader(Counting(40), batch_size=4, num_workers=0, shuffle=True, cache_setting=cache) as loader:
        assert served(loader) == list(range(40))


def test_update_frequency_iterates_again_every_k_epochs(tmp_path) -> None:
    log = str(tmp_path / "log")
    with CachedLoader(Counting(9, log), batch_size=4, num_workers=0, shuffle=True,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        counts = []
        for _ in range(5):
            assert sorted(served(loader)) == list(range(9))
            counts.append(iterations(log))
        assert [s.mode.value for s in loader.epoch_stats] == ["generate", "read", "generate", "read", "generate"]
    assert counts == [1, 1, 2, 2, 3]


def test_an_endless_stream_needs_stream_samples(tmp_path) -> None:
    with pytest.raises(ValueError, match="stream_samples"):
        CachedLoader(Endless(), batch_size=4, cache_setting={"prefix": str(tmp_path)})
    cache = {"prefix": str(tmp_path), "stream_samples": 30}
    with CachedLoader(Endless(), batch_size=4, num_workers=2, shuffle=True, cache_setting=cache) as loader:
        first = served(loader)
        assert len(first) == 30 and len(loader) == 8
        second = served(loader)
    assert sorted(first) == sorted(second) and len(set(first)) == 30


def test_shuffle_needs_a_cache_and_stream_settings_are_checked(tmp_path) -> None:
    with pytest.raises(ValueError, match="expected unspecified shuffle"):
        CachedLoader(Counting(4), batch_size=2, shuffle=True)
    for key, value in (("stream_buffer", -1), ("stream_samples", 0)):
        with pytest.raises(ValueError, match=key):
            CachedLoader(Counting(4), cache_setting={"prefix": str(tmp_path), key: value})


def test_read_transform_on_every_epoch(tmp_path) -> None:
    def plus(sample: dict, rng: np.random.Generator) -> dict:
        return {"i": sample["i"], "x": sample["x"] + rng.integers(1, 100)}

    with CachedLoader(Counting(8), batch_size=4, num_workers=0, shuffle=True, read_transform=plus,
                      cache_setting={"prefix": str(tmp_path)}) as loader:
        for _ in range(2):
            for batch in loader:
                assert (np.asarray(batch["x"])[:, 0] > np.asarray(batch["i"])).all()
    with CachedLoader(Counting(8), batch_size=4, num_workers=0, cache_setting={"prefix": str(tmp_path)}) as loader:
        assert all((np.asarray(b["x"])[:, 0] == np.asarray(b["i"])).all() for b in loader)  # stored untransformed


def test_several_consumers(tmp_path) -> None:
    """Without a cache each consumer (rank) iterates its own stream; a cache shared by consumers given by hand
    (not torchrun's ranks: test_stream_ranks.py) is refused."""
    with pytest.raises(ValueError, match="several consumers"):
        CachedLoader(Counting(8), nb_consumer=2, consumer_index=0, cache_setting={"prefix": str(tmp_path)})
    for rank in range(2):
        with CachedLoader(Counting(8), batch_size=4, num_workers=0, nb_consumer=2, consumer_index=rank) as loader:
            assert served(loader) == list(range(8))


def test_read_transform_without_a_cache() -> None:
    def plus(sample: dict, rng: np.random.Generator) -> dict:
        return {"i": sample["i"], "x": sample["x"] + rng.integers(1, 100)}

    with CachedLoader(Counting(8), batch_size=4, num_workers=2, read_transform=plus) as loader:
        batches = list(loader)
    assert sorted(v for b in batches for v in np.asarray(b["i"]).tolist()) == list(range(8))
    assert all((np.asarray(b["x"])[:, 0] > np.asarray(b["i"])).all() for b in batches)
