"""Resuming a stream's run: in the middle of its generate epoch (the stream iterated again, what was served
skipped) and of a cached epoch (exactly, as for map-style data)."""

from __future__ import annotations

import numpy as np
import pytest

from loader import CachedLoader

from .stream_datasets import Counting, Resumable, Uneven, iterations, yielded


def labels(batch: dict) -> list[int]:
    return [int(v) for v in np.asarray(batch["i"]).ravel()]


def stopped_after(loader: CachedLoader, batches: int) -> tuple[list[list[int]], dict]:
    """The labels of an epoch's first `batches` batches, and the loader's state taken after the last."""
    it = iter(loader)
    served = [labels(next(it)) for _ in range(batches)]
    return served, loader.state_dict()


@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_in_the_generate_epoch(tmp_path, shuffle: bool, workers: int) -> None:
    log = str(tmp_path / "log")
    kwargs = dict(batch_size=4, num_workers=workers, shuffle=shuffle, seed=7,
                  cache_setting={"prefix": str(tmp_path / "cache"), "stream_buffer": 6})
    with CachedLoader(Counting(30, log), **kwargs) as full:
        expected = [labels(b) for b in full]
    other = {**kwargs, "cache_setting": {"prefix": str(tmp_path / "other"), "stream_buffer": 6}}
    with CachedLoader(Counting(30, log), **other) as first:
        served, state = stopped_after(first, 3)
    with CachedLoader(Counting(30, log), **other) as second:
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
        served, state = stopped_after(first, 4)
    with CachedLoader(Counting(30, log), **kwargs) as second:
        second.load_state_dict(state)
        served += [labels(b) for b in second]
        assert second.epoch_stats[-1].mode.value == "read"
    assert sorted(v for b in served for v in b) == list(range(30))
    assert iterations(log) == 2  # only the generate epoch iterated the stream



@pytest.mark.parametrize("cached", [True, False])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_stateful_stream_resumes_from_its_own_state(tmp_path, workers: int, cached: bool) -> None:
    # Its copies load the states they had after the last batch served: none of the samples served
    # before the stop is yielded again, and the batches are those of a run never stopped.
    def build(log: str, prefix: str) -> CachedLoader:
        cache = {"cache_setting": {"prefix": str(tmp_path / prefix)}} if cached else {}
        return CachedLoader(Resumable(30, str(tmp_path / log)), batch_size=4, num_workers=workers, shuffle=False,
                            timeout=60, **cache)

    with build("full.log", "full") as full:
        expected = [labels(b) for b in full]
    with build("run.log", "run") as first:
        served, state = stopped_after(first, 3)
    assert state["stream"] is not None and state["stream"]["arrived"] == 12
    before = yielded(str(tmp_path / "run.log"))
    with build("run.log", "run") as second:
        second.load_state_dict(state)
        served += [labels(b) for b in second]
        if cached:
            assert second.epoch_stats[-1].committed
            assert sorted(v for b in second for v in labels(b)) == list(range(30))  # read from the generation
    assert served == expected
    again = yielded(str(tmp_path / "run.log"))[len(before):]
    assert not set(v for b in served[:3] for v in b) & set(again), "a sample served before the stop was yielded again"


def test_a_stateful_stream_behind_a_shuffle_buffer_is_iterated_again(tmp_path) -> None:
    # Through a shuffle buffer more was taken from the stream than was served: its state says nothing of
    # the buffer, so the run resumes as for any stream (iterated again, what was served skipped).
    log = str(tmp_path / "log")
    kwargs = dict(batch_size=4, num_workers=0, shuffle=True, seed=3,
                  cache_setting={"prefix": str(tmp_path / "c"), "stream_buffer": 6})
    with CachedLoader(Resumable(20, log), **kwargs) as first:
        served, state = stopped_after(first, 2)
    assert state["stream"] is None
    with CachedLoader(Resumable(20, log), **kwargs) as second:
        second.load_state_dict(state)
        served += [labels(b) for b in second]
    assert sorted(v for b in served for v in b) == list(range(20))


def test_a_damaged_stream_position_is_refused_naming_it(tmp_path) -> None:
    with CachedLoader(Resumable(12, str(tmp_path / "log")), batch_size=4, num_workers=0, shuffle=False) as first:
        it = iter(first)
        next(it)
        state = first.state_dict()
    for damaged in ("garbage", {**state["stream"], "states": []}, {**state["stream"], "next": 5}):
        with CachedLoader(Resumable(12, str(tmp_path / "log")), batch_size=4, num_workers=0, shuffle=False) as again:
            with pytest.raises(ValueError, match=r"state\['stream'\]"):
                again.load_state_dict({**state, "stream": damaged})


@pytest.mark.parametrize("workers,shuffle", [(0, False), (2, False), (0, True)])
def test_a_state_of_the_generate_epoch_resumes_once_its_generation_is_committed(tmp_path, workers: int,
                                                                                shuffle: bool) -> None:
    # The run went on to the end of its generate epoch (and committed it) after the state was taken, then
    # stopped: the resumed loader serves the rest of that epoch as it was served (the batches the workers
    # made, or the shuffle buffer's order), not a read epoch's batches, and nothing twice.
    kwargs = dict(batch_size=4, num_workers=workers, shuffle=shuffle, seed=5,
                  cache_setting={"prefix": str(tmp_path / "c"), "stream_buffer": 6})
    with CachedLoader(Uneven([7, 13]) if workers else Counting(30), **kwargs) as first:
        it = iter(first)
        served = [next(it) for _ in range(3)]
        state = first.state_dict()
        rest = list(it)
        assert first.epoch_stats[-1].committed
    with CachedLoader(Uneven([7, 13]) if workers else Counting(30), **kwargs) as second:
        second.load_state_dict(state)
        resumed = list(second)
        assert second.epoch == 0 and second.state_dict()["epoch"] == 1

    def plain(batches):
        return [np.asarray(b["i"] if isinstance(b, dict) else b).tolist() for b in batches]

    assert plain(resumed) == plain(rest) and len(served) + len(rest) > 3
