"""A store someone else wrote, tampered with as an attacker would: an error naming the file, never more.

Each case edits a committed store the way whoever can write its directory could, then reads it
through the library (reader, verify) and the command line (inspect, inspect --verify, prune):
no file outside the store is read or removed, no traceback, no signal, no allocation beyond
what a record's index says, and a sound generation beside the damage stays. Where a case needs
the store's own checks to pass (sizes, checksums), the files are resealed (``reseal``) as a
determined attacker would.
"""

from __future__ import annotations

import json
import os
import struct
import tracemalloc
from pathlib import Path

import lmdb
import numpy as np
import pytest

from cachestore import CacheStoreError, CorruptSampleError, MalformedFileError, open_store
from cachestore.cli import main
from cachestore.format.checksums import checksum

from .helpers import as_older_store, check_generation, fixed_sample, reseal, variable_sample, write_generation

N = 8


def _gen(store_path: str, generation: int = 0) -> Path:
    return Path(store_path) / f"gen-{generation:06d}"


def _cli_names(capsys, store_path: str, named: str, verify_status: int = 1) -> None:
    """inspect, inspect --verify and prune return (no traceback), and what --verify reports names
    `named` (listing shows what its cheap checks find; opening, which --verify does, finds the rest)."""
    assert main(["inspect", store_path]) in (0, 1)
    capsys.readouterr()
    assert main(["inspect", store_path, "--verify"]) == verify_status
    out, err = capsys.readouterr()
    assert named in out + err
    main(["prune", store_path, "--keep", "5", "--dry-run"])
    capsys.readouterr()


def _outside_files(store_path: str) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in Path(store_path).parent.rglob("*")
            if p.is_file() and not p.is_symlink() and store_path not in str(p)}


# ------------------------------------------------------------------------- files outside the store


@pytest.mark.parametrize("where", ["relative", "absolute"])
def test_shards_json_naming_a_file_outside_the_store(store_path, capsys, where):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, N, variable_sample)
    gen_dir = _gen(store_path)
    (seg,) = gen_dir.glob("*.seg")
    outside = Path(store_path).parent / "outside.seg"
    outside.write_bytes(seg.read_bytes())  # good data, were it read
    seg.unlink()
    name = "../../outside" if where == "relative" else str(outside.with_suffix(""))
    (gen_dir / "shards.json").write_text(json.dumps([name]))
    as_older_store(gen_dir)  # no "files" list: such a manifest took any shard name
    with pytest.raises(CorruptSampleError, match="shards.json") as info:
        store.reader(0)
    assert "no file of the store" in str(info.value)
    kept = _outside_files(store_path)
    _cli_names(capsys, store_path, "shards.json")
    assert main(["prune", store_path]) == 0
    assert not gen_dir.exists() and _outside_files(store_path) == kept
    store.close()


MEMMAP_FILES = {"segment": (variable_sample, "*.seg"), "column": (fixed_sample, "col-0.bin"),
                "index": (fixed_sample, "index.npy"), "schema": (fixed_sample, "schema.json"),
                "shards": (fixed_sample, "shards.json")}


@pytest.mark.parametrize("older", [False, True], ids=["files-recorded", "older-manifest"])
@pytest.mark.parametrize("case", [*MEMMAP_FILES, "lmdb-data"])
def test_a_data_file_swapped_for_a_symlink_is_never_followed(store_path, capsys, case, older):
    backend = "lmdb" if case == "lmdb-data" else "memmap"
    make, pattern = (fixed_sample, "data.mdb") if backend == "lmdb" else MEMMAP_FILES[case]
    store = open_store(store_path, backend)
    write_generation(store, 0, N, make)
    write_generation(store, 1, N, make)
    gen_dir = _gen(store_path)
    (victim,) = gen_dir.glob(pattern)
    outside = Path(store_path).parent / f"outside-{victim.name}"
    victim.rename(outside)  # the very bytes: following the link would serve them as good data
    victim.symlink_to(outside)
    if older:
        as_older_store(gen_dir)
    with pytest.raises(CorruptSampleError, match="generation 0 .* is damaged") as info:
        store.reader(0)
    assert victim.name in str(info.value) and "symlink" in str(info.value)
    check_generation(store.reader(1), 1, N, make)
    kept = _outside_files(store_path)
    _cli_names(capsys, store_path, victim.name)
    assert main(["prune", store_path, "--keep", "5"]) == 0
    assert not gen_dir.exists() and _outside_files(store_path) == kept
    store.close()


# ------------------------------------------------------------------------- reinterpreted values


def _edit_schema(gen_dir: Path, edit: str) -> None:
    schema = json.loads((gen_dir / "schema.json").read_text())
    image = schema[2][0]  # {"image": ["a", "<f4", [4, 8]], ...}
    assert image[:2] == ["a", "<f4"]
    image[1:] = ["<i4", [4, 8]] if edit == "<i4" else [">f8", [4, 4]]  # the same bytes per row
    (gen_dir / "schema.json").write_text(json.dumps(schema))


@pytest.mark.parametrize("edit", ["<i4", ">f8 half the shape"])
def test_a_schema_changed_alone_is_damage_not_other_values(store_path, capsys, edit):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, N)
    gen_dir = _gen(store_path)
    _edit_schema(gen_dir, edit)
    reseal(gen_dir)  # sizes unchanged anyway: the manifest's own checksum still holds
    with pytest.raises(CorruptSampleError, match="schema.json does not match the schema the manifest recorded"):
        store.reader(0)
    (bad,) = store.verify()
    assert bad.index is None and "schema.json" in str(bad)
    _cli_names(capsys, store_path, "schema.json")
    store.close()


def test_an_lmdb_schema_is_covered_by_the_manifest_checksum(store_path, capsys):
    store = open_store(store_path, "lmdb")
    write_generation(store, 0, N)
    manifest_path = _gen(store_path) / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    assert "<f4" in json.dumps(manifest["schema"])
    manifest_path.write_text(json.dumps(manifest).replace('"<f4"', '"<i4"'))
    with pytest.raises(CorruptSampleError, match="does not match its checksum"):
        store.reader(0)
    _cli_names(capsys, store_path, "manifest.json")
    store.close()


def test_a_generation_committed_before_manifests_recorded_the_schema_reads_as_before(store_path):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, N)
    as_older_store(_gen(store_path))
    check_generation(store.reader(0), 0, N)
    assert store.verify() == []
    store.close()


# ------------------------------------------------------------------------- a decompression bomb

BOMB_BYTES = 512 << 20


def bomb(content_size: bool, raw: int) -> bytes:
    """A record of BOMB_BYTES of zeros (a bytes leaf), zstd-compressed to a few dozen KB; its header
    says the leaves take `raw` bytes (what the sample it replaces took)."""
    import zstandard

    meta = json.dumps(["y", BOMB_BYTES]).encode()
    head = meta + bytes(-len(meta) % 16)
    compressor = zstandard.ZstdCompressor(level=1, write_content_size=content_size)
    stream = compressor.compressobj(size=len(head) + BOMB_BYTES if content_size else -1)
    parts, zeros = [stream.compress(head)], bytes(16 << 20)
    for _ in range(BOMB_BYTES // len(zeros)):
        parts.append(stream.compress(zeros))
    parts.append(stream.flush())
    return struct.pack("<4sIII", b"CSR1", 1, len(meta), raw) + b"".join(parts)


def plant_memmap(store_path: str, index: int, record: bytes) -> None:
    gen_dir = _gen(store_path)
    (seg,) = gen_dir.glob("*.seg")
    rows = np.load(gen_dir / "index.npy")
    with open(seg, "ab") as f:
        rows[index]["offset"] = f.tell()
        f.write(record)
    rows[index]["length"], rows[index]["checksum"] = len(record), checksum([record])
    rows[index]["shard"] = 0  # the one shard, whose segment holds the records
    np.save(gen_dir / "index.npy", rows)
    reseal(gen_dir)


def plant_lmdb(store_path: str, index: int, record: bytes) -> None:
    gen_dir = _gen(store_path)
    env = lmdb.open(str(gen_dir), lock=False, map_size=1 << 32)
    with env.begin(write=True) as txn:
        txn.put(struct.pack(">Q", index), struct.pack("<Q", checksum([record])) + record)
    env.close()
    reseal(gen_dir)


@pytest.mark.parametrize("content_size", [True, False], ids=["declared", "undeclared"])
@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_decompression_bomb_allocates_no_more_than_its_index_says(store_path, capsys, backend, content_size):
    store = open_store(store_path, backend, compression="zstd")
    write_generation(store, 0, N, variable_sample)
    record = bomb(content_size, raw=64)
    assert len(record) < 1 << 20
    (plant_memmap if backend == "memmap" else plant_lmdb)(store_path, 3, record)
    reader = store.reader(0)
    tracemalloc.start()
    try:
        with pytest.raises(CorruptSampleError, match="sample 3 of generation 0") as info:
            reader[3]
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 16 << 20, f"{peak} bytes allocated reading a record whose index says 64"
    assert "decompress" in str(info.value)
    assert [e.index for e in store.verify()] == [3]
    for i in set(range(N)) - {3}:  # the others read as they were written
        np.testing.assert_array_equal(reader[i]["tokens"], variable_sample(0, i)["tokens"])
    reader.close()
    store.close()


# ------------------------------------------------------------------------- names


STRAYS = ["gen-٠", "gen-²", "gen-0", "gen-0000000", "gen-000001x", ".staging-²-1-ab", ".staging-000002-٣-ab",
          ".shared-²-abc", ".shared-tmp-²-ab", "rotation-²-ab", ".x.²³.ab.tmp", "gen-999999999999999999999"]


@pytest.mark.parametrize("stray", STRAYS)
def test_a_name_that_is_not_the_stores_is_left_alone(store_path, capsys, stray):
    store = open_store(store_path, "memmap")
    write_generation(store, 0, N)
    (Path(store_path) / stray).mkdir()
    (Path(store_path) / stray / "junk").write_text("someone else's")
    assert [(g.id, g.committed) for g in store.generations()] == [(0, True)]
    check_generation(store.reader(), 0, N)
    assert main(["inspect", store_path]) == 0
    assert main(["inspect", store_path, "--verify"]) == 0
    assert main(["prune", store_path, "--keep", "5"]) == 0
    assert main(["prune", store_path, "--keep", "5", "--partial"]) == 0
    assert (_gen(store_path) / "manifest.json").exists(), "the sound generation 0 stays"
    assert (Path(store_path) / stray / "junk").read_text() == "someone else's"
    store.close()


# ------------------------------------------------------------------------- malformed fields


def _write_meta(store_path: str, text: str) -> None:
    (Path(store_path) / "store.json").write_text(text)


@pytest.mark.parametrize("text", ["[1, 2]", "[" * 100_000 + "]" * 100_000, '{"format": "2"}',
                                  '{"format": 2, "compression": "lz77"}', '{"format": 2, "fingerprint": [1]}',
                                  "\xff\xfe", '{"format": 2, "backend": "nosuch"}'],
                         ids=["list", "nested", "format-str", "compression", "fingerprint", "not-utf8", "backend"])
def test_a_malformed_store_json_is_an_error_naming_it(store_path, capsys, text):
    write_generation(open_store(store_path, "memmap"), 0, N)
    _write_meta(store_path, text)
    with pytest.raises(CacheStoreError) as info:
        open_store(store_path, readonly=True).reader()
    assert "store.json" in str(info.value) or "nosuch" in str(info.value)
    assert isinstance(info.value, (MalformedFileError, ValueError))
    assert main(["inspect", store_path]) == 1
    assert main(["prune", store_path]) == 1
    err = capsys.readouterr().err
    assert "store.json" in err or "nosuch" in err
    assert _gen(store_path).exists()


def _edit_index(gen_dir: Path, field: str, value: int) -> None:
    rows = np.load(gen_dir / "index.npy")
    rows[2][field] = value
    np.save(gen_dir / "index.npy", rows)


def _edit_schema_node(gen_dir: Path, shape: object) -> None:
    schema = json.loads((gen_dir / "schema.json").read_text())
    schema[2][0][2] = shape
    (gen_dir / "schema.json").write_text(json.dumps(schema))
    as_older_store(gen_dir)  # the schema.json parser itself, without the manifest's copy to compare


def _edit_manifest(gen_dir: Path, key: str, value: object) -> None:
    manifest = json.loads((gen_dir / "manifest.json").read_text())
    manifest[key] = value
    (gen_dir / "manifest.json").write_text(json.dumps(manifest))


GENERATION_CASES = {
    "index-shard-7": (fixed_sample, lambda d: _edit_index(d, "shard", 7), "index.npy"),
    "index-shard-minus-2": (variable_sample, lambda d: _edit_index(d, "shard", -2), "index.npy"),
    "index-offset-negative": (variable_sample, lambda d: _edit_index(d, "offset", -5), "index.npy"),
    "index-out-of-order": (fixed_sample, lambda d: _edit_index(d, "index", 5), "index.npy"),
    "schema-shape-string": (fixed_sample, lambda d: _edit_schema_node(d, "8"), "schema.json"),
    "schema-shape-negative": (fixed_sample, lambda d: _edit_schema_node(d, [-1, -4]), "schema.json"),
    "schema-nested": (fixed_sample, lambda d: (d / "schema.json").write_text("[" * 5000 + "]" * 5000) or
                      as_older_store(d), "schema.json"),
    "schema-object-dtype": (fixed_sample, lambda d: (d / "schema.json").write_text(
        json.dumps(["d", ["o"], [["a", "|O", [1]]]])) or as_older_store(d), "schema.json"),
    "manifest-list": (fixed_sample, lambda d: (d / "manifest.json").write_text("[]"), "manifest.json"),
    "manifest-nested": (fixed_sample, lambda d: (d / "manifest.json").write_text("{\"a\":" * 5000 + "1" + "}" * 5000),
                        "manifest.json"),
    "manifest-count-string": (fixed_sample, lambda d: _edit_manifest(d, "num_samples", "8"), "manifest.json"),
    "manifest-files-outside": (fixed_sample, lambda d: _edit_manifest(d, "files", {"../x": 1}), "manifest.json"),
    "manifest-created-huge": (fixed_sample, lambda d: _edit_manifest(d, "created", 1e300), None),
    "lmdb-chunk-rows-zero": (fixed_sample, lambda d: _edit_manifest(d, "chunk_rows", 0), "manifest.json"),
}


@pytest.mark.parametrize("case", list(GENERATION_CASES))
def test_a_malformed_field_is_damage_naming_its_file(store_path, capsys, case):
    make, edit, named = GENERATION_CASES[case]
    backend = "lmdb" if case.startswith("lmdb") else "memmap"
    store = open_store(store_path, backend)
    write_generation(store, 0, N, make)
    write_generation(store, 1, N, make)
    gen_dir = _gen(store_path)
    edit(gen_dir)
    if named is None:  # a value in range for the parser (a time), out of range for a clock: shown as it is
        reseal(gen_dir)
        assert main(["inspect", store_path]) == 0 and "1e+300" in capsys.readouterr().out
        store.close()
        return
    if case.startswith("index"):
        reseal(gen_dir)  # only the rows' own check can refuse them
    with pytest.raises(CorruptSampleError, match="generation 0 .* is damaged") as info:
        store.reader(0)
    assert named in str(info.value)
    check_generation(store.reader(1), 1, N, make)
    _cli_names(capsys, store_path, named)
    assert main(["prune", store_path, "--keep", "5"]) == 0
    # Listing finds what its cheap checks find (not rows of an index: that is opening's job), and
    # prune removes what listing finds; a writer of generation 0 replaces either.
    assert gen_dir.exists() == case.startswith("index") and _gen(store_path, 1).exists()
    store.close()


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
@pytest.mark.parametrize("structure", [["a", "<f4", [-1, -4]], ["a", "<f4", "8"], ["q"], ["d", ["k"], []],
                                       ["a", "|O", [2]], ["a", "<f4", [1 << 40, 1 << 40]]],
                         ids=["negative-shape", "string-shape", "tag", "keys", "object", "huge"])
def test_a_record_with_a_malformed_structure_is_a_corrupt_sample(store_path, capsys, backend, structure):
    store = open_store(store_path, backend)
    write_generation(store, 0, N, variable_sample)
    meta = json.dumps(structure).encode()
    record = struct.pack("<4sIII", b"CSR1", 0, len(meta), 0) + meta + bytes(-len(meta) % 16) + bytes(64)
    (plant_memmap if backend == "memmap" else plant_lmdb)(store_path, 5, record)
    reader = store.reader(0)
    with pytest.raises(CorruptSampleError, match="sample 5 of generation 0 .* structure"):
        reader[5]
    with pytest.raises(CorruptSampleError, match="sample 5"):
        reader.get_batch([4, 5])
    assert [e.index for e in store.verify()] == [5]
    assert main(["inspect", store_path, "--verify"]) == 1
    assert "sample 5" in capsys.readouterr().out
    reader.close()
    store.close()


@pytest.mark.parametrize("record", ["[" * 100_000 + "]" * 100_000, "[1, 2]", "{\"fingerprint\": {\"a\": [[[]]]}}"],
                         ids=["nested", "list", "foreign"])
def test_a_staging_area_with_a_malformed_record_is_debris_not_a_crash(store_path, capsys, record):
    store = open_store(store_path, "memmap", fingerprint={"dataset": "d"})
    write_generation(store, 0, N)
    staging = Path(store_path) / ".staging-000001-999999999-ab"  # of a pid that is not alive
    staging.mkdir()
    (staging / "staging.json").write_text(record)
    assert [g.id for g in store.generations()] == [0, 1]
    assert main(["inspect", store_path]) == 0
    assert main(["prune", store_path]) == 0
    assert not staging.exists() and _gen(store_path).exists()
    store.close()


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_text_leaf_that_is_not_utf8_is_a_corrupt_sample(store_path, backend):
    store = open_store(store_path, backend)
    write_generation(store, 0, N, variable_sample)
    meta = json.dumps(["s", 2]).encode()
    record = struct.pack("<4sIII", b"CSR1", 0, len(meta), 2) + meta + bytes(-len(meta) % 16) + b"\xff\xfe"
    (plant_memmap if backend == "memmap" else plant_lmdb)(store_path, 3, record)
    with store.reader(0) as reader:
        with pytest.raises(CorruptSampleError, match="sample 3 of generation 0 .* not UTF-8"):
            reader[3]
    store.close()
