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
    for _ in range(2):  # the same pipeline built again (its shuffler's seed drawn anew) reads the store
        first = wds.WebDataset(urls[:2], shardshuffle=False).decode().to_tuple("npy", "cls")
        with CachedLoader(first, batch_size=10, num_workers=0, cache_setting=cache) as loader:
            assert len(labels(loader)) == 2 * PER_SHARD
    assert loader.epoch_stats[0].mode == "read"
    more = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("npy", "cls")
    with pytest.raises(FingerprintMismatchError, match="state"):
        with CachedLoader(more, batch_size=10, num_workers=0, cache_setting=cache) as loader:
            list(loader)
    with CachedLoader(more, batch_size=10, num_workers=0, cache_setting={**cache, "on_mismatch": "regenerate"}) as loader:
        assert sorted(labels(loader)) == list(range(SHARDS * PER_SHARD))


# The README's example, as a script run twice: a pipeline's identity is its shards and stages.
_README_RUN = """
import json, sys
import numpy as np
import webdataset as wds
from loader import CachedLoader

source, prefix, mismatch, stage = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4]
urls = json.loads(source) if source.startswith("[") else source
stream = wds.WebDataset(urls, shardshuffle=False).decode()
stream = stream.to_tuple("npy", "cls") if stage == "tuple" else stream.to_tuple("npy", "cls").map_tuple(None, lambda y: y + 1000)
with CachedLoader(stream, batch_size=10, num_workers=2, shuffle=True,
                  cache_setting={"prefix": prefix, "on_mismatch": mismatch}) as loader:
    epochs = [sorted(int(v) for _x, y in loader for v in np.asarray(y).ravel()) for _ in range(2)]
    modes = [s.mode.value for s in loader.epoch_stats]
print(json.dumps({"modes": modes, "labels": epochs[0], "same": epochs[0] == epochs[1]}))
"""


def _readme_run(tmp_path, source: str, mismatch: str = "error", stage: str = "tuple"):
    import json
    import subprocess
    import sys

    script = tmp_path / "readme.py"
    script.write_text(_README_RUN)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    done = subprocess.run([sys.executable, "-W", "ignore", str(script), source, str(tmp_path / "cache"), mismatch,
                           stage], capture_output=True, text=True, timeout=180, env=env, cwd=tmp_path)
    if done.returncode != 0:
        return done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("brace", [False, True], ids=["list", "brace"])
def test_two_runs_of_the_readme_example_share_one_store_and_a_rewritten_shard_is_noticed(tmp_path, brace):
    import json

    urls = write_shards(str(tmp_path))
    source = os.path.join(str(tmp_path), "shard-{000..003}.tar") if brace else json.dumps(urls)
    n = SHARDS * PER_SHARD
    first = _readme_run(tmp_path, source)
    assert first == {"modes": ["generate", "read"], "labels": list(range(n)), "same": True}, first
    second = _readme_run(tmp_path, source)
    assert second == {"modes": ["read", "read"], "labels": list(range(n)), "same": True}, second
    changed = _readme_run(tmp_path, source, stage="plus")  # another stage: another dataset
    assert isinstance(changed, str) and "FingerprintMismatchError" in changed
    # Shard 2 written again under its name, with new samples and the same number of them.
    with wds.TarWriter(urls[2]) as sink:
        for k in range(PER_SHARD):
            sink.write({"__key__": f"{k:06d}", "npy": np.zeros((4, 4), dtype=np.float32), "cls": 500 + k})
    refused = _readme_run(tmp_path, source)
    assert isinstance(refused, str) and "FingerprintMismatchError" in refused and "data file" in refused
    regenerated = _readme_run(tmp_path, source, "regenerate")
    expected = sorted([i for i in range(n) if not 2 * PER_SHARD <= i < 3 * PER_SHARD] + list(range(500, 525)))
    assert regenerated == {"modes": ["generate", "read"], "labels": expected, "same": True}, regenerated
