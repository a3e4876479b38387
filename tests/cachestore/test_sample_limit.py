"""``max_sample_bytes``: one store-wide bound on what a sample may take read back, whatever its
record, its index row or its schema say (whoever wrote them can re-sign them)."""

from __future__ import annotations

import json
import tracemalloc
from pathlib import Path

import numpy as np
import pytest

from cachestore import CorruptSampleError, open_store
from cachestore.space.room import memory_room

from .helpers import reseal, variable_sample, write_generation
from .test_tampered import BOMB_BYTES, N, bomb, plant_lmdb, plant_memmap


def _gen(store_path: str) -> Path:
    return Path(store_path) / "gen-000000"


def _resign_raw(store_path: str, backend: str, index: int) -> None:
    """Make the index (memmap's row, lmdb's manifest total) say the bomb's size, and re-sign it."""
    gen_dir = _gen(store_path)
    if backend == "memmap":
        rows = np.load(gen_dir / "index.npy")
        rows[index]["raw"] = BOMB_BYTES + 64
        np.save(gen_dir / "index.npy", rows)
    else:
        manifest = json.loads((gen_dir / "manifest.json").read_text())
        manifest["raw_bytes"] = BOMB_BYTES + 64
        (gen_dir / "manifest.json").write_text(json.dumps(manifest))
    reseal(gen_dir)


def _bombed_store(store_path, backend: str):
    """A store whose sample 3 is a zstd bomb with a re-signed raw size, opened with max_sample_bytes=1MiB."""
    store = open_store(store_path, backend, compression="zstd")
    write_generation(store, 0, N, variable_sample)
    store.close()
    (plant_memmap if backend == "memmap" else plant_lmdb)(store_path, 3, bomb(True, raw=BOMB_BYTES))
    _resign_raw(store_path, backend, 3)
    return open_store(store_path, compression="zstd", max_sample_bytes="1MiB")


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_forged_raw_size_decompresses_no_further_than_max_sample_bytes(store_path, backend):
    store = _bombed_store(store_path, backend)
    reader = store.reader(0)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptSampleError, match="max_sample_bytes"):
            reader[3]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated with max_sample_bytes of 1 MiB"
    np.testing.assert_array_equal(reader[2]["tokens"], variable_sample(0, 2)["tokens"])
    reader.close()
    store.close()


def _huge_shape(node: list) -> bool:
    """Give the first array leaf of a schema the shape ``[2**40]`` (in place)."""
    if node and node[0] in ("a", "t") and len(node) == 3:
        node[2] = [2 ** 40]
        return True
    return any(_huge_shape(child) for child in node[1:] if isinstance(child, list) and child
               and isinstance(child[0], (str, list))) or any(
        _huge_shape(c) for child in node[1:] if isinstance(child, list) for c in child if isinstance(c, list))


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_schema_claiming_a_huge_sample_is_damage_not_an_allocation(store_path, backend, capsys):
    store = open_store(store_path, backend)
    write_generation(store, 0, N)
    store.close()
    gen_dir = _gen(store_path)
    manifest = json.loads((gen_dir / "manifest.json").read_text())
    assert _huge_shape(manifest["schema"])
    (gen_dir / "manifest.json").write_text(json.dumps(manifest))
    if (gen_dir / "schema.json").exists():
        (gen_dir / "schema.json").write_text(json.dumps(manifest["schema"]))
    reseal(gen_dir)
    store = open_store(store_path)
    with pytest.raises(CorruptSampleError, match="max_sample_bytes"):
        store.reader(0).get_batch([0, 1])
    store.close()


def test_the_default_bound_is_a_quarter_of_the_memory_room_at_most_the_budget(store_path):
    with open_store(store_path, "memmap") as store:
        quarter = memory_room() // 4  # (the room moves a little as other processes run)
        assert abs(store.spec.max_sample_bytes - quarter) < quarter // 4
    with open_store(store_path, "memmap", disk_budget="1MiB") as store:
        assert store.spec.max_sample_bytes == 1 << 20
    with open_store(store_path, "memmap", max_sample_bytes=4096) as store:
        assert store.spec.max_sample_bytes == 4096
    with pytest.raises(ValueError, match="max_sample_bytes"):
        open_store(store_path, "memmap", max_sample_bytes=0)


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_the_default_bound_of_a_generation_of_one_schema_is_that_schema(store_path, backend):
    # Derived from the schema and the budget: a fixed-layout generation's samples take exactly its
    # schema's bytes, whatever room the store allows; a generation of variable samples keeps the store's.
    from cachestore.format import codec

    with open_store(store_path, backend, disk_budget="64MiB") as store:
        write_generation(store, 0, N)
        write_generation(store, 1, N, variable_sample)
        fixed, variable = store.reader(0), store.reader(1)
        one = sum(codec.row_bytes(codec.leaf_specs(codec.flatten(fixed[0])[0])))
        assert fixed.data.uniform_bytes == one and fixed.data.max_sample_bytes == one
        assert variable.data.uniform_bytes is None and variable.data.max_sample_bytes == 64 << 20
        assert store.spec.max_sample_bytes == 64 << 20
        fixed.close()
        variable.close()
    with open_store(store_path, backend, max_sample_bytes=16) as store:  # the smaller of the two
        reader = store.reader(1)
        assert reader.data.max_sample_bytes == 16
        reader.close()


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_verifying_a_pulled_generation_decompresses_no_further_than_max_sample_bytes(store_path, backend):
    """What ``cachestore pull`` runs on a downloaded generation before it becomes a local one."""
    from cachestore.remote.verify import verify_generation

    store = _bombed_store(store_path, backend)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptSampleError, match="sample 3"):
            verify_generation(store.backend, _gen(store_path), 0, N, False, "the pulled generation")
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    # (verification reads in blocks of 16 MiB; the bomb would take BOMB_BYTES)
    assert peak < 64 << 20, f"{peak} bytes allocated verifying with max_sample_bytes of 1 MiB"
    store.close()
