"""Sample codec: a nested sample <-> a structure description plus flat buffers.

A sample is a tree of dict / list / tuple whose leaves are numpy arrays, torch
tensors, Python scalars, str, bytes or None. :func:`flatten` splits it into a
hashable *treedef* (containers, leaf kinds, dtypes, shapes) and a list of
contiguous numpy arrays, one per leaf that carries bytes. Two samples with
equal treedefs have leaves of identical sizes, which is what lets a backend
store them in a fixed-record, columnar layout.

Treedef nodes (nested tuples, so they hash and compare cheaply)::

    ("d", keys, children)   dict with str keys      ("l", children)  list
    ("u", children)         tuple                   ("n",)           None
    ("k", module, qualname, fields, children)       namedtuple (see :mod:`cachestore.format.named`)
    ("v", layout, dtype, children)                  nested torch tensor: its components ("t")
    ("a", dtype, shape)     numpy array             ("t", dtype, shape) torch tensor
    ("g", dtype)            numpy scalar            ("i",) ("f",) ("b",) int / float / bool
    ("s", n) ("y", n)       str (utf-8) / bytes of n bytes
    ("p", n)                pickled object (only with ``allow_pickle``)

The byte form of one sample (a *record*) is :mod:`cachestore.format.records`; a treedef read
back from a store is parsed by :func:`cachestore.format.structure.parse_treedef`. A pickled leaf
is loaded only where the caller says so (``allow_pickle``): unpickling runs code of whoever
wrote the bytes (docs/ARCHITECTURE.md, "Untrusted stores").
"""

from __future__ import annotations

import math
import pickle
import sys
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence, TypeAlias, Union, cast

import numpy as np
import numpy.typing as npt

from . import named
from ..errors import MalformedFileError, PickleRefusedError, UnsupportedSampleError

#: A sample (see above; with ``allow_pickle`` anything picklable): ``object``, since torch is
#: never imported here and pickle takes anything.
Sample: TypeAlias = object
#: A batch: samples stacked as :func:`cachestore.format.collate.stack_samples` stacks them.
Batch: TypeAlias = object
#: A treedef node (see above): its tag, then a dtype string, a size, a shape, keys or children.
TreeDef: TypeAlias = tuple[Union[str, int, tuple[int, ...], tuple[str, ...], tuple["TreeDef", ...]], ...]
#: One byte-carrying leaf of a flattened sample: a contiguous numpy array.
Leaf: TypeAlias = npt.NDArray[np.generic]
#: ``(dtype, shape)`` of a leaf.
LeafSpec: TypeAlias = tuple[np.dtype[np.generic], tuple[int, ...]]

#: The dtype name of a bfloat16 tensor's leaf (numpy has none: stored as int16).
BFLOAT16 = "bfloat16"


def _torch() -> ModuleType | None:
    """The torch module if the process already imported it (we never import it for the user)."""
    return sys.modules.get("torch")


def is_tensor(x: object) -> bool:
    """Whether `x` is a torch tensor (without importing torch when the process has not)."""
    torch = _torch()
    return torch is not None and isinstance(x, torch.Tensor)


def _tensor_to_numpy(x: Any) -> tuple[str, Leaf]:
    torch = cast(ModuleType, _torch())  # `x` is a tensor: torch is imported
    x = x.detach().cpu().contiguous()
    if x.dtype == torch.bfloat16:
        return BFLOAT16, x.view(torch.int16).numpy()
    try:
        arr = x.numpy()
    except (TypeError, RuntimeError) as exc:
        raise UnsupportedSampleError(f"torch tensors of dtype {x.dtype} cannot be stored: {exc}") from exc
    return arr.dtype.str, arr


def _tensor_dtype_name(x: Any) -> str:
    """The leaf dtype name of tensors of `x`'s dtype (an empty one tells it without any data)."""
    torch = cast(ModuleType, _torch())  # `x` is a tensor: torch is imported
    return _tensor_to_numpy(torch.empty(0, dtype=x.dtype))[0]


def _numpy_to_tensor(dtype: str, arr: Leaf) -> object:
    import torch

    if not arr.flags.writeable:
        arr = arr.copy()  # torch warns on read-only buffers and may write through them
    tensor = torch.from_numpy(arr)
    if dtype == BFLOAT16:
        tensor = tensor.view(torch.bfloat16)
    return tensor


def flatten(sample: Sample, allow_pickle: bool = False) -> tuple[TreeDef, list[Leaf]]:
    """Split `sample` into ``(treedef, leaves)``.

    Raises
    ------
    UnsupportedSampleError
        For a type the codec cannot store, unless `allow_pickle` is set.
    """
    leaves: list[Leaf] = []
    return _flatten(sample, leaves, allow_pickle), leaves


_PICKLE_HINT = ("open the store with allow_pickle=True (the loader: cache_setting={..., 'allow_pickle': True}) "
                "to store it with pickle")


def _pickled(x: object, leaves: list[Leaf], allow_pickle: bool, what: str) -> TreeDef:
    if not allow_pickle:
        if isinstance(x, (np.ndarray, np.generic)):
            # The type alone ("numpy.ndarray") does not say what is wrong: the dtype does.
            why, fix = (("object-dtype arrays hold references to Python objects, not raw numbers",
                         "convert it to a numeric dtype (e.g. np.asarray(x, dtype=np.float32))")
                        if x.dtype.hasobject else
                        ("structured (record) dtypes are not stored as raw buffers",
                         "store one array per field instead (a dict of arrays)"))
            raise UnsupportedSampleError(
                f"cannot store {what} of dtype {x.dtype} (shape {x.shape}) without pickle: {why}. "
                f"To cache it, {fix}, or {_PICKLE_HINT}"
            )
        raise UnsupportedSampleError(
            f"cannot store {what} of type {type(x).__module__}.{type(x).__qualname__}; "
            "supported: numpy arrays, torch tensors, dict/list/tuple, str, bytes, int, float, bool, None. "
            "Convert it, or " + _PICKLE_HINT
        )
    data = np.frombuffer(pickle.dumps(x, protocol=pickle.HIGHEST_PROTOCOL), dtype=np.uint8)
    leaves.append(data)
    return ("p", data.size)


def _tensor_node(x: Any, leaves: list[Leaf], allow_pickle: bool) -> TreeDef:
    layout = str(x.layout)
    if x.is_nested and layout in _NESTED_LAYOUTS:
        # No flat buffer of its own: its components, each a tensor leaf, made one again on reading.
        parts = tuple(_flatten(p, leaves, allow_pickle) for p in x.unbind())
        return ("v", layout[len("torch."):], _tensor_dtype_name(x), parts)
    if x.is_nested or layout != "torch.strided":
        # No flat buffer to store (sparse): pickled, which torch's own pickling supports.
        return _pickled(x, leaves, allow_pickle, "a sparse tensor")
    dtype, arr = _tensor_to_numpy(x)
    leaves.append(arr)
    return ("t", dtype, tuple(arr.shape))


def _flatten(x: object, leaves: list[Leaf], allow_pickle: bool) -> TreeDef:
    # Order matters: bool before int (bool is an int), np.generic before the builtins.
    if isinstance(x, np.ndarray):
        if x.dtype.hasobject or x.dtype.kind == "V":
            return _pickled(x, leaves, allow_pickle, "a numpy array")
        # np.ascontiguousarray would turn a 0-d array into shape (1,); 0-d arrays are contiguous anyway.
        arr = x if x.flags.c_contiguous else np.ascontiguousarray(x)
        leaves.append(arr)
        return ("a", arr.dtype.str, arr.shape)
    if is_tensor(x):
        return _tensor_node(x, leaves, allow_pickle)
    if isinstance(x, dict):
        if not all(type(k) is str for k in x):
            return _pickled(x, leaves, allow_pickle, "a dict with non-str keys")
        keys = tuple(x)
        return ("d", keys, tuple(_flatten(x[k], leaves, allow_pickle) for k in keys))
    if isinstance(x, (list, tuple)) and type(x) in (list, tuple):
        tag = "l" if type(x) is list else "u"
        return (tag, tuple(_flatten(v, leaves, allow_pickle) for v in x))
    if isinstance(x, tuple) and (name := named.describe(type(x), len(x))) is not None:
        return ("k", *name, tuple(_flatten(v, leaves, allow_pickle) for v in x))
    if x is None:
        return ("n",)
    if isinstance(x, np.generic):
        if x.dtype.hasobject or x.dtype.kind == "V":
            return _pickled(x, leaves, allow_pickle, "a numpy scalar")
        leaves.append(np.asarray(x))
        return ("g", x.dtype.str)
    if type(x) is bool:
        leaves.append(np.array(x, dtype=np.bool_))
        return ("b",)
    if type(x) is int:
        if -(2**63) <= x < 2**63:
            leaves.append(np.array(x, dtype=np.int64))
            return ("i",)
        return _pickled(x, leaves, allow_pickle, "an int beyond 64 bits")
    if type(x) is float:
        leaves.append(np.array(x, dtype=np.float64))
        return ("f",)
    if type(x) is str:
        data = np.frombuffer(x.encode("utf-8"), dtype=np.uint8)
        leaves.append(data)
        return ("s", data.size)
    if type(x) is bytes:
        data = np.frombuffer(x, dtype=np.uint8)
        leaves.append(data)
        return ("y", data.size)
    return _pickled(x, leaves, allow_pickle, "a value")


_SCALAR: dict[str, np.dtype[np.generic]] = {"i": np.dtype(np.int64), "f": np.dtype(np.float64), "b": np.dtype(np.bool_)}


#: Tags of the nodes that hold others: their children are always their last field.
CONTAINERS = ("d", "l", "u", "k", "v")
#: The layouts of nested tensors stored as their components (torch.strided, torch.jagged).
_NESTED_LAYOUTS = ("torch.strided", "torch.jagged")


# The fields of a node, as its tag says they are.
def children(node: TreeDef) -> tuple[TreeDef, ...]:
    """The child nodes of a container node (:data:`CONTAINERS`)."""
    return cast("tuple[TreeDef, ...]", node[-1])


def _keys(node: TreeDef) -> tuple[str, ...]:  # of a dict
    return cast("tuple[str, ...]", node[1])


def _shape(node: TreeDef) -> tuple[int, ...]:  # of an array or tensor
    return cast("tuple[int, ...]", node[2])


def leaf_specs(treedef: TreeDef) -> list[LeafSpec]:
    """``(dtype, shape)`` of every byte-carrying leaf of `treedef`, in leaf order."""
    out: list[LeafSpec] = []
    _specs(treedef, out)
    return out


def row_bytes(specs: Sequence[LeafSpec]) -> list[int]:
    """Bytes of one sample in each leaf's column: what a row of ``(dtype, shape)`` takes."""
    return [dtype.itemsize * math.prod(shape) for dtype, shape in specs]


def _specs(node: TreeDef, out: list[LeafSpec]) -> None:
    tag = node[0]
    if tag in CONTAINERS:
        for child in children(node):
            _specs(child, out)
    elif tag in ("a", "t"):
        dtype = np.dtype(np.int16) if node[1] == BFLOAT16 else np.dtype(cast(str, node[1]))
        out.append((dtype, tuple(_shape(node))))
    elif tag == "g":
        out.append((np.dtype(cast(str, node[1])), ()))
    elif tag in _SCALAR:
        out.append((_SCALAR[tag], ()))
    elif tag in ("s", "y", "p"):
        out.append((np.dtype(np.uint8), (cast(int, node[1]),)))


def unflatten(treedef: TreeDef, leaves: Sequence[Leaf], allow_pickle: bool = False) -> Sample:
    """Rebuild one sample from `treedef` and its leaves (inverse of :func:`flatten`).

    `allow_pickle` says the bytes are this program's own (or a trusted writer's): pickled leaves
    load, and a namedtuple's module may be imported to find its class (as pickle would); without
    it a namedtuple is rebuilt without running code of the store's choosing
    (:func:`cachestore.format.named.rebuild`).

    Raises
    ------
    PickleRefusedError
        A leaf is pickled and `allow_pickle` is not set: loading it would run whatever code its
        bytes name. Set it only for bytes this program's own code pickled, or a store whose
        writer the reader trusts.
    """
    it = iter(leaves)
    return _build(treedef, it, lambda node, leaf: _leaf_value(node, leaf, allow_pickle), allow_pickle)


def unflatten_batch(treedef: TreeDef, leaves: Sequence[Leaf]) -> Batch:
    """Rebuild a batch from a *sample* treedef and leaves stacked along axis 0.

    Arrays stay stacked (numpy as numpy, torch as torch); Python scalars become
    one numpy array per leaf; str, bytes, None and pickled leaves become lists;
    a namedtuple is one of batches.
    This is exactly what :func:`cachestore.format.collate.stack_samples` produces from
    the individual samples.
    """
    it = iter(leaves)
    return _build(treedef, it, _batch_value, False)


def _build(node: TreeDef, it: Iterator[Leaf], leaf_fn: Callable[[TreeDef, Leaf | None], object],
           trusted: bool) -> object:
    tag = node[0]
    if tag == "d":
        return {k: _build(c, it, leaf_fn, trusted) for k, c in zip(_keys(node), children(node))}
    if tag == "l":
        return [_build(c, it, leaf_fn, trusted) for c in children(node)]
    if tag == "u":
        return tuple(_build(c, it, leaf_fn, trusted) for c in children(node))
    if tag == "k":
        values = [_build(c, it, leaf_fn, trusted) for c in children(node)]
        return named.rebuild(cast(str, node[1]), cast(str, node[2]), cast("tuple[str, ...]", node[3]), values,
                             trusted)
    if tag == "v":
        if leaf_fn is _batch_value:
            raise TypeError("unflatten_batch: nested tensors are not stackable (is_stackable)")
        parts = [_build(c, it, leaf_fn, trusted) for c in children(node)]
        return _nested_tensor(cast(str, node[1]), cast(str, node[2]), parts)
    if tag == "n":
        return leaf_fn(node, None)
    return leaf_fn(node, next(it))


def _nested_tensor(layout: str, dtype: str, parts: list[object]) -> object:
    """A nested tensor of `parts` (tensors of `dtype`, torch's dtype given as the codec names it)."""
    import torch

    if not parts:  # no component to take the dtype from: an empty leaf of the dtype tells it
        kind = cast(Any, _numpy_to_tensor(dtype, np.empty(0, np.int16 if dtype == BFLOAT16 else np.dtype(dtype))))
        return torch.nested.nested_tensor([], dtype=kind.dtype, layout=getattr(torch, layout))
    try:
        return torch.nested.nested_tensor(parts, layout=getattr(torch, layout))
    except (RuntimeError, ValueError) as exc:  # components the parser let through and torch refuses
        raise MalformedFileError(f"a nested tensor's components cannot make one: {exc}") from None


def _leaf_value(node: TreeDef, leaf: Leaf | None, allow_pickle: bool) -> object:
    tag = node[0]
    if tag == "n":
        return None
    arr = cast("Leaf", leaf)  # every node but "n" has its leaf
    if tag == "a":
        return arr
    if tag == "t":
        return _numpy_to_tensor(cast(str, node[1]), arr)
    if tag == "g":
        return arr[()]
    if tag == "i":
        return int(arr)
    if tag == "f":
        return float(arr)
    if tag == "b":
        return bool(arr)
    if tag == "s":
        return arr.tobytes().decode("utf-8")
    if tag == "y":
        return arr.tobytes()
    if not allow_pickle:
        raise PickleRefusedError("the sample holds a pickled leaf, and allow_pickle is not set: loading it "
                                 "would run code of whoever wrote it")
    return pickle.loads(arr.tobytes())


def _batch_value(node: TreeDef, arr: Leaf | None) -> object:
    tag = node[0]
    if arr is not None and not arr.dtype.isnative:
        # Stacked as np.stack stacks (the default collate): in this machine's byte order, whichever
        # order the samples had, so a batch read back has the dtype of the batch first computed.
        arr = arr.astype(arr.dtype.newbyteorder("="))
    if tag in ("a", "g", "i", "f", "b"):
        return arr
    if tag == "t":
        return _numpy_to_tensor(cast(str, node[1]), cast("Leaf", arr))
    raise TypeError("unflatten_batch handles None/str/bytes leaves through lists")  # see stack path


def is_stackable(treedef: TreeDef) -> bool:
    """Whether a batch of this treedef can be gathered column-wise (no list leaves)."""
    tag = treedef[0]
    if tag in ("d", "l", "u", "k"):
        return all(is_stackable(c) for c in children(treedef))
    return tag in ("a", "t", "g", "i", "f", "b")


def treedef_to_json(node: TreeDef) -> list[object]:
    """A JSON-serialisable form of `node` (tuples become lists)."""
    tag = node[0]
    if tag == "d":
        return ["d", list(_keys(node)), [treedef_to_json(c) for c in children(node)]]
    if tag in ("l", "u"):
        return [tag, [treedef_to_json(c) for c in children(node)]]
    if tag == "k":
        fields = list(cast("tuple[str, ...]", node[3]))
        return ["k", node[1], node[2], fields, [treedef_to_json(c) for c in children(node)]]
    if tag == "v":
        return ["v", node[1], node[2], [treedef_to_json(c) for c in children(node)]]
    if tag in ("a", "t"):
        return [tag, node[1], list(_shape(node))]
    return list(node)


def leaf_bytes(leaf: Leaf) -> npt.NDArray[np.uint8]:
    """The bytes of a contiguous leaf as a flat uint8 view (no copy).

    Used instead of the leaf's own buffer: datetime64/timedelta64 arrays do
    not export one, and ``memoryview.cast`` refuses non-native byte orders.
    """
    return leaf.reshape(-1).view(np.uint8)
