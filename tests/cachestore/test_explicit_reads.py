"""Explicit reads: a range of samples in one read per leaf, rows by runs of preads, every record verified.

A memmap generation that does not fit the memory room reads that way instead of faulting pages in;
every backend answers the same calls (the others gather).
"""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest

from cachestore import CacheStoreError, CorruptSampleError, open_store
from cachestore.backends import memmap_generation
from cachestore.format.checksums import flat_rows

from .helpers import fixed_sample, pattern_sample, write_generation


@pytest.fixture(params=[False, True], ids=["fits", "too-big"])
def too_big(request, monkeypatch):
    """Make memmap generations look larger than the memory room (or not), and every column large."""
    if request.param:
        monkeypatch.setattr(memmap_generation, "fits", lambda nbytes, fraction=0.5: False)
        monkeypatch.setattr(memmap_generation, "SMALL_COLUMN_BYTES", 0)
    return request.param


def _out(reader, n):
    _, specs = reader.batch_layout()
    return [np.zeros((n, *shape), dtype=dtype) for dtype, shape in specs]


def test_ranges_and_rows_read_what_was_written(store_path, backend, too_big):
    store = open_store(store_path, backend)
    write_generation(store, 0, 50)
    with store.reader(0) as reader:
        assert reader.reads_explicitly() == (too_big and backend == "memmap")
        out = _out(reader, 13)
        reader.read_range(20, 33, out)
        expected = reader.get_batch(np.arange(20, 33))
        assert np.array_equal(out[0], expected["image"]) and out[1].tolist() == list(range(20, 33))
        rows = np.array([49, 3, 4, 5, 17, 16, 0, 4], dtype=np.int64)  # runs, a repeat, out of order
        out = _out(reader, len(rows))
        reader.read_rows(rows, out)
        assert np.array_equal(out[0], reader.get_batch(rows)["image"]) and out[1].tolist() == rows.tolist()
        reader.read_range(7, 7, _out(reader, 0))
    store.close()


def test_a_corrupt_record_is_named_by_an_explicit_read(store_path, too_big):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 40, make=lambda g, i: pattern_sample(g, i, nbytes=512))
    col = next((store.backend.path / "gen-000000").glob("col-*"))
    data = bytearray(col.read_bytes())
    data[512 * 25 + 7] ^= 0xFF  # a byte of sample 25
    col.write_bytes(bytes(data))
    with store.reader(0) as reader:
        with pytest.raises(CorruptSampleError, match="sample 25 ") as info:
            reader.read_range(0, 40, _out(reader, 40))
        assert info.value.index == 25
        with pytest.raises(CorruptSampleError, match="sample 25 "):
            reader.read_rows(np.array([3, 25, 30]), _out(reader, 3))
        reader.read_rows(np.array([3, 24, 26]), _out(reader, 3))  # the others are sound
    store.close()


def test_bad_ranges_are_refused(store_path, too_big):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 10, make=fixed_sample)
    with store.reader(0) as reader:
        with pytest.raises(IndexError):
            reader.read_range(5, 11, _out(reader, 6))
        with pytest.raises(IndexError):
            reader.read_rows(np.array([10]), _out(reader, 1))
    store.close()


def test_a_generation_larger_than_memory_is_written_back_as_it_goes(store_path, monkeypatch):
    from cachestore.backends import memmap_shard

    monkeypatch.setattr(memmap_shard, "fits", lambda nbytes, fraction=0.5: False)
    monkeypatch.setattr(memmap_shard, "WRITEBACK_BYTES", 4096)
    synced: list[int] = []
    real = memmap_shard.write_back
    monkeypatch.setattr(memmap_shard, "write_back", lambda fd: (synced.append(fd), real(fd)))
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 40, make=lambda g, i: pattern_sample(g, i, nbytes=1024))
    assert len(synced) >= 5  # every 4 KiB written
    with store.reader(0) as reader:
        assert not reader.verify()
        assert reader[17]["data"][0] == 10**12 + 18 * 10**6
    store.close()


def test_an_out_array_that_is_not_contiguous_is_refused(store_path, backend):
    store = open_store(store_path, backend)
    write_generation(store, 0, 10)
    with store.reader(0) as reader:
        out = _out(reader, 4)
        big = np.zeros((4, 8, 8), dtype=np.float32)
        out[0] = big[:, ::2, :]  # the image leaf's shape (4, 8), every other row of a larger array
        for call in (lambda: reader.get_batch(np.arange(4), out=out), lambda: reader.read_range(0, 4, out),
                     lambda: reader.read_rows(np.arange(4), out)):
            with pytest.raises(ValueError, match="out leaf 0 .* not C-contiguous"):
                call()
        with pytest.raises(ValueError, match="not C-contiguous"):
            flat_rows(out, 4)  # what the verified gathers write through, whoever calls them
        assert not big.any()
        rows = _out(reader, 8)
        reader.get_batch(np.arange(2, 6), out=[leaf[2:6] for leaf in rows])  # a slice of the rows is contiguous
        assert rows[1][2:6].tolist() == [2, 3, 4, 5]
    store.close()


def _generation(store_path):
    """An open memmap generation of 20 samples (its store closed), read explicitly."""
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 20, make=lambda g, i: pattern_sample(g, i, nbytes=256))
    data = store.backend.open_generation(0)
    store.close()
    _, specs = data.batch_layout()
    return data, lambda n: [np.zeros((n, *shape), dtype=dtype) for dtype, shape in specs]


@pytest.mark.timeout(60)
def test_threads_reading_explicitly_open_no_file(store_path, monkeypatch):
    # The generation holds its columns open from its opening: reads in several threads at once
    # open nothing (a second fd per column would leak), and never a name a symlink could replace.
    data, out = _generation(store_path)
    opened: list[str] = []
    real_open = os.open

    def counting_open(path, flags, *args):
        opened.append(str(path))
        return real_open(path, flags, *args)

    monkeypatch.setattr(memmap_generation.os, "open", counting_open)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=_catch, args=(errors, data.read_range, 0, 20, out(20))) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    monkeypatch.undo()
    assert not errors and not any(t.is_alive() for t in threads)
    assert opened == []
    data.close()


@pytest.mark.timeout(60)
def test_closing_leaves_the_fds_of_reads_in_flight_open_until_they_end(store_path, monkeypatch):
    data, out = _generation(store_path)
    reading, finish = threading.Event(), threading.Event()
    fds: list[int] = []
    real_read = memmap_generation._pread_into

    def paused_read(fd, dest, offset, path, drop=True):
        fds.append(fd)
        reading.set()
        assert finish.wait(30)
        real_read(fd, dest, offset, path, drop)

    monkeypatch.setattr(memmap_generation, "_pread_into", paused_read)
    errors: list[BaseException] = []
    thread = threading.Thread(target=lambda: _catch(errors, data.read_range, 0, 20, out(20)))
    thread.start()
    assert reading.wait(30)
    data.close()  # while the read is in flight
    os.fstat(fds[0])  # still open: closing it now would have the read go to whatever file gets its number
    finish.set()
    thread.join(30)
    assert not errors and not thread.is_alive()
    with pytest.raises(OSError):
        os.fstat(fds[0])  # the read in flight closed it as it ended
    with pytest.raises(CacheStoreError, match="closed"):
        data.read_range(0, 1, out(1))


def _catch(errors: list[BaseException], call, *args) -> None:
    try:
        call(*args)
    except BaseException as exc:  # reported by the test
        errors.append(exc)
