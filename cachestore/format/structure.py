"""A sample's structure read back from a store: the strict parser of a treedef's JSON form.

The codec writes a structure (:func:`.codec.treedef_to_json`); whoever can write a store's files
can write any JSON there, so a structure read back (a record's, a schema, a manifest's) is parsed
node by node before anything is built from it: known tags, str keys once each, dtypes a store
holds, shapes and sizes in range, a bounded depth and number of nodes (docs/ARCHITECTURE.md,
"Untrusted stores"). A malformed node is a :class:`~cachestore.errors.MalformedFileError` naming
where it was read.
"""

from __future__ import annotations

import math
import warnings
from typing import Any, cast

import numpy as np

from ..errors import MalformedFileError
from ..guard.untrusted import MAX_DEPTH, MAX_LEAF_BYTES, integer_in, shown
from . import named
from .codec import BFLOAT16, TreeDef

#: Nodes of one sample's structure, and dimensions of one array.
MAX_NODES = 1 << 18
MAX_DIMS = 32
#: Array dtype kinds a store holds (bool, ints, floats, complex, datetimes, fixed bytes and text);
#: never objects (references, which the codec pickles instead) or records.
DTYPE_KINDS = "biufcmMSU"
#: What a tensor leaf holds: numbers in this machine's byte order (as torch hands them to numpy).
TENSOR_KINDS = "biufc"


def parse_dtype(text: object, where: str) -> np.dtype[np.generic]:
    """The numpy dtype a leaf's structure names: plain numbers, dates, fixed bytes or text."""
    if not isinstance(text, str) or len(text) > 32:
        raise MalformedFileError(f"{where}: dtype {shown(text)} is not a dtype string")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # a deprecated spelling is no dtype the codec writes
            dtype = np.dtype(text)
    except (TypeError, ValueError, SyntaxError, Warning):
        raise MalformedFileError(f"{where}: dtype {shown(text)} is not a numpy dtype") from None
    if dtype.kind not in DTYPE_KINDS or dtype.hasobject or dtype.fields is not None or dtype.subdtype is not None \
            or dtype.itemsize < 1:
        raise MalformedFileError(f"{where}: dtype {text!r} is not one a store holds (numbers, dates, bytes, text)")
    return dtype


def parse_shape(obj: object, itemsize: int, where: str) -> tuple[int, ...]:
    """An array shape: a list of at most :data:`MAX_DIMS` sizes >= 0, one leaf at most
    :data:`MAX_LEAF_BYTES` bytes."""
    if not isinstance(obj, list) or len(obj) > MAX_DIMS or \
            not all(type(d) is int and 0 <= d <= MAX_LEAF_BYTES for d in obj):
        raise MalformedFileError(f"{where}: shape {shown(obj)} is not a list of sizes >= 0")
    if math.prod(obj) * itemsize > MAX_LEAF_BYTES:
        raise MalformedFileError(f"{where}: shape {obj} takes more than {MAX_LEAF_BYTES} bytes")
    return tuple(obj)


def parse_treedef(obj: object, where: str) -> TreeDef:
    """A sample structure (see :mod:`cachestore.format.codec`) from its JSON form, every node checked:
    known tags, str keys once each, dtypes a store holds, shapes and sizes in range, at most
    :data:`MAX_DEPTH` deep and :data:`MAX_NODES` nodes."""
    budget = [MAX_NODES]
    return _node(obj, where, 1, budget)


def _node(obj: object, where: str, depth: int, budget: list[int]) -> TreeDef:
    budget[0] -= 1
    if depth > MAX_DEPTH or budget[0] < 0:
        raise MalformedFileError(f"{where}: the sample structure is larger or deeper than a store writes")
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise MalformedFileError(f"{where}: {shown(obj)} is not a node of a sample structure")
    tag, rest = obj[0], obj[1:]
    if tag == "d" and len(rest) == 2 and isinstance(rest[0], list) and isinstance(rest[1], list):
        keys, children = rest
        if len(keys) != len(children) or not all(isinstance(k, str) for k in keys) or len(set(keys)) != len(keys):
            raise MalformedFileError(f"{where}: a dict node's keys are not distinct strings, one per child")
        return ("d", tuple(keys), tuple(_node(c, where, depth + 1, budget) for c in children))
    if tag in ("l", "u") and len(rest) == 1 and isinstance(rest[0], list):
        return (tag, tuple(_node(c, where, depth + 1, budget) for c in rest[0]))
    if tag == "k" and len(rest) == 4 and isinstance(rest[2], list) and isinstance(rest[3], list):
        return _namedtuple(rest, where, depth, budget)
    if tag == "v" and len(rest) == 3 and isinstance(rest[2], list):
        return _nested_tensor(rest, where, depth, budget)
    if tag in ("a", "t") and len(rest) == 2:
        if tag == "t" and rest[0] == BFLOAT16:
            return (tag, BFLOAT16, parse_shape(rest[1], 2, where))
        dtype = parse_dtype(rest[0], where)
        if tag == "t" and (dtype.kind not in TENSOR_KINDS or not dtype.isnative):
            raise MalformedFileError(f"{where}: a tensor of dtype {rest[0]!r}, which no tensor has")
        return (tag, str(rest[0]), parse_shape(rest[1], dtype.itemsize, where))
    if tag == "g" and len(rest) == 1:
        parse_dtype(rest[0], where)
        return (tag, str(rest[0]))
    if tag in ("n", "i", "f", "b") and not rest:
        return (tag,)
    if tag in ("s", "y", "p") and len(rest) == 1:
        return (tag, integer_in(rest[0], where, f"size of a {tag!r} leaf"))
    raise MalformedFileError(f"{where}: {shown(obj)} is not a node of a sample structure")


def _namedtuple(rest: list[Any], where: str, depth: int, budget: list[int]) -> TreeDef:
    """A namedtuple node: names a reader may look up and ``collections.namedtuple`` may compile
    (:func:`cachestore.format.named.valid`), one field per child."""
    module, qualname, fields, kids = rest
    if not isinstance(module, str) or not isinstance(qualname, str) or len(fields) != len(kids) \
            or not named.valid(module, qualname, fields):
        raise MalformedFileError(f"{where}: a namedtuple node whose names are not a class's and its fields'")
    return ("k", module, qualname, tuple(fields), tuple(_node(c, where, depth + 1, budget) for c in kids))


def _nested_tensor(rest: list[Any], where: str, depth: int, budget: list[int]) -> TreeDef:
    """A nested tensor node: a layout torch has, and components that are tensors of its dtype and
    one number of dimensions (a jagged one's differ in their first only), as the codec writes them."""
    layout, dtype, kids = rest
    parts = [_node(c, where, depth + 1, budget) for c in kids]
    shapes = [cast("tuple[int, ...]", p[2]) for p in parts if p[0] == "t" and p[1] == dtype]
    if layout not in ("strided", "jagged") or len(shapes) != len(parts) or len({len(s) for s in shapes}) > 1 \
            or (layout == "jagged" and (not shapes or not shapes[0] or len({s[1:] for s in shapes}) > 1)):
        raise MalformedFileError(f"{where}: a nested tensor node that is none the codec writes")
    if not parts:
        _node(["t", dtype, [0]], where, depth + 1, budget)  # its dtype is one a tensor has
    return ("v", layout, dtype, tuple(parts))
