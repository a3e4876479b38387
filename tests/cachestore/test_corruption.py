"""Damaged files: a flipped byte names the bad sample; a truncated file is an error, never a crash."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from cachestore import CorruptSampleError, open_store

from .helpers import WAIT, pattern_sample, read_everything, recv, write_generation

N = 16
BAD = 5
# (backend, compression): memmap stores fixed-shape samples in columns, compressed ones as records.
LAYOUTS = [("memmap", None), ("memmap", "zstd"), ("lmdb", None), ("lmdb", "zstd")]


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0x5A]))


def record_location(gen_dir: Path, index: int) -> tuple[Path, int, int]:
    """``(file, offset, length)`` of sample `index` in a memmap generation."""
    rows = np.load(gen_dir / "index.npy")
    row = rows[index]
    if row["shard"] == -1:  # columns: the first leaf's file
        rowbytes = (gen_dir / "col-0.bin").stat().st_size // len(rows)
        return gen_dir / "col-0.bin", index * rowbytes, rowbytes
    shard = json.loads((gen_dir / "shards.json").read_text())[row["shard"]]
    return gen_dir / f"{shard}.seg", int(row["offset"]), int(row["length"])


def corrupt_sample(gen_dir: Path, backend: str, compression: str | None, index: int) -> None:
    """Flip one byte inside the stored record of sample `index`."""
    if backend == "memmap":
        path, offset, length = record_location(gen_dir, index)
        flip(path, offset + length // 2)
        return
    # LMDB may hold stale copies of a page (copy-on-write); flip the value everywhere it appears.
    import lmdb

    from cachestore.backends.lmdb_columns import chunk_key

    manifest = json.loads((gen_dir / "manifest.json").read_text())
    columns = manifest.get("lmdb_layout") == "columns"
    env = lmdb.open(str(gen_dir), readonly=True, lock=False)
    try:
        with env.begin() as txn:
            if columns:  # the chunk of the first leaf that holds the sample
                chunk, row = divmod(index, manifest["chunk_rows"])
                value = txn.get(chunk_key(0, chunk))
                rows = min(manifest["chunk_rows"], manifest["num_samples"] - chunk * manifest["chunk_rows"])
                width = len(value) // rows
                inside = row * width + width // 2
            else:
                value = txn.get(index.to_bytes(8, "big"))  # checksum | record: unique to this sample
                inside = len(value) // 2
    finally:
        env.close()
    data = (gen_dir / "data.mdb").read_bytes()
    offset = data.find(value)
    assert offset >= 0
    while offset >= 0:
        flip(gen_dir / "data.mdb", offset + inside)
        offset = data.find(value, offset + 1)


def damaged_store(make_store, store_path: str, backend: str, compression: str | None):
    """A store whose sample `BAD` of generation 0 has one flipped byte."""
    store = make_store(backend, compression=compression)
    write_generation(store, 0, N, pattern_sample)
    corrupt_sample(Path(store_path) / "gen-000000", backend, compression, BAD)
    return store


@pytest.fixture(params=LAYOUTS, ids=[f"{b}-{c}" for b, c in LAYOUTS])
def damaged(request, make_store, store_path):
    return damaged_store(make_store, store_path, *request.param), *request.param


def test_flipped_byte_fails_the_read_naming_generation_and_index(damaged, store_path):
    store, _, _ = damaged
    reader = store.reader()
    with pytest.raises(CorruptSampleError, match=f"sample {BAD} of generation 0") as info:
        reader[BAD]
    assert store_path in str(info.value)
    for i in (BAD - 1, BAD + 1):
        np.testing.assert_array_equal(reader[i]["data"], pattern_sample(0, i)["data"])


def test_flipped_byte_fails_the_batch_naming_the_index(damaged, gather):
    store, _, _ = damaged
    with pytest.raises(CorruptSampleError, match=f"sample {BAD} of generation 0"):
        store.reader().get_batch([BAD + 2, BAD, 0])
    batch = store.reader().get_batch([BAD + 2, 0])  # batches without it still read
    np.testing.assert_array_equal(batch["data"][1], pattern_sample(0, 0)["data"])


def test_verify_lists_the_bad_sample(damaged):
    store, _, _ = damaged
    bad = store.verify()
    assert [str(exc) for exc in bad if f"sample {BAD} of generation 0" in str(exc)] == [str(e) for e in bad]
    assert len(bad) == 1
    assert [str(e) for e in store.reader().verify()] == [str(e) for e in bad]


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_checksums_are_what_catches_it(make_store, store_path, backend):
    # Uncompressed only: a damaged compressed record may already fail to decompress.
    damaged_store(make_store, store_path, backend, None).close()
    unverified = open_store(store_path, backend, verify=False)
    try:
        got = unverified.reader()[BAD]["data"]  # reads, but not what was written
        assert not np.array_equal(got, pattern_sample(0, BAD)["data"])
    finally:
        unverified.close()


TRUNCATIONS = {
    "memmap-columns": ("memmap", None, "col-0.bin"),
    "memmap-records": ("memmap", "zstd", "owner-*.seg"),
    "lmdb": ("lmdb", None, "data.mdb"),
}


@pytest.mark.parametrize("case", list(TRUNCATIONS))
def test_truncated_data_file_is_an_error_not_a_crash(children, make_store, store_path, case):
    backend, compression, pattern = TRUNCATIONS[case]
    store = make_store(backend, compression=compression)
    write_generation(store, 0, N, pattern_sample)
    (path,) = (Path(store_path) / "gen-000000").glob(pattern)
    os.truncate(path, path.stat().st_size * 2 // 3)
    # Read in a child: if the reader crashed on the damaged file (SIGBUS), the child dies, not pytest.
    proc, conn = children(read_everything, store_path, backend)
    report = recv(conn)
    proc.join(WAIT)
    assert proc.exitcode == 0
    assert report["verify"], "verify() must report the damage"
    if report["open"] is not None:  # the whole generation is refused...
        assert "truncated" in report["open"] and str(path) in report["open"]
    else:  # ...or each sample past the cut is
        bad = sorted(report["samples"])
        assert bad and bad[-1] == N - 1 and bad[0] > 0
        assert all(f"sample {i} of generation 0" in report["samples"][i] for i in bad)
    with pytest.raises(CorruptSampleError):  # and in this process too: an error, not a crash
        reader = store.reader(0)
        for i in range(N):
            reader[i]


@pytest.mark.parametrize("compression", [None, "zstd"], ids=["columns", "records"])
def test_random_bytes_in_an_lmdb_data_file_are_errors_not_a_crash(children, make_store, store_path, compression):
    # Spans of random bytes over data.mdb (its size and the manifest untouched), anywhere, meta pages
    # included: every read ends in a value or a CorruptSampleError, never a signal (each in a child).
    store = make_store("lmdb", compression=compression)
    write_generation(store, 0, N, pattern_sample)
    data = Path(store_path) / "gen-000000" / "data.mdb"
    original = data.read_bytes()
    rng = np.random.default_rng(2027)
    for _ in range(6):
        damaged = bytearray(original)
        for _ in range(int(rng.integers(1, 4))):
            length = int(rng.integers(16, 4096))
            offset = int(rng.integers(0, max(1, len(original) - length)))
            damaged[offset:offset + length] = rng.bytes(length)
        data.write_bytes(bytes(damaged))
        proc, conn = children(read_everything, store_path, "lmdb")
        report = recv(conn)
        proc.join(WAIT)
        assert proc.exitcode == 0, f"the reader died ({proc.exitcode}) on random bytes in {data}"
        assert isinstance(report["samples"], dict)
