"""What identifies the producer of cached samples, so a cache is never reused stale.

The dataset parameters are hashed **by value**: arrays by dtype, shape and
bytes, containers and scalars recursively, other objects by what pickle would
save of them (``__reduce_ex__``: their class and ``__dict__``/``__getstate__``),
dataclasses by their fields, torch tensors by dtype, shape and bytes, functions
and classes with what their code reaches (:mod:`loader.cache.reach`: the
module-level values and helper functions they use, wherever they live). Why not
``repr()``: numpy elides the middle of large arrays and objects with the
default repr show only their class, so a changed table or a changed
transform object used to give the same fingerprint and the old samples were
served. multiprocessing's locks, events and shared values are the workers'
means to coordinate, not data: they are hashed by what they are
(:mod:`loader.cache.shared_state`), never by their current value; a running
``unittest.TestCase`` (a dataset that asserts through the test that made it, as
torch's own tests do) is the test harness, not data: by its class and test name.
What cannot be hashed by value (an open file, a thread's lock, a generator) is
an error asking for an explicit identity (``fingerprint=`` below, the loader's
``cache_setting["fingerprint"]``).
"""

from __future__ import annotations

import contextlib
import copyreg
import dataclasses
import enum
import hashlib
import inspect
import json
import re
import sys
import types
from typing import Any, Iterator

import numpy as np

from cachestore import codec
from cachestore.errors import FingerprintError

from ..datapipes import identity_state, is_datapipe
from ..dataset import DatasetSource
from . import reach, shared_state, taken

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")
#: Nesting deeper than this is taken for a runaway structure, not dataset parameters.
MAX_DEPTH = 200
_HINT = ("give the cache an explicit identity instead: cache_setting={'fingerprint': "
         "'<a string you change whenever the data changes>'}")


def _stable_json(obj: Any) -> str:
    # repr() of arbitrary objects embeds their address, which changes every run.
    return json.dumps(obj, sort_keys=True, default=lambda o: _ADDRESS.sub("", repr(o)))


def _source_hash(cls: type) -> str:
    """Hash of the code that defines `cls`: its module's source (else the class's own source: a
    class typed into ``python -``, an interactive session or a notebook cell has none), and what its
    methods reach (:mod:`loader.cache.reach`: the functions, classes and module-level values they
    use, in its module and in others)."""
    hasher = _ValueHasher()
    source = ""
    for target in (sys.modules.get(cls.__module__), cls):
        if target is None:
            continue
        try:
            source = inspect.getsource(target)
            break
        except (OSError, TypeError):
            continue
    hasher.tag("source", source)
    with _deep_code_refused(f"the code of {class_path(cls)}"):
        reach.feed_class(hasher, cls)
        reach.finish(hasher)
    return hasher.h.hexdigest()[:16]


@contextlib.contextmanager
def _deep_code_refused(what: str) -> Iterator[None]:
    """A structure or a chain of calls too deep for Python's stack is a FingerprintError, not a crash."""
    try:
        yield
    except RecursionError:
        raise FingerprintError(f"cannot fingerprint the dataset: {what} nests or calls too deep to follow; "
                               f"{_HINT}") from None


def _const_repr(const: object) -> str:
    """A code constant in words, the same in every run: ``x in {"a", "b"}`` keeps a frozenset, whose
    repr orders strings by their hash, which changes from run to run."""
    if isinstance(const, types.CodeType):
        return "<code>"
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(map(_const_repr, const))) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(map(_const_repr, const)) + ",)"
    return f"{type(const).__name__}:{const!r}"


#: Values hashed where they stand, never remembered by id (cheap, and ids of ints are reused).
_SCALARS = (type(None), bool, int, float, complex, str, bytes)


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


# --------------------------------------------------------------------- hashing by value

class _ValueHasher:
    """Feeds a canonical byte stream of a value into sha256 (see the module docstring).

    Every item starts with a type tag, so ``1``, ``1.0``, ``True``, ``"1"`` and
    ``[1]`` all differ; dicts and sets are order-independent (as their equality is).
    """

    def __init__(self, walk: reach.Walk | None = None) -> None:
        self.h = hashlib.sha256()
        # Shared with the hashers of its parts: values being hashed (to cut cycles; shared, acyclic
        # references are hashed in full each time: an ordinal would depend on the order dict items are
        # seen) and the code reached by name (hashed once each, at the end: reach.finish).
        self.walk = reach.Walk() if walk is None else walk
        self._active = self.walk.active

    def sub(self) -> _ValueHasher:
        """A hasher for a part whose digest this one takes, in the same walk (cycles, code reached)."""
        return _ValueHasher(self.walk)

    def tag(self, *parts: Any) -> None:
        chunks: list[bytes] = []  # one update per tag: the hot path of hashing code
        for part in parts:
            data = part if isinstance(part, bytes) else str(part).encode("utf-8", "surrogatepass")
            chunks += (len(data).to_bytes(8, "little"), data)
        self.h.update(b"".join(chunks))

    def digest_of(self, obj: Any, where: str, depth: int) -> bytes:
        """The digest of `obj` as a part, computed once per value and walk.

        A value reached again (shared by several attributes, as a config, a registry or a test
        case is) reuses its digest: walked once per path through it, a graph of shared references
        costs exponential time (a dataset holding a ``unittest.TestCase`` reaches pytest's whole
        session, and its fingerprint never finished). An acyclic value's digest is the same
        whichever path reaches it. One inside a cycle records where the cycle closed (a distance
        up the path first taken): still a digest of everything it reaches, so a changed value
        still changes the fingerprint, but equal cyclic structures built in another order may
        hash apart (a cache computed once more, never a stale one served).
        """
        key = id(obj)
        if type(obj) in _SCALARS or key in self._active:
            return self._digest(obj, where, depth)  # cheap, or a cycle: tagged where it closes
        known = self.walk.digests.get(key)
        if known is None:
            # The value is kept with its digest: while it lives, its id names no other value.
            known = self.walk.digests[key] = (obj, self._digest(obj, where, depth))
        return known[1]

    def _digest(self, obj: Any, where: str, depth: int) -> bytes:
        sub = self.sub()
        sub.feed(obj, where, depth)
        return sub.h.digest()

    def feed(self, obj: Any, where: str, depth: int = 0, attributes: bool = False) -> None:
        """Hash `obj`; `where` names it in errors (``dataset.transform.fn``); `attributes`: a dict
        of an object's attributes, whose keys read as ``.name`` there."""
        if depth > MAX_DEPTH:
            raise FingerprintError(f"cannot fingerprint the dataset: {where} is nested more than "
                                   f"{MAX_DEPTH} levels deep; {_HINT}")
        kind = type(obj)
        if obj is None or kind in (bool, int, str):
            self.tag(kind.__name__, obj)
        elif kind is float:
            self.tag("float", obj.hex())
        elif kind is complex:
            self.tag("complex", obj.real.hex(), obj.imag.hex())
        elif kind in (bytes, bytearray):
            self.tag(kind.__name__, bytes(obj))
        elif isinstance(obj, (np.ndarray, np.generic)):
            self._array(obj, where, depth)
        elif isinstance(obj, np.dtype):
            self.tag("dtype", np.lib.format.dtype_to_descr(obj))
        elif isinstance(obj, enum.Enum):
            self.tag("enum", class_path(kind), obj.name)
        elif isinstance(obj, type):
            reach.feed_class(self, obj)
        elif isinstance(obj, types.ModuleType):
            reach.feed_module(self, obj, None, where)
        elif isinstance(obj, np.ufunc):  # pickled by name (through copyreg)
            self.tag("ufunc", obj.__name__, reach.installed_version(np.__name__))
        elif codec.is_tensor(obj):
            self._tensor(obj, where)
        elif id(obj) in self._active:
            self.tag("cycle", depth - self._active[id(obj)])  # how far up: the same for equal values
        else:
            self._active[id(obj)] = depth
            try:
                self._compound(obj, where, depth, attributes)
            finally:
                del self._active[id(obj)]

    def _compound(self, obj: Any, where: str, depth: int, attributes: bool = False) -> None:
        kind = type(obj)
        if kind in (list, tuple):
            self.tag(kind.__name__, len(obj))
            for i, item in enumerate(obj):
                self.feed(item, f"{where}[{i}]", depth + 1)
        elif isinstance(obj, dict):
            self.tag("dict", class_path(kind), len(obj))

            def named(key: object) -> str:
                return f"{where}.{key}" if attributes and isinstance(key, str) else f"{where}[{key!r}]"

            items = sorted((self.digest_of(k, f"{where} key {k!r}", depth + 1),
                            self.digest_of(v, named(k), depth + 1)) for k, v in obj.items())
            for key, value in items:
                self.tag(key, value)
        elif kind in (set, frozenset):
            self.tag(kind.__name__, len(obj))
            for item in sorted(self.digest_of(x, f"{where} item", depth + 1) for x in obj):
                self.tag(item)
        elif dataclasses.is_dataclass(obj):
            self.tag("dataclass", class_path(kind))
            for f in dataclasses.fields(obj):
                self.tag(f.name)
                self.feed(getattr(obj, f.name), f"{where}.{f.name}", depth + 1)
        elif isinstance(obj, (types.FunctionType, types.BuiltinFunctionType, types.MethodType)):
            self._function(obj, where, depth)
        elif is_datapipe(obj):
            # What seeding, sharding and iterating it change is not its identity (loader.datapipes).
            self.tag("datapipe")
            self.feed(kind, f"{where} class", depth + 1)
            self.feed(identity_state(obj), where, depth + 1, attributes=True)
        else:
            self._reduced(obj, where, depth)

    def _array(self, obj: Any, where: str, depth: int) -> None:
        arr = np.asarray(obj)
        self.tag("ndarray" if isinstance(obj, np.ndarray) else "npscalar",
                 np.lib.format.dtype_to_descr(arr.dtype), arr.shape)
        if arr.dtype.hasobject:
            for i, item in enumerate(arr.ravel().tolist()):
                self.feed(item, f"{where}.flat[{i}]", depth + 1)
        else:
            self.h.update(np.ascontiguousarray(arr).view(np.uint8).data)

    def _tensor(self, obj: Any, where: str) -> None:
        import torch  # already imported: codec.is_tensor found it in sys.modules

        t = obj.detach()
        if t.is_nested:  # no flat buffer of its own (sizes() is refused): its components, in order
            parts = t.unbind()
            self.tag("nested tensor", str(t.layout), str(t.dtype), len(parts))
            for i, part in enumerate(parts):
                self._tensor(part, f"{where}[{i}]")
            return
        if t.layout != torch.strided:
            t = t.to_dense()
        t = t.cpu().contiguous()
        self.tag("tensor", str(t.dtype), tuple(t.shape))
        try:
            raw = t.reshape(-1).view(torch.uint8).numpy()
        except (RuntimeError, TypeError) as exc:
            raise FingerprintError(f"cannot fingerprint the dataset parameters: {where} is a tensor of "
                                   f"{t.dtype} whose bytes cannot be read ({exc}); {_HINT}") from exc
        self.h.update(memoryview(raw).cast("B"))

    def _function(self, obj: Any, where: str, depth: int) -> None:
        if isinstance(obj, types.MethodType):
            self.tag("method")
            self.feed(obj.__self__, f"{where}.__self__", depth + 1)
            self.feed(obj.__func__, f"{where}.__func__", depth + 1)
            return
        reach.feed_function(self, obj, where, depth)

    def code(self, code: types.CodeType) -> None:
        """Bytecode, names and constants: not the file name or line numbers (a line added above moves them)."""
        nested = [c for c in code.co_consts if isinstance(c, types.CodeType)]
        self.tag("code", code.co_code, "\0".join(code.co_names), "\0".join(code.co_varnames),
                 "\0".join(_const_repr(c) for c in code.co_consts))
        for const in nested:
            self.code(const)

    def _reduced(self, obj: Any, where: str, depth: int) -> None:
        kind = type(obj)
        shared = shared_state.identity(obj)
        if shared is not None:  # coordination between workers, not content: by what it is, not its value
            self.tag("shared state", *shared)
            return
        test = _test_case(obj)
        if test is not None:
            self.tag("test case", *test)
            return
        # As pickle does: a reducer registered with copyreg (re.Pattern, numpy's ufuncs) comes first.
        reducer = copyreg.dispatch_table.get(kind)
        try:
            reduced = reducer(obj) if reducer is not None else obj.__reduce_ex__(4)
        except Exception as exc:  # objects refuse pickling with many exception types
            raise FingerprintError(
                f"cannot fingerprint the dataset by value: {where} is a {class_path(kind)}, "
                f"which has no stable serialisation ({type(exc).__name__}: {exc}); {_HINT}") from exc
        self.tag("object", class_path(kind))
        if isinstance(reduced, str):  # a module-level singleton, pickled by name
            self.tag("global", reduced)
            return
        func, args, *rest = tuple(reduced) + (None,) * (5 - len(reduced))
        self.feed(func, f"{where} constructor", depth + 1)
        self.feed(args, f"{where} arguments", depth + 1)
        state, listitems, dictitems = rest[:3]
        self.feed(state, where, depth + 1, attributes=True)
        self.feed(list(listitems) if listitems is not None else None, f"{where} items", depth + 1)
        self.feed(dict(dictitems) if dictitems is not None else None, f"{where} items", depth + 1)


def _test_case(obj: Any) -> tuple[str, str] | None:
    """A running ``unittest.TestCase``'s identity: its class and test. Its state is the test runner's
    (the outcome so far, the runner's streams and locks, which pickle refuses) and changes as the test
    runs; what a dataset does with it (assertions in ``__getitem__``) is code, hashed as the dataset's."""
    unittest = sys.modules.get("unittest")  # no test case exists where unittest was never imported
    if unittest is None or not isinstance(obj, unittest.TestCase):
        return None
    return class_path(type(obj)), str(obj.id())  # the test's dotted name


def params_hash(params: Any) -> str:
    """sha256 (16 hex digits) of `params` by value.

    Raises
    ------
    FingerprintError
        Some part of `params` cannot be hashed by value; the message names it
        (``params['loader'].file``) and asks for an explicit fingerprint.
    """
    hasher = _ValueHasher()
    with _deep_code_refused("the dataset parameters"):
        hasher.feed(params, "params")
        reach.finish(hasher)
    return hasher.h.hexdigest()[:16]


# --------------------------------------------------------------------- the fingerprint

#: The length a stream's fingerprint records: a stream's length is what its generation holds.
STREAM_LENGTH = -1


def dataset_fingerprint(dataset: DatasetSource, length: int, partition: tuple[int, int],
                        fingerprint: str | None = None) -> dict[str, object]:
    """The fingerprint recorded in (and checked against) a store.

    Covers the dataset's class, its keyword arguments by value (the class
    form) or its state by value (an instance: its attributes, recursively),
    its length, its class's source, and the consumer partition this loader
    serves.

    Parameters
    ----------
    dataset
        The class and its keyword arguments, or the instance.
    length
        Number of samples.
    partition
        ``(consumer_index, nb_consumer)``.
    fingerprint
        A user string that replaces the computed identity (class, parameters
        or state, source), for datasets whose identity the user knows better,
        or that cannot be hashed by value. Length and partition stay: they
        shape the cache whatever the data is.

    Raises
    ------
    FingerprintError
        Part of the dataset cannot be hashed by value (the message names it, e.g.
        ``dataset.transform.transforms[2].fn``) and no `fingerprint` was given.
    """
    if dataset.stream:
        length = STREAM_LENGTH  # a stream's generations hold what it yielded, whatever the loader knew of it
    if fingerprint is not None:
        if not isinstance(fingerprint, str) or not fingerprint:
            raise TypeError(f"an explicit fingerprint must be a non-empty string, got {fingerprint!r}")
        return {"fingerprint": fingerprint, "length": int(length), "partition": list(partition)}
    identity = dataset.memo.get("identity")
    if not isinstance(identity, dict):  # once per loader: hashing a large instance takes a while
        identity = {"dataset": class_path(dataset.dataset_class)}
        if dataset.instance is not None:
            identity["state_sha256"] = state_hash(dataset.instance)
        else:
            identity["params_sha256"] = params_hash(dataset.params)
        identity["source_sha256"] = _source_hash(dataset.dataset_class)
        if dataset.instance is not None and dataset.stream:  # what its own iteration changed: see taken
            identity = taken.recall(dataset.instance, identity)
        dataset.memo["identity"] = identity
    return {"dataset": identity["dataset"], **{k: v for k, v in identity.items() if k.endswith("sha256")
                                               and k != "source_sha256"},
            "length": int(length), "source_sha256": identity["source_sha256"], "partition": list(partition)}


def state_hash(instance: object) -> str:
    """sha256 (16 hex digits) of a dataset instance's state by value (its attributes, recursively).

    Raises
    ------
    FingerprintError
        Naming the attribute that cannot be hashed (``dataset.transform.lock``).
    """
    hasher = _ValueHasher()
    state = identity_state(instance) if is_datapipe(instance) else getattr(instance, "__dict__", None)
    hasher.tag("instance", class_path(type(instance)))
    with _deep_code_refused("the dataset's state"):
        if isinstance(state, dict) and not dataclasses.is_dataclass(instance):
            hasher.feed(state, "dataset", attributes=True)  # named dataset.<attribute> in errors
        else:
            hasher.feed(instance, "dataset")
        reach.finish(hasher)
    return hasher.h.hexdigest()[:16]


#: What each fingerprint key means, for messages; values worth showing are shown.
_PARTS = {
    "fingerprint": ("the explicit fingerprint (cache_setting['fingerprint'])", True),
    "dataset": ("the dataset class", True),
    "params_sha256": ("the dataset parameters", False),
    "state_sha256": ("the dataset's state (its attributes, or what its functions use)", False),
    "length": ("the length", True),
    "source_sha256": ("the dataset's code (its class's source, or what its methods use)", False),
    "partition": ("the partition [consumer_index, nb_consumer]", True),
}


def describe_mismatch(stored: dict | None, requested: dict | None) -> str:
    """Which parts of two fingerprints differ, in words, for an error message.

    Examples
    --------
    >>> describe_mismatch({"dataset": "a.A", "length": 10}, {"dataset": "a.A", "length": 12})
    'the length changed (stored 10, now 12)'
    """
    if not isinstance(stored, dict) or not isinstance(requested, dict):
        return "the store records no fingerprint to compare" if not isinstance(stored, dict) else "no fingerprint given"
    changes = []
    explicit = ("fingerprint" in stored, "fingerprint" in requested)
    if explicit[0] != explicit[1]:
        changes.append("the store was written with an explicit cache_setting['fingerprint'] and this run has none"
                       if explicit[0] else "this run gives an explicit cache_setting['fingerprint'], "
                                           "the store was written without one")
    keys = [k for k in _PARTS if k in stored or k in requested]
    keys += sorted(k for k in set(stored) | set(requested) if k not in _PARTS)
    for key in keys:
        if explicit[0] != explicit[1] and key in ("fingerprint", "dataset", "params_sha256", "source_sha256"):
            continue  # one side has no such part: already said above
        if stored.get(key) != requested.get(key):
            label, show = _PARTS.get(key, (f"{key!r}", True))
            detail = f" (stored {stored.get(key)!r}, now {requested.get(key)!r})" if show else ""
            changes.append(f"{label} changed{detail}")
    return "; ".join(changes) if changes else "nothing differs"


def describe_params(params: dict) -> Any:
    """JSON-safe description of the dataset's keyword arguments (for ``cachestore inspect``)."""
    return json.loads(_stable_json(params))
