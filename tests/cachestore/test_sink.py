"""SampleSink: what a producer is told when it puts a sample into a generation being written.

Two sinks in one process stand for two processes: each opens its own claims (open file
description locks conflict between descriptions, whatever the process).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachestore import BudgetExceededError, PutResult, open_store

pytestmark = pytest.mark.timeout(60)
FP = {"dataset": "sink"}
N = 8


def sample(i: int) -> dict:
    return {"x": np.full(16, i, dtype=np.float32), "y": i}


class Calls:
    """A dataset that counts its calls (a put computes only what it writes)."""

    def __init__(self) -> None:
        self.made: list[int] = []

    def __call__(self, i: int):
        def compute():
            self.made.append(i)
            return sample(i)
        return compute


@pytest.fixture
def store(tmp_path: Path):
    with open_store(tmp_path / "s", "memmap", fingerprint=FP) as store:
        yield store


def test_a_writer_alone_writes_every_sample(store):
    writer = store.writer(0, N)
    sink, calls = writer.shard_spec().sink("w0"), Calls()
    for i in range(N):
        assert sink.put(i, calls(i)).result is PutResult.WRITTEN
    sink.flush()
    sink.close()
    assert calls.made == list(range(N))
    writer.commit()
    with store.reader(0) as reader:
        assert [int(reader[i]["y"]) for i in range(N)] == list(range(N))


def test_a_sample_another_producer_holds_is_waited_for_then_read_back(store):
    writer = store.join(0, N)
    spec = writer.shard_spec()
    first, second, calls = spec.sink("w0"), spec.sink("w0"), Calls()
    try:
        put = first.put(3, calls(3))
        assert put.result is PutResult.WRITTEN and put.sample["y"] == 3
        # Held by `first` until its flush: `second` must wait, and computes nothing.
        assert second.put(3, calls(3)).result is PutResult.WAIT
        first.flush()
        assert second.wait(3, calls(3)).result is PutResult.PRESENT
        assert second.read(3)["y"] == 3
        # Done before `second` looks: present at once.
        first.put(4, calls(4))
        first.flush()
        assert second.put(4, calls(4)).result is PutResult.PRESENT
        assert calls.made == [3, 4]
    finally:
        first.close()
        second.close()
        writer.abort()


def test_a_claim_given_back_unwritten_goes_to_the_waiter(store):
    writer = store.join(0, N)
    spec = writer.shard_spec()
    first, second, calls = spec.sink("w0"), spec.sink("w0"), Calls()
    try:
        first.put(5, calls(5))
        assert second.put(5, calls(5)).result is PutResult.WAIT
        first.close()  # as a producer killed before its flush: the kernel drops its claims
        put = second.wait(5, calls(5))
        assert put.result is PutResult.WRITTEN and calls.made == [5, 5]
        assert 5 in writer.present()  # wait() flushed it: done for everyone
    finally:
        second.close()
        writer.abort()


def test_a_full_budget_stops_writing_and_gives_the_claims_back(tmp_path):
    with open_store(tmp_path / "s", "memmap", fingerprint=FP, disk_budget=1) as store:
        writer = store.join(0, N)
        spec = writer.shard_spec()
        stopping, other, calls = spec.sink("w0", stop_when_full=True), spec.sink("w1"), Calls()
        try:
            put = stopping.put(0, calls(0))
            assert put.result is PutResult.UNWRITTEN and put.sample["y"] == 0
            assert stopping.budget_error is not None
            assert stopping.put(1, calls(1)).result is PutResult.UNWRITTEN  # no more writing, no claim taken
            with pytest.raises(BudgetExceededError):
                other.put(0, calls(0))  # the claim on 0 was given back: `other` computes it, and raises
            assert other.closed
        finally:
            stopping.close()
            writer.abort()


def test_a_generation_committed_meanwhile_is_read_not_computed(store):
    first = store.join(0, N)
    spec = first.shard_spec()
    for i in range(N):
        first.put(i, sample(i))
    first.commit()
    sink, calls = spec.sink("w0"), Calls()
    try:
        assert sink.put(2, calls(2)).result is PutResult.PRESENT
        assert sink.read(2)["y"] == 2 and calls.made == []
    finally:
        sink.close()


def test_a_corrupt_record_of_the_generation_committed_meanwhile_is_a_miss(store):
    # Another process committed the area, then a byte of it was flipped: the sample is computed again by
    # the caller (read() says it cannot be read), as every read of a generation treats a corrupt record.
    first = store.join(0, N)
    spec = first.shard_spec()
    for i in range(N):
        first.put(i, sample(i))
    info = first.commit()
    column = Path(info.path) / "col-0.bin"
    data = bytearray(column.read_bytes())
    data[2 * 64] ^= 0xFF  # sample 2's first float (16 float32 per row)
    column.write_bytes(bytes(data))
    sink = spec.sink("w0")
    try:
        assert sink.put(2, Calls()(2)).result is PutResult.PRESENT
        assert sink.read(2) is None
        assert sink.read(3)["y"] == 3
    finally:
        sink.close()
