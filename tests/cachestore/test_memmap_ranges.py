"""The memmap format read by byte ranges (cachestore/backends/memmap_ranges.py), as the remote tier reads
it: here over a committed generation's own files, so every layout is checked without a server."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachestore import CorruptSampleError, MalformedFileError, open_store
from cachestore.backends.memmap_ranges import Part, RangeGeneration

from .helpers import assert_same, fixed_sample, variable_sample, write_generation


class FileSource:
    """A generation directory as a byte-range source (the remote tier's is its objects)."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.reads = 0

    def size(self, part: int, name: str) -> int | None:
        path = self.directory / name
        return path.stat().st_size if path.exists() else None

    def whole(self, part: int, name: str) -> bytes | None:
        path = self.directory / name
        return path.read_bytes() if path.exists() else None

    def read(self, wants):
        self.reads += 1
        out = []
        for _, name, offset, length in wants:
            with open(self.directory / name, "rb") as f:
                f.seek(offset)
                out.append(f.read(length))
        return out


def mixed_sample(generation: int, index: int) -> dict:
    return variable_sample(generation, index) if index % 3 == 0 else fixed_sample(generation, index)


def _by_ranges(store, n: int) -> tuple[RangeGeneration, FileSource]:
    source = FileSource(Path(store.reader(0).data.where))
    return RangeGeneration(source, [Part("whole", 0, n, True)], 0, n, str(source.directory), verify=True), source


@pytest.mark.parametrize("make,compression", [(fixed_sample, None), (fixed_sample, "zstd"), (variable_sample, None),
                                              (mixed_sample, None)], ids=["fixed", "zstd", "records", "mixed"])
def test_every_layout_reads_by_ranges_as_the_mapped_generation(store_path, make, compression):
    store = open_store(store_path, "memmap", compression=compression)
    write_generation(store, 0, 20, make)
    data, source = _by_ranges(store, 20)
    mapped = store.reader(0).data
    assert (data.batch_layout() is None) == (mapped.batch_layout() is None)
    for i in range(20):
        assert_same(mapped.read(i), data.read(i), f"sample {i}")
    idx = np.array([3, 4, 5, 6, 19, 0])
    if data.batch_layout() is not None:
        before = source.reads
        assert_same(mapped.read_batch(idx), data.read_batch(idx), "batch")
        assert source.reads == before + 1  # every run of every column asked for at once
    assert data.verify_all() == []


def test_a_damaged_row_is_found_by_its_checksum(store_path):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 20)
    column = Path(store.reader(0).data.where) / "col-0.bin"
    raw = bytearray(column.read_bytes())
    raw[5 * len(raw) // 20] ^= 0xFF  # sample 5's first byte
    column.write_bytes(bytes(raw))
    data, _ = _by_ranges(store, 20)
    with pytest.raises(CorruptSampleError, match="sample 5 .*checksum"):
        data.read_batch([4, 5, 6])
    assert [e.index for e in data.verify_all()] == [5]


def test_an_index_that_is_not_the_generations_is_refused_at_open(store_path):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 20, variable_sample)
    _, source = _by_ranges(store, 20)
    with pytest.raises(MalformedFileError, match="holds 20 rows but the manifest says 21"):
        RangeGeneration(source, [Part("whole", 0, 21, True)], 0, 21, "here", verify=True)
    segment = next(source.directory.glob("*.seg"))
    segment.write_bytes(segment.read_bytes()[:-1])
    with pytest.raises(MalformedFileError, match="a record lies outside its segment"):
        RangeGeneration(source, [Part("whole", 0, 20, True)], 0, 20, "here", verify=True)
