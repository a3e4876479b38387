"""Rotation over a stream: a window of its samples, each served R times, shuffled, before it is replaced."""

from __future__ import annotations

import collections

import numpy as np
import pytest

from loader import CachedLoader

from .stream_datasets import Counting, Endless, Sized, iterations


@pytest.mark.parametrize("workers", [0, 2])
def test_each_sample_served_r_times_for_one_computation(tmp_path, workers: int) -> None:
    log = str(tmp_path / "log")
    with CachedLoader(Sized(24, log), batch_size=4, num_workers=workers,
                      rotation_setting={"rotation": 3, "size": 8}) as loader:
        assert len(loader) == 18
        for epoch in range(2):
            served = [int(v) for b in loader for v in np.asarray(b["i"])]
            assert collections.Counter(served) == {i: 3 for i in range(24)}, epoch  # every sample R times
            stats = loader.epoch_stats[-1]
            assert stats.mode.value == "rotate" and stats.computed == 24 and stats.samples == 72  # 1/R per serve
    assert iterations(log) == 2 * max(workers, 1)  # the stream once per epoch


def test_rotation_needs_a_length(tmp_path) -> None:
    with pytest.raises(ValueError, match="stream_samples"):
        CachedLoader(Counting(10), rotation_setting={"rotation": 2})
    with pytest.raises(ValueError, match="stream_samples"):
        CachedLoader(Endless(), rotation_setting={"rotation": 2})
    with CachedLoader(Endless(), batch_size=5, num_workers=0,
                      rotation_setting={"rotation": 2, "size": 10, "stream_samples": 20}) as loader:
        served = [int(v) for b in loader for v in np.asarray(b["i"])]
    assert collections.Counter(served) == {i: 2 for i in range(20)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("workers", [0, 2])
def test_each_epoch_takes_the_streams_next_samples(tmp_path, workers: int) -> None:
    log = str(tmp_path / "log")
    with CachedLoader(Counting(48, log), batch_size=4, num_workers=workers, timeout=60,
                      rotation_setting={"rotation": 2, "size": 8, "stream_samples": 24}) as loader:
        epochs = [collections.Counter(int(v) for b in loader for v in np.asarray(b["i"])) for _ in range(3)]
    assert epochs[0] == {i: 2 for i in range(24)}
    assert epochs[1] == {i: 2 for i in range(24, 48)}, "the next 24, not the first 24 again"
    assert epochs[2] == epochs[0], "the stream ended: a new pass"
    assert iterations(log) == 2 * max(workers, 1)
