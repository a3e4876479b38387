"""The compiled verified gather (``cachestore/format/_gather.c``) against the pure-Python one it replaces.

Both must give the same bytes and the same checksums as :func:`cachestore.format.checksums.checksum`
(the xxh3 records were written with), and name the same first bad row.
"""

from __future__ import annotations

import os
import sys
import types

import numpy as np
import pytest

from cachestore import CorruptSampleError, open_store
from cachestore.format import checksums, native as native_module

# Leaf widths in bytes: one leaf, tiny rows, a label beside an image, leaves of 0 bytes, rows just
# under and over the one-hash assembly limit (4 KiB) and the streamed-copy limit, unaligned widths.
WIDTHS = [(8,), (0,), (64, 8), (48 * 1024, 8), (5000, 3, 0, 7), (4096,), (4000, 96), (4000, 97), (1,) * 10]


def columns(widths: tuple[int, ...], n: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, (n, w), dtype=np.uint8) for w in widths]


def reference(cols: list[np.ndarray], n: int) -> list[int]:
    return [checksums.checksum([c[j] for c in cols]) for j in range(n)]


@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_row_checksums_match_the_checksums_records_are_written_with(native, widths, monkeypatch):
    n = 37
    cols = columns(widths, n)
    expected = reference(cols, n)
    assert checksums.row_checksums(cols, n) == expected
    monkeypatch.setattr(native_module, "NATIVE", None)
    assert checksums.row_checksums(cols, n) == expected


@pytest.mark.parametrize("stream", [True, False])
@pytest.mark.parametrize("widths", WIDTHS, ids=lambda w: "-".join(map(str, w)))
def test_gather_copies_the_rows_and_names_the_first_bad_one(native, widths, stream):
    n = 37
    cols = columns(widths, n)
    sums = np.array(reference(cols, n), dtype=np.uint64)
    idx = np.random.default_rng(1).permutation(n)[:20].astype(np.int64)
    outs = tuple(np.zeros((idx.size, w), np.uint8) for w in widths)
    assert native.gather_verified(tuple(cols), widths, idx, outs, sums[idx], stream=stream) == -1
    for out, col in zip(outs, cols):
        np.testing.assert_array_equal(out, col[idx])
    expected = sums[idx]
    expected[[7, 12]] ^= np.uint64(1)
    assert native.gather_verified(tuple(cols), widths, idx, outs, expected, stream=stream) == 7


def test_bad_arguments_are_errors_not_crashes(native):
    cols = tuple(columns((16, 8), 10))
    idx = np.array([0, 9], dtype=np.int64)
    outs = (np.empty((2, 16), np.uint8), np.empty((2, 8), np.uint8))
    sums = np.zeros(2, np.uint64)
    with pytest.raises(IndexError, match="row 10 is outside column 0"):
        native.gather_verified(cols, (16, 8), np.array([0, 10], dtype=np.int64), outs, sums)
    with pytest.raises(IndexError, match="row -1"):
        native.gather_verified(cols, (16, 8), np.array([-1, 0], dtype=np.int64), outs, sums)
    with pytest.raises(ValueError, match="out leaf 1 holds 8 bytes, the batch needs 16"):
        native.gather_verified(cols, (16, 8), idx, (outs[0], np.empty((1, 8), np.uint8)), sums)
    with pytest.raises(ValueError, match="one per row"):
        native.gather_verified(cols, (16, 8), idx, outs, np.zeros(3, np.uint64))
    with pytest.raises(ValueError, match="int64"):
        native.gather_verified(cols, (16, 8), idx.astype(np.int32), outs, sums)
    with pytest.raises(ValueError, match="uint64"):
        native.gather_verified(cols, (16, 8), idx, outs, sums.astype(np.float64))
    with pytest.raises(ValueError, match="contiguous"):
        native.gather_verified(cols, (16, 8), np.array([0, 5, 9, 9])[::2], outs, sums)
    with pytest.raises(ValueError, match="one entry per leaf"):
        native.gather_verified(cols, (16,), idx, outs, sums)
    read_only = np.empty((2, 16), np.uint8)
    read_only.flags.writeable = False
    with pytest.raises((BufferError, ValueError)):
        native.gather_verified(cols, (16, 8), idx, (read_only, outs[1]), sums)
    with pytest.raises(ValueError, match="column 0 holds 160 bytes"):
        native.row_checksums(cols, (16, 8), 11, np.zeros(11, np.uint64))


def test_memmap_batches_are_the_same_either_way(gather, tmp_path):
    rng = np.random.default_rng(2)
    samples = [{"image": rng.random((3, 32, 32), dtype=np.float32), "label": np.int64(i)} for i in range(50)]
    store = open_store(str(tmp_path / "store"), "memmap")
    try:
        with store.writer(0, 50) as writer:
            for i, sample in enumerate(samples):
                writer.put(i, sample)
        idx = rng.permutation(50)[:32]
        batch = store.reader().get_batch(idx)
        np.testing.assert_array_equal(batch["image"], np.stack([samples[i]["image"] for i in idx]))
        np.testing.assert_array_equal(batch["label"], idx)
        col = tmp_path / "store" / "gen-000000" / "col-1.bin"  # the labels
        data = bytearray(col.read_bytes())
        data[8 * int(idx[3])] ^= 0xFF
        col.write_bytes(bytes(data))
        with pytest.raises(CorruptSampleError, match=f"sample {int(idx[3])} of generation 0"):
            store.reader().get_batch(idx)
    finally:
        store.close()


def test_records_of_more_leaves_than_it_takes_are_gathered_in_python(native, tmp_path):
    leaves = native.MAX_LEAVES + 6
    samples = [{f"leaf{k}": np.full(3, i * 100 + k, dtype=np.int32) for k in range(leaves)} for i in range(10)]
    store = open_store(str(tmp_path / "store"), "memmap")
    try:
        with store.writer(0, 10) as writer:
            for i, sample in enumerate(samples):
                writer.put(i, sample)
        batch = store.reader().get_batch([7, 2])
        for k in range(leaves):
            np.testing.assert_array_equal(batch[f"leaf{k}"], [samples[7][f"leaf{k}"], samples[2][f"leaf{k}"]])
    finally:
        store.close()


def records(n: int, widths: tuple[int, ...], head: bytes = b"HEAD") -> list[bytes]:
    """Values laid out like LMDB's: xxh3 of the rest (8 bytes, little-endian), `head`, the leaves."""
    out = []
    for leaves in zip(*columns(widths, n)):
        rest = head + b"".join(leaf.tobytes() for leaf in leaves)
        out.append(checksums.checksum([rest]).to_bytes(8, "little") + rest)
    return out


def test_gather_records_copies_the_leaves_and_names_the_first_bad_record(native):
    widths, n = (5000, 8), 6
    values = records(n, widths)
    spans = ((12, 5000), (5012, 8))
    outs = tuple(np.zeros((n, w), np.uint8) for w in widths)
    assert native.gather_records(list(values), 1, len(values[0]), 8, b"HEAD", spans, outs, True) == (0, n)
    for j in range(1, n):
        assert outs[0][j].tobytes() == values[j][12:5012] and outs[1][j].tobytes() == values[j][5012:]
    assert not outs[0][0].any()  # the first record is left to the caller
    damaged = bytearray(values[3])
    damaged[100] ^= 1
    assert native.gather_records([*values[:3], bytes(damaged), *values[4:]], 1, len(values[0]), 8, b"HEAD",
                                 spans, outs, True) == (2, 3)
    assert native.gather_records([*values[:3], bytes(damaged), *values[4:]], 1, len(values[0]), 8, b"HEAD",
                                 spans, outs, False) == (0, n)  # unverified: copied as it is
    other = records(1, widths, head=b"HEAP")[0]
    for odd in (None, values[2][:-1], other):
        assert native.gather_records([*values[:4], odd, values[5]], 1, len(values[0]), 8, b"HEAD", spans, outs,
                                     True) == (1, 4)


def test_gather_records_bad_arguments_are_errors(native):
    values = records(3, (16,))
    size, outs = len(values[0]), (np.zeros((3, 16), np.uint8),)
    with pytest.raises(ValueError, match="span 0 lies outside a record"):
        native.gather_records(values, 1, size, 8, b"HEAD", ((20, 16),), outs, True)
    with pytest.raises(ValueError, match="out leaf 0 holds 16 bytes"):
        native.gather_records(values, 1, size, 8, b"HEAD", ((12, 16),), (np.zeros((1, 16), np.uint8),), True)
    with pytest.raises(ValueError, match="start, body or prefix"):
        native.gather_records(values, 4, size, 8, b"HEAD", ((12, 16),), outs, True)
    with pytest.raises(ValueError, match="values is a list"):
        native.gather_records(tuple(values), 1, size, 8, b"HEAD", ((12, 16),), outs, True)
    with pytest.raises(TypeError):
        native.gather_records([values[0], 5], 1, size, 8, b"HEAD", ((12, 16),), outs, True)


def mapped_bytes(path: str) -> int:
    """Bytes of `path` this process has in its page tables (Rss of its mappings in smaps)."""
    total, inside = 0, False
    with open("/proc/self/smaps") as f:
        for line in f:
            if "-" in line.split(" ", 1)[0]:  # a mapping's header line
                inside = line.rstrip().endswith(path)
            elif inside and line.startswith("Rss:"):
                total += int(line.split()[1]) * 1024
    return total


def test_the_first_batch_read_maps_the_whole_generation(native, tmp_path):
    n = 64
    store = open_store(str(tmp_path / "store"), "memmap")
    try:
        with store.writer(0, n) as writer:
            for i in range(n):
                writer.put(i, {"image": np.full(16 * 1024, i, dtype=np.float32)})  # 64 KiB each
        col = str(tmp_path / "store" / "gen-000000" / "col-0.bin")
        reader = store.reader()
        reader[3]  # a single read maps only what it touches
        assert mapped_bytes(col) < n * 64 * 1024 // 2
        reader.get_batch([5, 9])
        assert mapped_bytes(col) == n * 64 * 1024
    finally:
        store.close()


def test_pread_rows_reads_rows_into_their_slots_and_refuses_bad_arguments(native, tmp_path):
    width, n = 12, 30
    data = np.arange(n * width, dtype=np.uint32).astype(np.uint8).reshape(n, width)
    path = tmp_path / "column"
    path.write_bytes(data.tobytes())
    rows = np.array([2, 3, 4, 17, 29], dtype=np.int64)  # sorted, with a run
    slots = np.array([4, 0, 2, 1, 3], dtype=np.int64)
    dest = np.zeros((len(rows), width), np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        assert native.pread_rows(fd, dest, width, rows, slots) == 0
        assert np.array_equal(dest[slots], data[rows])
        assert native.pread_rows(fd, dest, width, np.array([n], np.int64), slots[:1]) == -1  # past the end
        with pytest.raises(ValueError, match="int64"):
            native.pread_rows(fd, dest, width, rows.astype(np.int32), slots.astype(np.int32))
        with pytest.raises(ValueError, match="int64"):
            native.pread_rows(fd, dest, width, rows.tobytes()[:-4], slots.tobytes()[:-4])  # not whole int64s
        with pytest.raises(ValueError, match="int64"):
            native.pread_rows(fd, dest, width, rows.astype(np.float64), slots)
        with pytest.raises(ValueError, match="contiguous"):
            native.pread_rows(fd, dest, width, np.repeat(rows, 2)[::2], slots)
        huge = np.array([np.iinfo(np.int64).max // width], dtype=np.int64)  # row * width overflows
        with pytest.raises(ValueError, match="beyond any file offset"):
            native.pread_rows(fd, dest, width, huge, slots[:1])
        with pytest.raises(IndexError, match="out of range"):
            native.pread_rows(fd, dest, width, rows, slots + 1)
    finally:
        os.close(fd)


def test_a_compiled_gather_older_than_its_callers_is_not_used(monkeypatch):
    import cachestore.format

    stale = types.ModuleType("cachestore.format._gather")
    stale.__file__ = "_gather.stale.so"
    # Built before explicit reads of scattered rows: everything but pread_rows.
    for name in ("MAX_LEAVES", "GUARDED", "populate", "row_checksums", "gather_verified", "gather_records"):
        setattr(stale, name, object())
    monkeypatch.setitem(sys.modules, "cachestore.format._gather", stale)
    monkeypatch.setattr(cachestore.format, "_gather", stale, raising=False)
    monkeypatch.delenv("CACHESTORE_NATIVE", raising=False)
    with pytest.warns(RuntimeWarning, match="lacks pread_rows"):
        assert native_module._load_native() is None
