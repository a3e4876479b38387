"""Resuming a stream's run: in the middle of its generate epoch (the stream iterated again, what was served
skipped) and of a cached epoch (exactly, as for map-style data)."""

from __future__ import annotations

import numpy as np
import pytest

from loader import CachedLoader

from .stream_datasets import Counting, iterations


def labels(batch: dict) -> list[int]:
    return [int(v) for v in np.asarray(batch["i"]).ravel()]


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_in_the_generate_epoch(tmp_path, shuffle: bool, workers: int) -> None:
    log = str(tmp_path / "log")
    kwargs = dict(batch_size=4, num_workers=workers, shuffle=shuffle, seed=7,
                  cache_setting={"prefix": str(tmp_path / "cache"), "stream_buffer": 6})
    with CachedLoader(Counting(30, log), **kwargs) as full:
        expected = [labels(b) for b in full]
    with CachedLoader(Counting(30, log), cache_setting={"prefix": str(tmp_path / "other"), "stream_buffer": 6},
                      **{k: v for k, v in kwargs.items() if k != "cache_setting"}) as first:
        served = []
        for k, batch in enumerate(first):
            served.append(labels(batch))
            if k == 2:
                state = first.state_dict()
                break
    with CachedLoader(Counting(30, log), cache_setting={"prefix": str(tmp_path / "other"), "stream_buffer": 6},
                      **{k: v for k, v in kwargs.items() if k != "cache_setting"}) as second:
        second.load_state_dict(state)
        served += [labels(b) for b in second]
        assert second.epoch_stats[-1].committed
        assert sorted(v for b in [labels(b) for b in second] for v in b) == list(range(30))  # then cached
    assert served == expected  # the same batches as a run that was never stopped


def test_resume_in_a_cached_epoch_is_exact(tmp_path) -> None:
    log = str(tmp_path / "log")
    kwargs = dict(batch_size=4, num_workers=2, shuffle=True, seed=5, cache_setting={"prefix": str(tmp_path)})
    with CachedLoader(Counting(30, log), **kwargs) as first:
        list(first)  # the generate epoch
        served = []
        for k, batch in enumerate(first):
            served.append(labels(batch))
            if k == 3:
                state = first.state_dict()
                break
    with CachedLoader(Counting(30, log), **kwargs) as second:
        second.load_state_dict(state)
        served += [labels(b) for b in second]
        assert second.epoch_stats[-1].mode.value == "read"
    assert sorted(v for b in served for v in b) == list(range(30))
    assert iterations(log) == 2  # only the generate epoch iterated the stream

