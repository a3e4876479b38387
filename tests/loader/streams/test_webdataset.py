"""webdataset's streams as they are: tar shards written with TarWriter, read by WebDataset, cached, shuffled."""

from __future__ import annotations

import os

import numpy as np
import pytest

from loader import CachedLoader

wds = pytest.importorskip("webdataset")

# webdataset leaves its last shard's file to the garbage collector, even when iterated to its end
pytestmark = [pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]

SHARDS, PER_SHARD = 4, 25


def write_shards(root: str) -> list[str]:
    urls = []
    for shard in range(SHARDS):
        path = os.path.join(root, f"shard-{shard:03d}.tar")
        with wds.TarWriter(path) as sink:
            for k in range(PER_SHARD):
                i = shard * PER_SHARD + k
                sink.write({"__key__": f"{i:06d}", "npy": np.full((4, 4), i, dtype=np.float32), "cls": i})
        urls.append(path)
    return urls


def labels(loader: CachedLoader) -> list[int]:
    return [int(v) for _x, y in loader for v in np.asarray(y).ravel()]


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_cached_and_shuffled(tmp_path, workers: int) -> None:
    urls = write_shards(str(tmp_path))
    stream = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls")
    with CachedLoader(stream, batch_size=10, num_workers=workers, shuffle=True,
                      cache_setting={"prefix": str(tmp_path / "cache")}) as loader:
        orders = [labels(loader) for _ in range(3)]
        modes = [s.mode.value for s in loader.epoch_stats]
        first = next(iter(loader))
    n = SHARDS * PER_SHARD
    assert all(sorted(order) == list(range(n)) for order in orders)
    assert modes == ["generate", "read", "read"] and len({tuple(o) for o in orders}) == 3
    x, y = first
    assert np.asarray(x).shape == (10, 4, 4) and (np.asarray(x)[:, 0, 0] == np.asarray(y)).all()


def test_webdataset_without_a_cache_is_torchs(tmp_path) -> None:
    from torch.utils.data import DataLoader

    urls = write_shards(str(tmp_path))
    stream = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls")
    expected = [np.asarray(y).tolist() for _x, y in DataLoader(stream, batch_size=8, num_workers=2)]
    with CachedLoader(stream, batch_size=8, num_workers=2) as loader:
        assert [np.asarray(y).tolist() for _x, y in loader] == expected


def test_resampled_webdataset_needs_stream_samples(tmp_path) -> None:
    urls = write_shards(str(tmp_path))
    endless = wds.WebDataset(urls, resampled=True, shardshuffle=False).decode().to_tuple("npy", "cls")
    with pytest.raises(ValueError, match="stream_samples"):
        CachedLoader(endless, batch_size=8, cache_setting={"prefix": str(tmp_path / "cache")})
    with CachedLoader(endless, batch_size=8, num_workers=0, shuffle=True,
                      cache_setting={"prefix": str(tmp_path / "cache"), "stream_samples": 40}) as loader:
        assert len(labels(loader)) == 40 and len(loader) == 5


def test_the_fingerprint_covers_the_shard_list(tmp_path) -> None:
    from cachestore.errors import FingerprintMismatchError

    urls = write_shards(str(tmp_path))
    cache = {"prefix": str(tmp_path / "cache")}
    first = wds.WebDataset(urls[:2], shardshuffle=False).decode().to_tuple("npy", "cls")
    with CachedLoader(first, batch_size=10, num_workers=0, cache_setting=cache) as loader:
        assert len(labels(loader)) == 2 * PER_SHARD
    more = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls")
    with pytest.raises(FingerprintMismatchError, match="state"):
        with CachedLoader(more, batch_size=10, num_workers=0, cache_setting=cache) as loader:
            list(loader)
    with CachedLoader(more, batch_size=10, num_workers=0, cache_setting={**cache, "on_mismatch": "regenerate"}) as loader:
        assert sorted(labels(loader)) == list(range(SHARDS * PER_SHARD))
