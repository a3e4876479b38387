"""The strict parsers of store files (cachestore/guard/untrusted.py): what the store writes passes, the rest is refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from cachestore import MalformedFileError, PickleRefusedError
from cachestore.backends.manifest import MANIFEST_NAME, check_generation
from cachestore.backends.memmap_files import INDEX_DTYPE
from cachestore.format import codec, structure
from cachestore.guard import untrusted

from .helpers import Opaque, fixed_sample, variable_sample


@pytest.mark.parametrize("text, value", [("0", 0), ("000123", 123), ("9" * 18, 10**18 - 1)])
def test_decimal_takes_ascii_digits(text, value):
    assert untrusted.decimal(text) == value


@pytest.mark.parametrize("text", ["", "²", "٠", "１", "1" * 19, " 1", "1\n", "-1", "+1", "1_000", "0x1"])
def test_decimal_refuses_anything_else(text):
    assert untrusted.decimal(text) is None


@pytest.mark.parametrize("name", ["a.seg", "w0-i0-p12-ab", "main", "...", "x y", "é"])
def test_a_file_name_inside_a_directory_passes(name):
    assert untrusted.file_name(name, "here") == name


@pytest.mark.parametrize("name", ["", ".", "..", "../x", "/etc/passwd", "a/b", "a\0b", "\ud800", "x" * 201, 7, None])
def test_a_name_reaching_outside_is_refused(name):
    assert not untrusted.is_file_name(name)
    with pytest.raises(MalformedFileError, match="here names"):
        untrusted.file_name(name, "here")


SAMPLES = [fixed_sample(0, 3), variable_sample(1, 4), {"s": "text", "b": b"\x00bytes", "n": None, "f": 1.5},
           [np.zeros((2, 0), np.uint8), (np.datetime64("2024-01-01"), np.array(["ab", "c"]))],
           {"t": torch.arange(6).reshape(2, 3), "bf": torch.ones(3, dtype=torch.bfloat16)},
           {"big-endian": np.arange(4, dtype=">f8"), "bool": np.ones(2, bool), "c": np.complex64(1j)}]


@pytest.mark.parametrize("sample", SAMPLES, ids=range(len(SAMPLES)))
def test_every_structure_the_codec_writes_parses_back(sample):
    treedef, _ = codec.flatten(sample)
    as_json = json.loads(json.dumps(codec.treedef_to_json(treedef)))
    assert structure.parse_treedef(as_json, "here") == treedef


def _nested(depth: int) -> list:
    node: list = ["n"]
    for _ in range(depth):
        node = ["l", [node]]
    return node


BAD_STRUCTURES = {
    "not-a-list": {"a": 1}, "empty": [], "unknown-tag": ["q"], "tag-not-str": [1],
    "shape-str": ["a", "<f4", "8"], "shape-negative": ["a", "<f4", [-1, -4]], "shape-bool": ["a", "<f4", [True]],
    "shape-float": ["a", "<f4", [2.0]], "shape-too-many-dims": ["a", "<f4", [1] * 33],
    "shape-overflow": ["a", "<f8", [1 << 40, 1 << 40]], "dtype-object": ["a", "|O", [1]],
    "dtype-void": ["a", "|V8", [1]], "dtype-record": ["a", [["x", "<f4"]], [1]], "dtype-subarray": ["a", "(2,)<f4", [1]],
    "dtype-garbage": ["a", "float99", [1]], "dtype-not-str": ["a", 4, [1]], "dtype-long": ["a", "<f4" * 20, [1]],
    "scalar-dtype": ["g", "|O"], "keys-not-str": ["d", [1], [["n"]]], "keys-repeated": ["d", ["k", "k"], [["n"], ["n"]]],
    "keys-count": ["d", ["k"], []], "size-negative": ["y", -1], "size-str": ["s", "3"], "extra-field": ["i", 1],
    "too-deep": _nested(untrusted.MAX_DEPTH + 1),
}


@pytest.mark.parametrize("name", list(BAD_STRUCTURES))
def test_a_malformed_structure_is_refused(name):
    with pytest.raises(MalformedFileError, match="^here"):
        structure.parse_treedef(BAD_STRUCTURES[name], "here")


def test_a_structure_of_too_many_nodes_is_refused():
    wide = ["l", [["n"]] * (structure.MAX_NODES + 1)]
    with pytest.raises(MalformedFileError, match="larger or deeper"):
        structure.parse_treedef(wide, "here")


@pytest.mark.parametrize("data, why", [(b"[" * 10_000 + b"]" * 10_000, "nested"), (b"{\"a\": [1,", "not JSON"),
                                       (b"\xff", "not JSON"), (b"[[[" * 30 + b"]]]" * 30, "deeper than"),
                                       (b" " * 2000, "more than")])
def test_parse_json_bounds_size_and_depth(data, why):
    with pytest.raises(MalformedFileError, match=why):
        untrusted.parse_json(data, "doc", limit=1000 if why == "more than" else 100_000)


def test_read_document_checks_the_size_before_reading(tmp_path):
    path = tmp_path / "big.json"
    path.write_bytes(b"[" + b"1," * 1000 + b"1]")
    with pytest.raises(MalformedFileError, match="more than the 100"):
        untrusted.read_document(path, limit=100)
    assert untrusted.read_document(path)[0] == 1


def _manifest(**changes: object) -> dict:
    doc = {"generation": 3, "num_samples": 4, "created": 1.0, "layout": "fixed", "files": {"index.npy": 10},
           "raw_bytes": 5, "stored_bytes": 5, "extra": {}, "checksum": "ab", "schema": ["i"]}
    doc.update(changes)
    return {k: v for k, v in doc.items() if v is not ...}


def test_a_manifest_the_store_writes_passes():
    assert untrusted.parse_manifest(_manifest(), "m", 3)["num_samples"] == 4
    assert untrusted.parse_manifest(_manifest(files=..., checksum=..., schema=..., layout=None), "m", 3)


@pytest.mark.parametrize("changes", [{"generation": 4}, {"generation": "3"}, {"num_samples": -1},
                                     {"num_samples": True}, {"num_samples": 1 << 41}, {"created": "now"},
                                     {"created": float("nan")}, {"layout": "other"}, {"files": []},
                                     {"files": {"../x": 1}}, {"files": {"a": -1}}, {"raw_bytes": 1.5},
                                     {"extra": []}, {"checksum": 5}, {"chunk_rows": 0}],
                         ids=str)
def test_a_malformed_manifest_field_is_refused(changes):
    with pytest.raises(MalformedFileError, match="^m"):
        untrusted.parse_manifest(_manifest(**changes), "m", 3)


def test_a_manifest_with_a_malformed_schema_is_damage(tmp_path):
    # The manifest's fields are checked by untrusted.parse_manifest, its schema (a sample's
    # structure) by the format's own parser: the generation is damaged either way.
    gen_dir = tmp_path / "gen-000003"
    gen_dir.mkdir()
    (gen_dir / MANIFEST_NAME).write_text(json.dumps(_manifest(files=..., schema=["q"])))
    _, why = check_generation(gen_dir, 3, lambda *_: None)
    assert why is not None and "is invalid" in why and "('schema')" in why


@pytest.mark.parametrize("meta", [[], "x", {"format": "2"}, {"format": -1}, {"backend": 1},
                                  {"fingerprint": [1]}, {"producer": "p"}, {"compression": "lz4"}], ids=str)
def test_a_malformed_store_meta_is_refused(meta):
    with pytest.raises(MalformedFileError, match="^store.json"):
        untrusted.parse_store_meta(meta, "store.json")


def test_a_shards_totals_the_store_writes_pass():
    for layout in (None, "mixed", [48, ["i"]]):
        stats = {"raw_bytes": 5, "stored_bytes": 4, "count": 2, "layout": layout}
        assert untrusted.parse_shard_stats(stats, "s") == stats


@pytest.mark.parametrize("stats", [[], "x", {"stored_bytes": 1}, {"raw_bytes": "1", "stored_bytes": 1},
                                   {"raw_bytes": 1, "stored_bytes": -1}, {"raw_bytes": 1, "stored_bytes": 1, "count": 1.0},
                                   {"raw_bytes": 1, "stored_bytes": 1, "layout": [1]},
                                   {"raw_bytes": 1, "stored_bytes": 1, "layout": ["1", []]},
                                   {"raw_bytes": 1, "stored_bytes": 1, "layout": 7}], ids=str)
def test_a_malformed_shards_totals_are_refused(stats):
    with pytest.raises(MalformedFileError, match="^s"):
        untrusted.parse_shard_stats(stats, "s")


@pytest.mark.parametrize("planted", [b"[1, 2]", b'{"raw_bytes": 1}', b" " * (untrusted.DOCUMENT_BYTES + 1)],
                         ids=["a list", "a missing field", "too large"])
def test_an_lmdb_commit_refuses_a_tampered_shard_total_with_the_stores_error(tmp_path, planted, monkeypatch):
    # A staging area another process left (and anyone could edit): its totals are read at the commit.
    from cachestore import open_store
    from cachestore.backends.lmdb_backend import LmdbBackend

    finalize = LmdbBackend._finalize

    def tampered(self, staging, num_samples):
        (stats,) = Path(staging).glob("stats-*.json")
        stats.write_bytes(planted)
        return finalize(self, staging, num_samples)

    monkeypatch.setattr(LmdbBackend, "_finalize", tampered)
    store = open_store(tmp_path / "s", "lmdb")
    writer = store.writer(0, 2)
    for i in range(2):
        writer.put(i, fixed_sample(i, 3))
    with pytest.raises(MalformedFileError, match="stats-"):
        writer.commit()
    assert [g.id for g in store.generations() if g.committed] == []


def _rows(n: int = 4) -> np.ndarray:
    rows = np.zeros(n, dtype=INDEX_DTYPE)
    rows["index"] = np.arange(n)
    rows["shard"] = [-1, 0, 1, -1][:n]
    return rows


@pytest.mark.parametrize("field, value, why", [("shard", 2, "shard 2"), ("shard", -2, "shard -2"),
                                               ("index", 7, "in order"), ("offset", -1, "negative"),
                                               ("length", -1, "negative"), ("raw", -5, "negative"),
                                               ("length", 1 << 60, "beyond")])
def test_index_rows_name_only_listed_shards_and_sizes_that_can_be(field, value, why):
    untrusted.check_index_rows(_rows(), 4, 2, "idx")
    rows = _rows()
    rows[field][1] = value
    with pytest.raises(MalformedFileError, match=why):
        untrusted.check_index_rows(rows, 4, 2, "idx")
    with pytest.raises(MalformedFileError, match="has 4 rows"):
        untrusted.check_index_rows(_rows(), 5, 2, "idx")


def test_unflatten_loads_a_pickled_leaf_only_when_told():
    treedef, leaves = codec.flatten({"o": Opaque(3)}, allow_pickle=True)
    with pytest.raises(PickleRefusedError):
        codec.unflatten(treedef, leaves)
    assert codec.unflatten(treedef, leaves, allow_pickle=True) == {"o": Opaque(3)}


@pytest.mark.parametrize("dtype", ["<U3", "<M8[s]", ">f4", "|S2"])
def test_a_tensor_leaf_holds_numbers_only(dtype):
    with pytest.raises(MalformedFileError, match="no tensor has"):
        structure.parse_treedef(["t", dtype, [2]], "here")
    assert structure.parse_treedef(["a", dtype, [2]], "here") == ("a", dtype, (2,))


@pytest.mark.parametrize("planted", [b'["' + b"a" * (16 << 20) + b'"]', b'{"a": 1}', b"[1, 2"],
                         ids=["too large", "an object", "not JSON"])
def test_a_fetched_generation_whose_shard_list_is_malformed_is_refused(tmp_path, planted):
    from cachestore import CorruptSampleError, open_store
    from cachestore.remote.verify import verify_memmap_dir

    store = open_store(tmp_path / "s", "memmap")
    with store.writer(0, 3) as writer:
        for i in range(3):
            writer.put(i, variable_sample(i, 4))
    (gen_dir,) = (tmp_path / "s").glob("gen-*")
    verify_memmap_dir(gen_dir, False, "g")  # as committed: it passes
    (gen_dir / "shards.json").write_bytes(planted)
    with pytest.raises(CorruptSampleError, match="^g: (its )?shards.json"):
        verify_memmap_dir(gen_dir, False, "g")
