"""Namedtuples and nested tensors in a store: they come back as they went in, and reading a store
still runs none of its writer's choices (a namedtuple names a class: nothing is imported or called)."""

from __future__ import annotations

import collections
import importlib
import os
import sys
import typing

import numpy as np
import pytest
import torch

from cachestore import MalformedFileError, open_store, stack_samples
from cachestore.format import codec, named, structure

pytestmark = pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")

Point = collections.namedtuple("Point", "x y")


class Labelled(typing.NamedTuple):
    point: Point
    label: str
    image: torch.Tensor


def labelled(i: int) -> Labelled:
    return Labelled(Point(i, np.full(3, i, np.float32)), f"n{i}", torch.full((2, 2), float(i)))


def nested(i: int, layout=torch.strided) -> torch.Tensor:
    return torch.nested.nested_tensor([torch.arange(float(i + 1)).repeat(2, 1).T, torch.zeros(2, 2)], layout=layout)


def test_a_namedtuple_is_read_back_as_its_class_and_batched_as_one(store):
    with store.writer(0, 4) as writer:
        for i in range(4):
            writer.put(i, labelled(i))
    reader = store.reader()
    one = reader[2]
    assert type(one) is Labelled and type(one.point) is Point and one.label == "n2"
    assert torch.equal(one.image, labelled(2).image) and np.array_equal(one.point.y, labelled(2).point.y)
    batch = reader.get_batch([1, 3])
    expected = stack_samples([labelled(1), labelled(3)])
    assert type(batch) is Labelled and type(batch.point) is Point, "a namedtuple of batches, as collate makes"
    assert batch.label == expected.label and torch.equal(batch.image, expected.image)
    assert np.array_equal(batch.point.x, expected.point.x) and np.array_equal(batch.point.y, expected.point.y)
    reader.close()


def test_a_stackable_namedtuple_is_gathered_column_wise(store):
    with store.writer(0, 5) as writer:
        for i in range(5):
            writer.put(i, Point(i, np.full(2, i, np.int64)))
    reader = store.reader()
    batch = reader.get_batch([4, 0, 2])
    assert type(batch) is Point and batch.x.tolist() == [4, 0, 2] and batch.y[:, 0].tolist() == [4, 0, 2]
    reader.close()


@pytest.mark.parametrize("layout", [torch.strided, torch.jagged], ids=["strided", "jagged"])
def test_a_nested_tensor_is_stored_as_its_components(store, layout):
    with store.writer(0, 3) as writer:
        for i in range(3):
            writer.put(i, {"n": nested(i, layout), "i": i})
    reader = store.reader()
    for i in range(3):
        got = reader[i]["n"]
        assert got.is_nested and got.layout == layout
        assert [p.tolist() for p in got.unbind()] == [p.tolist() for p in nested(i, layout).unbind()]
    reader.close()


def test_an_empty_nested_tensor_keeps_its_dtype():
    treedef, leaves = codec.flatten(torch.nested.nested_tensor([], dtype=torch.float64))
    back = codec.unflatten(structure.parse_treedef(codec.treedef_to_json(treedef), "here"), leaves)
    assert back.is_nested and back.dtype == torch.float64 and back.unbind() == ()


def _planted_module(tmp_path, monkeypatch, name: str, body: str) -> str:
    """A module `name` on sys.path whose import writes a marker file; the marker's path."""
    marker = tmp_path / f"{name}.imported"
    (tmp_path / f"{name}.py").write_text(
        f"import collections, pathlib\npathlib.Path({str(marker)!r}).write_text('imported')\n{body}\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    return str(marker)


def test_a_reader_never_imports_the_module_a_namedtuple_names(tmp_path, monkeypatch, backend):
    name = f"planted_codec_named_{backend}"  # a module of its own per test: sys.modules keeps them
    marker = _planted_module(tmp_path, monkeypatch, name, "Pair = collections.namedtuple('Pair', 'a b')")
    module = importlib.import_module(name)
    with open_store(str(tmp_path / "s"), backend) as store:
        with store.writer(0, 2) as writer:
            for i in range(2):
                writer.put(i, module.Pair(i, np.arange(2)))
        os.remove(marker)
        monkeypatch.delitem(sys.modules, name)
        monkeypatch.setattr(named, "_found", {})
        reader = store.reader()
        sample, batch = reader[1], reader.get_batch([0, 1])
        assert not os.path.exists(marker), "reading imported the module the store names"
        assert type(sample).__name__ == "Pair" and sample._fields == ("a", "b") and sample.a == 1
        assert type(sample) is not module.Pair and type(batch) is type(sample)
        assert batch.a.tolist() == [0, 1]
        reader.close()


class Holder:
    # Its __qualname__ says "Pair", in this module: a name that leads nowhere (pickle fails on it).
    Pair = collections.namedtuple("Pair", "a b")


def test_a_namedtuple_made_in_a_class_body_comes_back_where_its_values_were_stored(store, monkeypatch):
    with store.writer(0, 2) as writer:
        for i in range(2):
            writer.put(i, Holder.Pair(i, -i))
    reader = store.reader()
    assert type(reader[1]) is Holder.Pair and type(reader.get_batch([0, 1])) is Holder.Pair
    monkeypatch.setattr(named, "_found", {})  # another process, which never stored one
    assert type(reader[1]) is not Holder.Pair and reader[1]._fields == ("a", "b") and reader[1].b == -1
    reader.close()


def test_a_class_found_is_built_without_running_its_code(tmp_path, monkeypatch):
    # A tuple subclass with the recorded fields and a constructor that acts: found, never called;
    # a module __getattr__ (PEP 562) that acts: never reached.
    marker = _planted_module(tmp_path, monkeypatch, "planted_codec_trap", """
class Trap(tuple):
    _fields = ("a",)
    def __new__(cls, *args):
        pathlib.Path(__file__ + '.called').write_text('called')
        return tuple.__new__(cls, args)
def __getattr__(name):
    pathlib.Path(__file__ + '.getattr').write_text(name)
    raise AttributeError(name)
""")
    import planted_codec_trap

    leaves = [np.array(7, np.int64)]
    built = codec.unflatten(("k", "planted_codec_trap", "Trap", ("a",), (("i",),)), leaves)
    assert type(built) is planted_codec_trap.Trap and built == (7,)
    missing = codec.unflatten(("k", "planted_codec_trap", "Missing", ("a",), (("i",),)), leaves)
    assert type(missing).__name__ == "Missing" and missing.a == 7
    assert os.path.exists(marker)  # the import above ran the module
    assert not any(os.path.exists(str(tmp_path / "planted_codec_trap.py") + end) for end in (".called", ".getattr"))


def test_a_namedtuple_with_other_fields_than_recorded_is_not_taken():
    leaves = [np.array(1, np.int64), np.array(2, np.int64)]
    got = codec.unflatten(("k", __name__, "Point", ("x", "z"), (("i",), ("i",))), leaves)
    assert type(got) is not Point and got._fields == ("x", "z") and got.z == 2


SAMPLES = [lambda: Point(1, 2.0), lambda: labelled(3), lambda: {"p": [Point(np.zeros(2), None)]},
           lambda: collections.namedtuple("R", "a def", rename=True)(1, 2), lambda: nested(2),
           lambda: nested(1, torch.jagged), lambda: torch.nested.nested_tensor([torch.ones(2, dtype=torch.bfloat16)])]


@pytest.mark.parametrize("make", SAMPLES, ids=range(len(SAMPLES)))
def test_every_namedtuple_and_nested_tensor_the_codec_writes_parses_back(make):
    treedef, _ = codec.flatten(make())
    assert structure.parse_treedef(codec.treedef_to_json(treedef), "here") == treedef


_T = ["t", "<f4", [2]]
BAD = {
    "module-not-dotted-names": ["k", "os;x", "P", ["a"], [["n"]]], "module-empty": ["k", "", "P", ["a"], [["n"]]],
    "qualname-space": ["k", "m", "P Q", ["a"], [["n"]]], "qualname-locals-last": ["k", "m", "f.<locals>", [], []],
    "field-keyword": ["k", "m", "P", ["class"], [["n"]]], "field-dunder": ["k", "m", "P", ["__class__"], [["n"]]],
    "field-code": ["k", "m", "P", ["a=print(1)"], [["n"]]], "field-repeated": ["k", "m", "P", ["a", "a"], [["n"], ["n"]]],
    "field-underscore": ["k", "m", "P", ["_x"], [["n"]]], "field-count": ["k", "m", "P", ["a", "b"], [["n"]]],
    "field-not-str": ["k", "m", "P", [1], [["n"]]], "name-too-long": ["k", "m" * 600, "P", [], []],
    "nested-layout": ["v", "sparse", "<f4", [_T]], "nested-not-tensors": ["v", "strided", "<f4", [["a", "<f4", [2]]]],
    "nested-dtype": ["v", "strided", "<f4", [["t", "<f8", [2]]]], "nested-dims": ["v", "strided", "<f4", [_T, ["t", "<f4", [2, 2]]]],
    "jagged-trailing": ["v", "jagged", "<f4", [["t", "<f4", [2, 3]], ["t", "<f4", [2, 4]]]],
    "nested-empty-dtype": ["v", "strided", "|O", []], "nested-fields": ["v", "strided", [_T]],
}


@pytest.mark.parametrize("name", list(BAD))
def test_a_malformed_namedtuple_or_nested_tensor_node_is_refused(name):
    with pytest.raises(MalformedFileError, match="^here"):
        structure.parse_treedef(BAD[name], "here")
