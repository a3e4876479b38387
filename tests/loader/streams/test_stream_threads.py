"""A stream on worker threads: each thread iterates its own iterator of the stream in torch's turn, on
the same worker loop as a map-style dataset's tasks (docs/ARCHITECTURE.md, "Streams")."""

from __future__ import annotations

import numpy as np
import pytest
from torch.utils.data import DataLoader

from loader import CachedLoader

from .stream_datasets import Counting, Resumable, iterations

pytestmark = pytest.mark.timeout(120)


def ids(batches) -> list[list[int]]:
    return [[int(v) for v in np.asarray(b["i"] if isinstance(b, dict) else b).ravel()] for b in batches]


def test_threads_serve_a_stream_in_torchs_turn() -> None:
    stream = Counting(40)
    expected = ids(DataLoader(stream, batch_size=3, num_workers=2))
    with CachedLoader(stream, batch_size=3, num_workers=2, use_threading=True) as loader:
        assert ids(loader) == expected
        assert ids(loader) == expected  # a second epoch: new iterators, the same turn


def test_threads_write_a_streams_generation_and_the_next_epochs_read_it(tmp_path) -> None:
    log = str(tmp_path / "log")
    with CachedLoader(Counting(30, log), batch_size=4, num_workers=2, use_threading=True, shuffle=True,
                      cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 3,
                                     "background_refresh": False}) as loader:
        epochs = [sorted(i for b in ids(loader) for i in b) for _ in range(3)]
        modes = [s.mode.value for s in loader.epoch_stats]
    assert epochs == [list(range(30))] * 3
    assert modes == ["generate", "read", "read"]
    assert iterations(log) == 2, "each thread iterated the stream once"


def test_a_stateful_stream_on_threads_resumes_where_its_copies_were(tmp_path) -> None:
    log = str(tmp_path / "log")

    def make() -> CachedLoader:
        return CachedLoader(Resumable(24, log), batch_size=2, num_workers=2, use_threading=True)

    with make() as loader:
        expected = ids(loader)
    with make() as loader:
        it = iter(loader)
        served = ids(next(it) for _ in range(5))
        state = loader.state_dict()
    with make() as loader:
        loader.load_state_dict(state)
        served += ids(loader)
    assert served == expected
