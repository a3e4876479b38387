"""The parity suite's dataset and collate functions (importable by module path: workers spawn).

A *spec* is plain data (JSON-able): ``{"seed": int, "root": node}``, where a node is one of

==========================================  =====================================================
``{"k": "dict", "items": [[key, node]]}``   a dict (str keys, in this order)
``{"k": "list" | "tuple", "items": [...]}``  a list or tuple of a fixed length
``{"k": "namedtuple", "items": [...]}``      a namedtuple (:data:`NAMEDTUPLES`, by its length)
``{"k": "array", "dtype": ">f4", ...}``      a numpy array: ``shape``, ``vary`` (per axis: the
                                             axis grows by ``(index + axis) % (vary + 1)``, so 0
                                             is a fixed axis), ``layout`` ``"C"``, ``"F"`` or
                                             ``"rev"`` (a reversed view along axis 0)
``{"k": "npscalar", "dtype": "<i8"}``        a numpy scalar
``{"k": "str" | "bytes", "len": n,           a str or bytes of ``n`` (+ ``index % (vary + 1)``)
``"vary": v}``                               characters
``{"k": "int" | "float" | "bool" | "none"}`` a Python int, float, bool, or None
==========================================  =====================================================

``build(spec, index)`` is a deterministic function of its arguments: every
process that builds sample ``index`` gets the same values, bit for bit. The
structure (containers, keys, leaf kinds, dtypes) is the same for every
index; only the shapes of varying leaves and the values change. Numeric
values are random bit patterns (NaNs with payloads, infinities, subnormals,
-0.0 included), so a comparison of bytes also checks that nothing was
converted on the way.
"""

from __future__ import annotations

import collections
from typing import Any, Sequence

import numpy as np

#: The namedtuple classes of "namedtuple" nodes, by their number of fields (module-level: found
#: by name in every process, as a reader of a store finds them).
Fields0 = collections.namedtuple("Fields0", [])
Fields1 = collections.namedtuple("Fields1", ["a"])
Fields2 = collections.namedtuple("Fields2", ["a", "b"])
Fields3 = collections.namedtuple("Fields3", ["a", "b", "c"])
NAMEDTUPLES = [Fields0, Fields1, Fields2, Fields3]

# Code points a str leaf draws from: ASCII (NUL included), Latin-1, CJK and astral-plane
# characters, so a str that is not 1 byte per character in UTF-8 round-trips too.
_CHARS = "a Z0\x00\t~\xe9\xff\u4e2d\u00df\U0001f600\U00010348"


class ParityDataset:
    """Sample ``i`` is ``build(spec, i)``; ``n`` samples."""

    def __init__(self, spec: dict[str, Any], n: int) -> None:
        self.spec = spec
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        if not 0 <= index < self.n:
            raise IndexError(index)
        return build(self.spec, index)


def build(spec: dict[str, Any], index: int) -> Any:
    """Sample `index` of `spec` (see the module docstring)."""
    rng = np.random.default_rng([spec["seed"], index])
    return _node(spec["root"], index, rng)


def shape_of(node: dict[str, Any], index: int) -> tuple[int, ...]:
    """The shape of array `node` in sample `index`."""
    return tuple(d + (index + axis) % (v + 1) for axis, (d, v) in enumerate(zip(node["shape"], node["vary"])))


def _node(node: dict[str, Any], index: int, rng: np.random.Generator) -> Any:
    kind = node["k"]
    if kind == "dict":
        return {key: _node(child, index, rng) for key, child in node["items"]}
    if kind == "list":
        return [_node(child, index, rng) for child in node["items"]]
    if kind == "tuple":
        return tuple(_node(child, index, rng) for child in node["items"])
    if kind == "namedtuple":
        return NAMEDTUPLES[len(node["items"])](*(_node(child, index, rng) for child in node["items"]))
    if kind == "array":
        arr = _values(np.dtype(node["dtype"]), shape_of(node, index), rng)
        if node["layout"] == "F":
            arr = np.asfortranarray(arr)
        elif node["layout"] == "rev" and arr.ndim:
            arr = arr[::-1]
        return arr
    if kind == "npscalar":
        return _values(np.dtype(node["dtype"]), (), rng)[()]
    if kind == "int":
        # Half the time a small value, else anywhere in the int64 range (the extremes included).
        if rng.integers(2):
            return int(rng.integers(-3, 4))
        return int(rng.integers(-(2**63), 2**63, dtype=np.int64, endpoint=False))
    if kind == "float":
        return float(np.frombuffer(rng.bytes(8), dtype=np.float64)[0])
    if kind == "bool":
        return bool(rng.integers(2))
    if kind == "none":
        return None
    length = node["len"] + index % (node["vary"] + 1)
    if kind == "str":
        return "".join(_CHARS[int(c)] for c in rng.integers(len(_CHARS), size=length))
    if kind == "bytes":
        return rng.bytes(length)
    raise ValueError(f"unknown node kind {kind!r}")


def _values(dtype: np.dtype[Any], shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    """A new, writable array of random bit patterns (bools: 0 or 1 only)."""
    count = int(np.prod(shape, dtype=np.int64))
    if dtype.kind == "b":
        return np.asarray(rng.integers(2, size=shape)).astype(dtype)
    return np.frombuffer(rng.bytes(count * dtype.itemsize), dtype=dtype).reshape(shape).copy()


# ----------------------------------------------------------------------------- collate functions
def collate_list(samples: Sequence[Any]) -> list[Any]:
    """The samples of the batch, as a list (a collate that keeps every sample whole)."""
    return list(samples)


def collate_batch_level(samples: Sequence[Any]) -> dict[str, Any]:
    """A batch-level collate: what it returns depends on the whole batch (its length)."""
    return {"n": len(samples), "samples": list(samples)}
