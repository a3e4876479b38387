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
import os
import pathlib
import sys
import types
from typing import Any, Iterator

import numpy as np

from cachestore.errors import FingerprintError
from cachestore.format import codec

from ..datapipes import identity_state, is_datapipe
from ..dataset import DatasetSource
from . import buffers, files, pipelines, reach, shared_state, taken
from .flat import FLAT, LENGTHS, PAIR_HEAD, SMALL_INTS, TAGS, TUPLE_TAG, flat

#: Nesting deeper than this is taken for a runaway structure, not dataset parameters.
MAX_DEPTH = 200
_HINT = ("give the cache an explicit identity instead: cache_setting={'fingerprint': "
         "'<a string you change whenever the data changes>'}")


def _source_hash(cls: type, paths: list[str] | None = None) -> str:
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
    if paths is not None:  # module-level values name data files too (``LABELS = "labels.csv"``)
        paths += hasher.walk.paths
    return hasher.h.hexdigest()[:16]


@contextlib.contextmanager
def _deep_code_refused(what: str) -> Iterator[None]:
    """A structure or a chain of calls too deep for Python's stack is a FingerprintError, not a crash."""
    try:
        yield
    except RecursionError:
        raise FingerprintError(f"cannot fingerprint the dataset: {what} nests or calls too deep to follow; "
                               f"{_HINT}") from None


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
        kind = type(obj)
        if kind in FLAT:  # what _digest computes, without a hasher of its own: a dict's keys and labels
            chunks: list[bytes] = []
            flat(obj, kind, chunks, self.walk.paths)
            return hashlib.sha256(b"".join(chunks)).digest()
        key = id(obj)
        if kind in _SCALARS or key in self._active:
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
        if kind is str:
            self.tag("str", obj)
            self.walk.paths.append(obj)  # it may name a data file (loader.cache.files)
        elif obj is None or kind in (bool, int):
            self.tag(kind.__name__, obj)
        elif kind is float:
            self.tag("float", obj.hex())
        elif kind is complex:
            self.tag("complex", obj.real.hex(), obj.imag.hex())
        elif kind in (bytes, bytearray):
            self.tag(kind.__name__, bytes(obj))
        elif isinstance(obj, (np.ndarray, np.generic)):
            buffers.feed_array(self, obj, where, depth)
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
            buffers.feed_tensor(self, obj, where, _HINT)
        elif isinstance(obj, pathlib.PurePath):  # by its path: its pickle splits it into parts
            self.tag("path", class_path(kind), str(obj))
            self.walk.paths.append(str(obj))
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
            self._items(obj, where, depth)
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
        elif pipelines.is_webdataset(obj) and (state := pipelines.identity_state(obj)) is not None:
            # Its shufflers' seeds are drawn anew each time it is built (loader.cache.pipelines).
            self.tag("webdataset")
            self.feed(kind, f"{where} class", depth + 1)
            self.feed(state, where, depth + 1, attributes=True)
        elif is_datapipe(obj):
            # What seeding, sharding and iterating it change is not its identity (loader.datapipes).
            self.tag("datapipe")
            self.feed(kind, f"{where} class", depth + 1)
            self.feed(identity_state(obj), where, depth + 1, attributes=True)
        else:
            self._reduced(obj, where, depth)

    def _items(self, items: list | tuple, where: str, depth: int) -> None:
        """The items of a list or tuple, as :meth:`feed` would hash each one. Plain scalars, and
        tuples of them (a sample list of paths and labels: a million of them), are written in few
        updates, the same bytes the per-item path writes; anything else goes through :meth:`feed`."""
        chunks: list[bytes] = []
        paths = self.walk.paths
        for i, item in enumerate(items):
            kind = type(item)
            if kind is tuple and len(item) == 2 and type(item[0]) is str and type(item[1]) is int:
                # The bytes of the general case below, written inline from bytes made once: a million
                # of these is the common large dataset, and building each one's tags took half its time.
                path, label = item
                data = path.encode("utf-8", "surrogatepass")
                tail = SMALL_INTS.get(label)
                if tail is None:
                    digits = str(label).encode()
                    tail = TAGS[int] + len(digits).to_bytes(8, "little") + digits
                size = len(data)
                chunks += (PAIR_HEAD, LENGTHS[size] if size <= 4096 else size.to_bytes(8, "little"), data, tail)
                paths.append(path)
            elif kind in FLAT:
                flat(item, kind, chunks, paths)
            elif kind is tuple and (len(item) == 2 and type(item[0]) in FLAT and type(item[1]) in FLAT
                                    or 0 < len(item) <= 8 and all(type(x) in FLAT for x in item)):
                digits = str(len(item)).encode()  # tag("tuple", n)
                chunks += (TUPLE_TAG, len(digits).to_bytes(8, "little"), digits)
                for x in item:
                    flat(x, type(x), chunks, paths)
            else:
                self.h.update(b"".join(chunks))
                chunks = []
                self.feed(item, f"{where}[{i}]", depth + 1)
        self.h.update(b"".join(chunks))

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
                 "\0".join(reach.const_repr(c) for c in code.co_consts))
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
        if isinstance(obj, os.PathLike):  # a path object of its own kind: hashed below, its file statted
            with contextlib.suppress(Exception):
                self.walk.paths.append(os.fsdecode(os.fspath(obj)))
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


def params_hash(params: Any, paths: list[str] | None = None) -> str:
    """sha256 (16 hex digits) of `params` by value; the strings that may name data files are added
    to `paths`, when given (:mod:`loader.cache.files`).

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
    if paths is not None:
        paths += hasher.walk.paths
    return hasher.h.hexdigest()[:16]


# --------------------------------------------------------------------- the fingerprint

#: The length a stream's fingerprint records: a stream's length is what its generation holds.
STREAM_LENGTH = -1


def dataset_fingerprint(dataset: DatasetSource, length: int, partition: tuple[int, int],
                        fingerprint: str | None = None) -> dict[str, object]:
    """The fingerprint recorded in (and checked against) a store.

    Covers the dataset's class, its keyword arguments by value (the class
    form) or its state by value (an instance: its attributes, recursively),
    its length, its class's source, the consumer partition this loader
    serves, and the data files it names by path, size and modification time
    (:mod:`loader.cache.files`).

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
        identity = dataset.memo["identity"] = _identity(dataset)
    fp = {"dataset": identity["dataset"], **{k: v for k, v in identity.items() if k.endswith("sha256")
                                             and k not in ("source_sha256", "files_sha256")},
          "length": int(length), "source_sha256": identity["source_sha256"], "partition": list(partition)}
    if "files" in identity:  # the data files it names, by path, size and modification time
        fp["files"], fp["files_sha256"] = identity["files"], identity["files_sha256"]
    return fp


def _identity(dataset: DatasetSource) -> dict[str, Any]:
    """What the fingerprint says of the dataset itself: class, state or parameters, code, data files."""
    identity: dict[str, Any] = {"dataset": class_path(dataset.dataset_class)}
    paths: list[str] = []
    if dataset.instance is not None:
        identity["state_sha256"] = state_hash(dataset.instance, paths)
    else:
        identity["params_sha256"] = params_hash(dataset.params, paths)
    identity["source_sha256"] = _source_hash(dataset.dataset_class, paths)
    named = files.files_identity(paths)
    if named is not None:
        identity["files"], identity["files_sha256"] = named
    if dataset.instance is not None and dataset.stream:  # what its own iteration changed: see taken
        identity = taken.recall(dataset.instance, identity)
    return identity


def state_hash(instance: object, paths: list[str] | None = None) -> str:
    """sha256 (16 hex digits) of a dataset instance's state by value (its attributes, recursively);
    the strings that may name data files are added to `paths`, when given (:mod:`loader.cache.files`).

    Raises
    ------
    FingerprintError
        Naming the attribute that cannot be hashed (``dataset.transform.lock``).
    """
    hasher = _ValueHasher()
    state: dict[str, Any] | None
    if is_datapipe(instance):
        state = identity_state(instance)
    elif pipelines.is_webdataset(instance):
        state = pipelines.identity_state(instance)
    else:
        state = getattr(instance, "__dict__", None)
    hasher.tag("instance", class_path(type(instance)))
    with _deep_code_refused("the dataset's state"):
        if isinstance(state, dict) and not dataclasses.is_dataclass(instance):
            hasher.feed(state, "dataset", attributes=True)  # named dataset.<attribute> in errors
        else:
            hasher.feed(instance, "dataset")
        reach.finish(hasher)
    if paths is not None:
        paths += hasher.walk.paths
    return hasher.h.hexdigest()[:16]
