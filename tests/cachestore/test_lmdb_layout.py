"""LMDB's two layouts: fixed-shape samples by column in chunks, everything else one record each.

The conformance suite checks what every backend serves; these tests check how
LMDB stores it (see ``cachestore/backends/lmdb_columns.py``), and that stores
made before the columnar layout (format 1) keep working.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from cachestore import CorruptSampleError, open_store, stack_samples
from cachestore.backends import lmdb_columns

from .helpers import assert_same, check_generation, fixed_sample, variable_sample, write_generation


def manifest(store_path: str, generation: int = 0) -> dict:
    return json.loads((Path(store_path) / f"gen-{generation:06d}" / "manifest.json").read_text())


@pytest.fixture
def small_chunks(monkeypatch):
    """Chunks of 3 samples (fixed_sample rows are 146 bytes), so 10 samples make 4 chunks, the last short."""
    monkeypatch.setattr(lmdb_columns, "CHUNK_BYTES", 3 * 146 + 10)


def test_fixed_shape_samples_are_stored_by_column_in_chunks(make_store, store_path, small_chunks):
    store = make_store("lmdb")
    write_generation(store, 0, 10, fixed_sample)
    info = manifest(store_path)
    assert info["lmdb_layout"] == "columns" and info["chunk_rows"] == 3 and info["layout"] == "fixed"
    reader = store.reader()
    check_generation(reader, 0, 10, fixed_sample)
    idx = [9, 0, 4, 4, 8, 1]  # every chunk, the short last one, a repeat, out of order
    layout = reader.batch_layout()
    assert layout is not None
    out = [np.empty((len(idx), *shape), dtype=dtype) for dtype, shape in layout[1]]
    batch = reader.get_batch(idx, out=out)
    assert_same(stack_samples([fixed_sample(0, i) for i in idx]), batch)
    assert np.shares_memory(batch["image"], out[0])
    assert_same(fixed_sample(0, 4), reader[-6])


def test_a_flipped_byte_in_a_chunk_names_the_sample(make_store, store_path, small_chunks):
    import lmdb

    store = make_store("lmdb")
    write_generation(store, 0, 10, fixed_sample)
    gen_dir = Path(store_path) / "gen-000000"
    env = lmdb.open(str(gen_dir), readonly=True, lock=False)
    with env.begin() as txn:
        value = txn.get(lmdb_columns.chunk_key(0, 2))  # samples 6, 7, 8
    env.close()
    data = bytearray((gen_dir / "data.mdb").read_bytes())
    offset = data.find(value)
    assert offset >= 0
    data[offset + len(value) // 3 + 5] ^= 0x5A  # inside sample 7's row
    (gen_dir / "data.mdb").write_bytes(bytes(data))
    reader = open_store(store_path, "lmdb").reader()
    with pytest.raises(CorruptSampleError, match="sample 7 of generation 0"):
        reader.get_batch([1, 7, 3])
    with pytest.raises(CorruptSampleError, match="sample 7 of generation 0"):
        reader[7]
    assert_same(fixed_sample(0, 6), reader[6])  # its neighbours in the chunk are sound
    unchecked = open_store(store_path, "lmdb", verify=False).reader()
    unchecked.get_batch([7])


@pytest.mark.parametrize("make", [variable_sample, "mixed"])
def test_variable_or_mixed_samples_keep_one_record_each(make_store, store_path, make):
    def mixed(generation: int, index: int):
        return fixed_sample(generation, index) if index % 2 else variable_sample(generation, index)

    make = mixed if make == "mixed" else make
    store = make_store("lmdb")
    write_generation(store, 0, 8, make)
    assert "lmdb_layout" not in manifest(store_path)
    reader = store.reader()
    assert reader.batch_layout() is None
    for i in range(8):
        assert_same(make(0, i), reader[i])


def wide(generation: int, index: int):
    return {"x": np.full(lmdb_columns.MAX_ROW_BYTES // 4 + 1, index, dtype=np.float32), "y": index}


def test_wide_samples_keep_one_record_each_and_say_their_layout(make_store, store_path, gather):
    store = make_store("lmdb")
    write_generation(store, 0, 6, wide)
    info = manifest(store_path)
    assert info["lmdb_layout"] == "fixed-records" and info["layout"] == "fixed"
    reader = store.reader()
    check_generation(reader, 0, 6, wide)
    # The layout is known up front, so a batch lands in the caller's arrays (a worker's slot).
    layout = reader.batch_layout()
    assert layout is not None
    idx = [5, 0, 3, 3]
    out = [np.empty((len(idx), *shape), dtype=dtype) for dtype, shape in layout[1]]
    batch = reader.get_batch(idx, out=out)
    assert_same(stack_samples([wide(0, i) for i in idx]), batch)
    assert np.shares_memory(batch["x"], out[0])
    with pytest.raises(ValueError, match="C-contiguous arrays shaped like the batch"):
        reader.get_batch(idx, out=[a[:2] for a in out])


def test_wide_samples_of_several_shapes_have_no_batch_layout(make_store, store_path, gather):
    def two_shapes(generation: int, index: int):
        return {"x": np.full(lmdb_columns.MAX_ROW_BYTES // 4 + 1 + index % 2, index, dtype=np.float32)}

    store = make_store("lmdb")
    write_generation(store, 0, 4, two_shapes)
    assert "lmdb_layout" not in manifest(store_path)
    reader = store.reader()
    assert reader.batch_layout() is None
    check_generation(reader, 0, 4, two_shapes)
    # A batch of one shape is gathered; one whose later record differs is read record by record.
    for batch in ([2, 0], [0, 1]):
        assert_same(stack_samples([two_shapes(0, i) for i in batch]), reader.get_batch(batch))


def test_shards_of_different_layouts_have_no_batch_layout(make_store, store_path):
    """Each shard's records share one layout, but not the same one: the commit learns it from the
    shards' reports, without reading the records."""
    def by_shard(generation: int, index: int):
        return {"x": np.full(lmdb_columns.MAX_ROW_BYTES // 4 + 1 + (index >= 3), index, dtype=np.float32)}

    store = make_store("lmdb")
    writer = store.writer(0, 6)
    spec = writer.shard_spec()
    for name, indices in (("a", range(3)), ("b", range(3, 6))):
        shard = spec.open(name)
        for i in indices:
            shard.put(i, by_shard(0, i))
        shard.close()
    writer.commit()
    assert "lmdb_layout" not in manifest(store_path)
    reader = store.reader()
    assert reader.batch_layout() is None
    check_generation(reader, 0, 6, by_shard)


def flip_in_record(store_path: str, index: int, at: int) -> None:
    """Flip byte `at` (from the end when negative) of sample `index`'s value, in every copy LMDB keeps."""
    import lmdb

    gen_dir = Path(store_path) / "gen-000000"
    env = lmdb.open(str(gen_dir), readonly=True, lock=False)
    with env.begin() as txn:
        value = bytes(txn.get(index.to_bytes(8, "big")))
    env.close()
    data = bytearray((gen_dir / "data.mdb").read_bytes())
    offset = data.find(value)
    assert offset >= 0
    while offset >= 0:
        data[offset + at % len(value)] ^= 0xFF
        offset = data.find(value, offset + 1)
    (gen_dir / "data.mdb").write_bytes(bytes(data))


def test_a_flipped_byte_in_a_wide_record_names_the_sample(make_store, store_path, gather):
    store = make_store("lmdb")
    write_generation(store, 0, 6, wide)
    flip_in_record(store_path, 4, -3)  # inside the last leaf's bytes
    reader = store.reader()
    for batch in ([0, 4], [4, 1]):  # the first record is checked apart from the rest
        with pytest.raises(CorruptSampleError, match="sample 4 of generation 0"):
            reader.get_batch(batch)
    assert_same(stack_samples([wide(0, i) for i in (5, 0)]), reader.get_batch([5, 0]))


def test_a_fixed_record_whose_header_changed_is_corrupt(make_store, store_path, gather):
    """A record of a fixed-records generation that no longer has the generation's layout is damage,
    not a reason to read the batch another way."""
    store = make_store("lmdb")
    write_generation(store, 0, 6, wide)
    flip_in_record(store_path, 4, 8 + 20)  # inside the record's structure JSON
    reader = store.reader()
    with pytest.raises(CorruptSampleError, match="sample 4"):
        reader.get_batch([0, 4])
    assert_same(stack_samples([wide(0, i) for i in (0, 5)]), reader.get_batch([0, 5]))


def test_compressed_samples_keep_one_record_each(make_store, store_path):
    store = make_store("lmdb", compression="zstd")
    write_generation(store, 0, 6, fixed_sample)
    assert "lmdb_layout" not in manifest(store_path)
    check_generation(store.reader(), 0, 6, fixed_sample)


def test_a_format_1_store_keeps_records_and_reads(store_path):
    """A store made before the columnar layout: its generations are records, and new ones stay so,
    so the cachestore that made it can still read every generation."""
    store = open_store(store_path, "lmdb")
    store.backend.write_meta({**store.meta, "format": 1})
    store.close()
    old = open_store(store_path, "lmdb")
    write_generation(old, 0, 5, fixed_sample)
    assert "lmdb_layout" not in manifest(store_path)
    check_generation(old.reader(), 0, 5, fixed_sample)
    old.close()
    assert json.loads((Path(store_path) / "store.json").read_text())["format"] == 1
    reopened = open_store(store_path, "lmdb")
    check_generation(reopened.reader(), 0, 5, fixed_sample)
    reopened.close()
