"""What the dataset's code reaches, for the fingerprint: the functions, classes and module-level
values its functions use.

A function's own code is not all that decides what it returns: ``x * SCALE`` reads a module-level
constant, ``helpers.normalize(x)`` runs code in another module. cloudpickle, when it sends a
function by value, sends with it the globals its code names (``co_names``, nested code included)
and the closure; the fingerprint follows the same edges, recursively, so that ``SCALE = 2.0`` ->
``3.0`` in the training script, or an edited helper in another module, is another dataset:

- a function of **user code** (a module outside the standard library and site-packages:
  the training script, the project's own modules, a notebook) is hashed by its code, defaults,
  closure and the globals its code names, each by value; a user module it names
  (``helpers.normalize``) by the attributes the code names in it;
- a class of user code by its attributes and methods (each method as above) and its bases;
- **installed code** (the standard library, site-packages, builtins) by name and version (its
  values - a closure, defaults, a bound ``__self__`` - still by value): hashing numpy's code would
  be slow, and a new numpy version is a new fingerprint anyway.

Each function or class is hashed once per fingerprint, from a work list (the call graph of a
project has shared parts, cycles and long chains). A global that cannot be hashed by value (a lock,
an open file) counts by its type: the dataset names it only through code, so refusing the whole
dataset for it would ask users for an explicit fingerprint they rarely need. A random generator
reached by a name counts by its type too: its state is not configuration, and an unseeded one
would make every run a new dataset. A module-level value that differs in every run for another
reason (a time stamp, a temporary directory) does make every run a new dataset: name such data with
``cache_setting["fingerprint"]``.
"""

from __future__ import annotations

import functools
import importlib.metadata
import os
import site
import sys
import sysconfig
import types
from dataclasses import dataclass, field
from typing import Any, Iterator, Protocol

import numpy as np

from cachestore.errors import FingerprintError

#: Class attributes that say nothing about what the class computes, change with a moved line, or are
#: caches set on the class later (copyreg's ``__slotnames__`` when an instance is first pickled, an
#: ABC's registry, a Protocol's members on Python 3.12).
_CLASS_NOISE = frozenset({"__dict__", "__weakref__", "__module__", "__doc__", "__qualname__",
                          "__firstlineno__", "__static_attributes__", "__annotations__", "__slotnames__",
                          "_abc_impl", "__protocol_attrs__", "__non_callable_proto_members__"})


@functools.lru_cache(maxsize=None)
def _installed_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots.update(getattr(site, "getsitepackages", lambda: [])())
    roots.add(site.getusersitepackages())
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


@functools.lru_cache(maxsize=None)
def installed_version(module_name: str | None) -> str | None:
    """``"numpy 2.4.6"`` for a module of the standard library or an installed package (its top-level
    package's version), ``None`` for user code (hashed by value).

    A module outside ``sys.modules`` (``namedtuple``'s generated methods, a deleted module) and a
    file-less module that is not a builtin one (``python -``, a notebook's ``__main__``) are user code.
    """
    if not module_name:
        return None
    top = module_name.partition(".")[0]
    module = sys.modules.get(module_name)
    if module is None:
        return f"python {sys.version.split()[0]}" if top in ("builtins", "_io") else None
    file = getattr(module, "__file__", None)
    if not file:
        std = top in sys.builtin_module_names or top in getattr(sys, "stdlib_module_names", ())
        return f"python {sys.version.split()[0]}" if std else None
    path = os.path.realpath(file)
    if not path.startswith(_installed_roots()):
        return None
    if top in getattr(sys, "stdlib_module_names", ()):
        return f"python {sys.version.split()[0]}"
    version = getattr(sys.modules.get(top), "__version__", None)
    if not isinstance(version, str):
        try:
            version = importlib.metadata.version(top)
        except (importlib.metadata.PackageNotFoundError, ValueError):
            version = "?"  # the path says installed; the name alone identifies it
    return f"{top} {version}"


def code_names(code: types.CodeType) -> set[str]:
    """The global (and attribute) names `code` uses, its nested functions and comprehensions included."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= code_names(const)
    return names


def const_repr(const: object) -> str:
    """A code constant in words, the same in every run: ``x in {"a", "b"}`` keeps a frozenset, whose
    repr orders strings by their hash, which changes from run to run."""
    if isinstance(const, types.CodeType):
        return "<code>"
    if isinstance(const, frozenset):
        return "frozenset({" + ", ".join(sorted(map(const_repr, const))) + "})"
    if isinstance(const, tuple):
        return "(" + ", ".join(map(const_repr, const)) + ",)"
    return f"{type(const).__name__}:{const!r}"


@dataclass
class Walk:
    """What the hashers of one fingerprint share.

    ``active``: the values being hashed (id -> depth), to cut cycles in data; ``digests``: the
    digests of the values hashed as parts, so that a shared one is hashed once. ``queued``: the
    functions and classes of user code reached by a name (a global, a method, a base), hashed once
    each by :func:`finish` from a work list, so that a project's call graph (shared parts, cycles,
    chains of any length) costs one visit per function and no deep recursion.
    """

    active: dict[int, int] = field(default_factory=dict)
    queued: dict[int, Any] = field(default_factory=dict)
    pending: list[Any] = field(default_factory=list)
    #: Digests of values already hashed whole (id -> (value, digest); the value kept so its id stays
    #: its own): see ``_ValueHasher.digest_of``.
    digests: dict[int, tuple[Any, bytes]] = field(default_factory=dict)
    #: Strings met that may name data files (:mod:`loader.cache.files`), statted once the walk is done.
    paths: list[str] = field(default_factory=list)


class Hasher(Protocol):
    """What the walk needs of the fingerprint's hasher (:mod:`loader.cache.fingerprint`)."""

    walk: Walk
    h: Any  # the running digest (hashlib)

    def sub(self) -> Hasher:
        """A hasher for a part, in the same walk."""

    def tag(self, *parts: Any) -> None:
        """Feed a tagged tuple of plain values."""

    def feed(self, obj: Any, where: str, depth: int = 0, attributes: bool = False) -> None:
        """Feed a value (by value, or by what it reaches)."""

    def code(self, code: types.CodeType) -> None:
        """Feed a code object's bytecode, names and constants."""


def _reference(hasher: Hasher, obj: Any, kind: str, name: str) -> None:
    """Name `obj` here (with its own code, for a function: two lambdas share a name) and queue it."""
    hasher.tag(kind, name)
    code = getattr(obj, "__code__", None)
    if isinstance(code, types.CodeType):
        hasher.code(code)
    if id(obj) not in hasher.walk.queued:
        hasher.walk.queued[id(obj)] = obj
        hasher.walk.pending.append(obj)


def finish(hasher: Hasher) -> None:
    """Feed what every queued function and class is (in an order of their own: the same whatever order
    they were reached in), following what each of them reaches in turn."""
    walk = hasher.walk
    reached: list[tuple[str, bytes]] = []
    while walk.pending:
        obj = walk.pending.pop()
        name = f"{getattr(obj, '__module__', None)}.{getattr(obj, '__qualname__', '?')}"
        sub = hasher.sub()
        if isinstance(obj, type):
            _class_body(sub, obj)
        else:
            _function_body(sub, obj, name, 0, lenient=True)
        reached.append((name, sub.h.digest()))
    for reached_name, digest in sorted(reached):
        hasher.tag("reached", reached_name, digest)


def feed_function(hasher: Hasher, fn: Any, where: str, depth: int) -> None:
    """A function given as a value (an attribute, a closure's cell): installed code by name and version,
    user code by value (its code, defaults, closure, and the globals its code names)."""
    module = getattr(fn, "__module__", None)
    name = f"{module}.{getattr(fn, '__qualname__', getattr(fn, '__name__', '?'))}"
    owner = getattr(fn, "__self__", None)
    if owner is not None and not isinstance(owner, types.ModuleType):
        # A builtin bound to an object (``mapping.get``, ``rng.normal``): the object decides.
        hasher.tag("bound builtin", name)
        hasher.feed(owner, f"{where}.__self__", depth + 1)
        return
    version = installed_version(module)
    code = getattr(fn, "__code__", None)
    if version is not None or not isinstance(code, types.CodeType):
        hasher.tag("function", name, version or "")
        if code is not None:  # what it was built with is the caller's value, not the package's
            _function_values(hasher, fn, where, depth)
        return
    hasher.tag("function", name)
    _function_body(hasher, fn, where, depth)


def _function_body(hasher: Hasher, fn: Any, where: str, depth: int, lenient: bool = False) -> None:
    # Its name says little (a lambda, a local function, one edited since): its code, defaults,
    # closure and the globals its code names say what it does. `lenient`: reached by a name only,
    # a default or closure value that cannot be hashed counts by its type (see the module docstring).
    code = fn.__code__
    hasher.code(code)
    if lenient:  # one by one: a decorator's closure holds the function it wraps, queued by itself
        for part, values in (("defaults", list(fn.__defaults__ or ())),
                             ("kwdefaults", sorted((fn.__kwdefaults__ or {}).items())),
                             ("closure", [_cell(c) for c in fn.__closure__ or ()])):
            hasher.tag(part, len(values))
            for value in values:
                _named(hasher, value, set(), f"{where} {part}")
    else:
        _function_values(hasher, fn, where, depth)
    globals_ = getattr(fn, "__globals__", {})
    names = code_names(code)
    for global_name in sorted(names & globals_.keys()):
        hasher.tag("global", global_name)
        _named(hasher, globals_[global_name], names, f"{where} global {global_name}")


def _function_values(hasher: Hasher, fn: Any, where: str, depth: int) -> None:
    hasher.feed(getattr(fn, "__defaults__", None), f"{where}.__defaults__", depth + 1)
    hasher.feed(getattr(fn, "__kwdefaults__", None), f"{where}.__kwdefaults__", depth + 1)
    cells = [_cell(c) for c in getattr(fn, "__closure__", None) or ()]
    hasher.feed(cells, f"{where} closure", depth + 1)


def _cell(cell: Any) -> Any:
    try:
        return cell.cell_contents
    except ValueError:  # a closure variable not assigned yet
        return None


def _named(hasher: Hasher, value: Any, names: set[str], where: str) -> None:
    """A value code reaches by a name (a global, a module's attribute, a class attribute): user
    functions and classes are queued, user modules followed through `names`, installed code named,
    data hashed by value; what cannot be hashed counts by its type (see the module docstring)."""
    if isinstance(value, types.ModuleType):
        feed_module(hasher, value, names, where)
    elif _is_generator(value):
        hasher.tag("generator", type(value).__module__, type(value).__qualname__)
    elif isinstance(value, types.FunctionType) and installed_version(value.__module__) is None:
        _reference(hasher, value, "function", f"{value.__module__}.{value.__qualname__}")
    else:
        sub = hasher.sub()
        try:
            sub.feed(value, where, 0)
        except FingerprintError:
            hasher.tag("unhashable", type(value).__module__, type(value).__qualname__)
            return
        hasher.tag("value", sub.h.digest())


def _is_generator(value: Any) -> bool:
    """A random generator: its state is not configuration, and an unseeded one differs in every run."""
    import random

    kinds: list[type] = [random.Random, np.random.Generator, np.random.RandomState, np.random.BitGenerator]
    torch = sys.modules.get("torch")
    if torch is not None:
        kinds.append(torch.Generator)
    return isinstance(value, tuple(kinds))


def feed_module(hasher: Hasher, module: types.ModuleType, names: set[str] | None, where: str) -> None:
    """A module: installed by name and version; user code by the attributes `names` name in it."""
    version = installed_version(module.__name__)
    hasher.tag("module", module.__name__, version or "")
    if version is not None or not names:
        return
    namespace = vars(module)
    for attribute in sorted(n for n in names if n in namespace):
        hasher.tag("attribute", attribute)
        _named(hasher, namespace[attribute], names, f"{where}.{attribute}")


def feed_class(hasher: Hasher, cls: type) -> None:
    """A class: installed by name and version; user code by name here, and by its attributes (methods by
    their code and what they reach) and its bases once, from the work list (:func:`finish`)."""
    name = f"{cls.__module__}.{cls.__qualname__}"
    version = installed_version(cls.__module__)
    if version is not None:
        hasher.tag("type", name, version)
    else:
        _reference(hasher, cls, "type", name)


def _class_body(hasher: Hasher, cls: type) -> None:
    for base in cls.__bases__:
        feed_class(hasher, base)
    name = f"{cls.__module__}.{cls.__qualname__}"
    for attribute, value in sorted(vars(cls).items()):
        if attribute in _CLASS_NOISE:
            continue
        hasher.tag("attribute", attribute)
        where = f"{name}.{attribute}"
        functions = list(_functions_of(value))
        for fn in functions:
            if installed_version(fn.__module__) is None:
                _reference(hasher, fn, "function", f"{fn.__module__}.{fn.__qualname__}")
            else:
                hasher.tag("function", fn.__module__, fn.__qualname__)
        if not functions:
            _named(hasher, value, set(), where)


def _functions_of(value: Any) -> Iterator[Any]:
    """The functions behind a class attribute: a method, a static or class method, a property's accessors."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    if isinstance(value, property):
        yield from (f for f in (value.fget, value.fset, value.fdel) if isinstance(f, types.FunctionType))
    elif isinstance(value, types.FunctionType):
        yield value
