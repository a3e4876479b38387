"""``in_order=False`` (torch's): batches computed on workers are served as they are done, and a state
records exactly which were served, so a resumed run serves each of the others once."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from loader import CachedLoader
from loader.state import served_batches

pytestmark = pytest.mark.timeout(120)

#: How long the held sample waits for its release at most (a test that never releases it fails, not hangs).
HOLD_SECONDS = 60.0


class HeldFirst:
    """Sample ``i`` is ``i``; sample 0 is computed only once the file `release` exists (the slow sample of
    torchdata's out-of-order test, held by the test instead of a sleep)."""

    def __init__(self, n: int, release: str) -> None:
        self.n, self.release = n, release

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index == 0:
            deadline = time.monotonic() + HOLD_SECONDS
            while not os.path.exists(self.release):
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{self.release} never appeared")
                time.sleep(0.01)  # a poll of the test's signal, not a synchronising sleep
        return index


def _values(batches) -> list[int]:
    return [int(x) for batch in batches for x in batch]


@pytest.mark.parametrize("cached", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("resumed_workers", [2, 0])
def test_a_slow_batch_is_passed_and_a_state_resumes_exactly_the_rest(tmp_path, cached, resumed_workers):
    release = str(tmp_path / "release")
    cache = {"prefix": str(tmp_path / "c")} if cached else None
    dataset = HeldFirst(10, release)
    with CachedLoader(dataset, batch_size=1, nb_worker=2, shuffle=False, in_order=False,
                      cache_setting=cache) as loader:
        it = iter(loader)
        head = _values(next(it) for _ in range(4))  # batch 0 is held: the others come first
        state = loader.state_dict()
    assert 0 not in head and len(set(head)) == 4
    assert state["batches_served"] == 0 and state["batches_ahead"] == sorted(head)
    Path(release).touch()
    with CachedLoader(dataset, batch_size=1, nb_worker=resumed_workers, shuffle=False, in_order=False,
                      cache_setting=cache) as resumed:
        resumed.load_state_dict(state)
        rest = _values(resumed)
        assert sorted(head + rest) == list(range(10)), (head, rest)
        if cached:  # the generation holds every sample, those served before the stop included
            assert resumed.epoch_stats[-1].committed
            assert sorted(_values(resumed)) == list(range(10)) and resumed.epoch_stats[-1].mode.value == "read"


def test_in_order_is_the_default_and_keeps_the_order(tmp_path):
    release = tmp_path / "release"
    release.touch()
    with CachedLoader(HeldFirst(10, str(release)), batch_size=2, nb_worker=2, shuffle=False) as loader:
        assert _values(loader) == list(range(10))
        assert loader.state_dict()["batches_ahead"] == []


def test_in_order_must_be_a_bool():
    with pytest.raises(ValueError, match="in_order should be a boolean"):
        CachedLoader(HeldFirst(4, "x"), in_order="no")


def test_a_damaged_list_of_batches_served_ahead_is_refused(tmp_path):
    with CachedLoader(HeldFirst(10, "x"), batch_size=1, nb_worker=0, shuffle=False) as loader:
        state = loader.state_dict()
    for bad in ([0], [3, 3], [10], ["1"], 7):
        with CachedLoader(HeldFirst(10, "x"), batch_size=1, nb_worker=0, shuffle=False) as other:
            with pytest.raises(ValueError, match="batches_ahead"):
                other.load_state_dict({**state, "batches_served": 0, "batches_ahead": bad})


@pytest.mark.parametrize(("start", "ahead", "count", "out_of_order", "expected"), [
    (0, frozenset(), 3, [], (3, [])),  # in order
    (0, frozenset(), 3, [1, 2, 3], (0, [1, 2, 3])),  # batch 0 held back
    (0, frozenset(), 4, [1, 2, 3, 0], (4, [])),  # then served
    (2, frozenset({4, 5}), 2, [], (6, [])),  # in order after a resume: 2 and 3, and 4 and 5 were served
    (2, frozenset({5}), 4, [], (7, [])),  # 2, 3, 4, then 6 (5 was served)
    (2, frozenset({6}), 1, [], (3, [6])),
    (2, frozenset({3}), 1, [0], (4, [])),  # out of order after a resume (numbers after the start)
    (2, frozenset({3}), 1, [2], (2, [3, 4])),
])
def test_served_batches(start, ahead, count, out_of_order, expected):
    assert served_batches(start, ahead, count, out_of_order) == expected


@pytest.mark.parametrize("workers", [{}, {"use_threading": True}, {"cache_setting": "prefix"}],
                         ids=["processes", "threads", "processes-generate-epoch"])
def test_a_stream_is_served_out_of_turn_and_resumes_exactly(tmp_path, workers):
    # Worker 1 waits at its gate: in torch's turn its first batch would hold the epoch up; out of turn,
    # worker 0's batches come meanwhile. The state counts each copy's batches: a copy that keeps no state
    # is iterated again up to there, and each sample is served once.
    from .streams.stream_datasets import Gated

    # With a cache, the first epoch writes the generation as the copies' samples arrive.
    gate = tmp_path / "gate"
    if "cache_setting" in workers:
        workers = {"cache_setting": {"prefix": str(tmp_path / "cache"), "update_frequency": 2}}

    def make() -> CachedLoader:
        return CachedLoader(Gated(12, str(gate)), batch_size=None, num_workers=2, in_order=False, timeout=60,
                            **workers)

    with make() as loader:
        it = iter(loader)
        first = [int(next(it)) for _ in range(3)]
        state = loader.state_dict()
    assert first == [0, 2, 4]
    assert state["stream"]["taken"] == [3, 0]
    # torchdata's layout of its workers' snapshots, as a view (code written against it reads it)
    copies = state["_snapshot"]["_worker_snapshots"]
    assert [copies[f"worker_{i}"]["fetcher_state"]["fetcher_ended"] for i in (0, 1)] == [False, False]
    gate.touch()
    with make() as loader:
        loader.load_state_dict(state)
        rest = [int(x) for x in loader]
        assert sorted(first + rest) == list(range(12))
        assert sorted(int(x) for x in loader) == list(range(12))  # the next epoch: all of it


@pytest.mark.parametrize("workers", [{}, {"use_threading": True}, {"cache_setting": "prefix"}],
                         ids=["processes", "threads", "processes-generate-epoch"])
def test_a_stream_resumed_out_of_turn_skips_each_copys_own_batches(tmp_path, workers):
    # The resumed run gets worker 1's batches first. A generate epoch iterates its copies again from their
    # start (the samples are written again) and skipped the first 3 batches to arrive (samples 1 and 3),
    # where worker 0 had served 0, 2 and 4: 1 and 3 were never served, 0, 2 and 4 twice.
    from .streams.stream_datasets import SecondAhead

    gate = tmp_path / "gate"
    if "cache_setting" in workers:
        workers = {"cache_setting": {"prefix": str(tmp_path / "cache"), "update_frequency": 2}}

    def make() -> CachedLoader:
        return CachedLoader(SecondAhead(12, str(gate), lead=3), batch_size=None, num_workers=2, in_order=False,
                            timeout=60, **workers)

    with make() as loader:
        it = iter(loader)
        first = [int(next(it)) for _ in range(3)]
        state = loader.state_dict()
    assert first == [0, 2, 4]
    gate.touch()
    with make() as loader:
        loader.load_state_dict(state)
        rest = [int(x) for x in loader]
        assert sorted(first + rest) == list(range(12))
        assert sorted(int(x) for x in loader) == list(range(12))
