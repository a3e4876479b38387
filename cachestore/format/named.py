"""Namedtuple samples: how the codec records their class, and how a reader gets it back.

A namedtuple sample must come back as a namedtuple, so that the default collate makes a
namedtuple of batches of it (as torch's does) and ``batch.label`` works on a cached epoch as on
a computed one. Pickling it would name its class, and loading a pickle imports and calls
whatever its bytes name: no reader of an untrusted store does that (docs/ARCHITECTURE.md,
"Untrusted stores"). So the codec records the class's module, qualified name and field names
(:func:`describe`), and a reader rebuilds the tuple (:func:`rebuild`):

- as **that class**, when the reading process itself stored values of it (:func:`describe`
  remembers it: a namedtuple made in a class body records a name that leads nowhere, for pickle
  too), or when it is already loaded there (found in
  ``sys.modules`` by plain dictionary lookups: no import, no module ``__getattr__``, no
  descriptor), is a tuple subclass of the plain ``type`` metaclass and has exactly the recorded
  fields; the tuple is made by ``tuple.__new__``, so none of the class's code runs. A reader of
  the dataset's samples normally has the class: it defined or imported the dataset, or unpickled
  it (workers);
- else as a ``collections.namedtuple`` of the same name and fields, made once per name and
  fields (a reader with no dataset, a notebook reading a store): attribute access and collation
  work, ``isinstance`` against the user's class does not. Field names are checked
  (:func:`valid`) before ``collections.namedtuple`` compiles its constructor from them.

Where the bytes are the program's own (``trusted``: batches from its workers, rotation
windows), the class's module is imported if need be, as pickle would.
"""

from __future__ import annotations

import collections
import importlib
import keyword
import sys
from types import ModuleType
from typing import Any, Iterable

#: Bounds of what a record may name: a module or qualified name, and a field.
MAX_NAME = 512
#: Rebuilt namedtuple classes kept (a store naming more gets a new class per sample beyond these).
MAX_MADE = 256
#: Classes remembered by their description: those this process stored values of, or found by name.
MAX_SEEN = 4096

_found: dict[tuple[str, str, tuple[str, ...]], type] = {}
_made: dict[tuple[str, tuple[str, ...]], type] = {}


def describe(cls: type, length: int) -> tuple[str, str, tuple[str, ...]] | None:
    """``(module, qualname, fields)`` of a namedtuple class with `length` fields; ``None`` for a
    class that is not one (a plain tuple subclass, ``torch.Size``, a struct sequence) or whose
    names a reader would refuse."""
    fields = getattr(cls, "_fields", None)
    if not isinstance(fields, tuple) or len(fields) != length or not all(type(f) is str for f in fields):
        return None
    module, qualname = getattr(cls, "__module__", None), getattr(cls, "__qualname__", None)
    if not isinstance(module, str) or not isinstance(qualname, str):
        return None
    key = (module, qualname, fields)
    if _found.get(key) is cls:
        return key  # checked when first seen: every sample of a dataset takes this path
    if not valid(module, qualname, fields):
        return None
    if len(_found) < MAX_SEEN:
        _found[key] = cls  # the newest class of that description: the one the program makes values of now
    return key


def valid(module: str, qualname: str, fields: Iterable[str]) -> bool:
    """Whether names read from a store are what :func:`describe` records: a dotted module name, a
    qualified name of identifiers (``<locals>`` between them), and distinct fields that
    ``collections.namedtuple`` takes (identifiers, no keyword, a leading ``_`` only as the
    ``_<position>`` that ``rename=True`` gives)."""
    fields = list(fields)
    if not 0 < len(module) <= MAX_NAME or not 0 < len(qualname) <= MAX_NAME:
        return False
    if not all(part.isidentifier() for part in module.split(".")):
        return False
    parts = qualname.split(".")
    if not parts[-1].isidentifier() or not all(p.isidentifier() or p == "<locals>" for p in parts):
        return False
    for i, field in enumerate(fields):
        if not isinstance(field, str) or len(field) > MAX_NAME or not field.isidentifier() \
                or keyword.iskeyword(field) or (field.startswith("_") and field != f"_{i}"):
            return False
    return len(set(fields)) == len(fields)


def rebuild(module: str, qualname: str, fields: tuple[str, ...], values: list[Any], trusted: bool) -> tuple[Any, ...]:
    """The namedtuple of `values` recorded as ``(module, qualname, fields)`` (see the module docstring)."""
    key = (module, qualname, fields)
    cls = _found.get(key)
    if cls is None:
        cls = _find(module, qualname, fields, trusted)
        if cls is None:
            cls = _rebuilt(qualname.rsplit(".", 1)[-1], fields)
        elif len(_found) < MAX_SEEN:
            _found[key] = cls
    return tuple.__new__(cls, values)  # no code of the class runs


def _find(module: str, qualname: str, fields: tuple[str, ...], trusted: bool) -> type | None:
    # A spawned worker runs the training script as __mp_main__; the training process knows it as __main__.
    name = "__main__" if module == "__mp_main__" else module
    owner: object = sys.modules.get(name)
    if owner is None and trusted:
        try:
            owner = importlib.import_module(name)
        except Exception:  # a module that does not import here: a rebuilt namedtuple will do
            return None
    for part in qualname.split("."):
        if type(owner) not in (type, ModuleType):  # their __dict__ is their own: no hook runs
            return None
        owner = owner.__dict__.get(part)
    if not isinstance(owner, type) or type(owner) is not type or not issubclass(owner, tuple):
        return None
    return owner if _own_fields(owner) == fields else None


def _own_fields(cls: type) -> object:
    """``cls._fields`` read from the classes' own dictionaries (no descriptor runs)."""
    for base in cls.__mro__:
        if "_fields" in base.__dict__:
            return base.__dict__["_fields"]
    return None


def _rebuilt(typename: str, fields: tuple[str, ...]) -> type:
    key = (typename, fields)
    known = _made.get(key)
    if known is not None:
        return known
    # Names checked by valid() (the store's parser): identifiers only, which is all namedtuple
    # compiles into its constructor.
    made: type = collections.namedtuple(typename, fields, rename=True)  # type: ignore[misc]
    if len(_made) < MAX_MADE:
        _made[key] = made
    return made
