"""A stream's identity, taken once: what its own iteration changes in it is its state, not a new dataset.

A stream iterated in the training process (``nb_worker=0``) changes its own
attributes as it runs: a position, a count of its passes, the list of sizes it
rewrites in ``__iter__``. The identity its cache is filed under and its
loader states record is the one taken at the loader's first ``iter()``
(``docs/ARCHITECTURE.md``, "Identity"). A loader later built on the same object
in this process (a restored loader, a validation loader) finds it as an earlier
loader's iteration left it: it gets the identity taken then, not a hash of what
that iteration changed. An object changed by its user since (any attribute the
loaders' iteration did not leave so) gets a new identity, as it should.

Objects are remembered by a weak reference: nothing here keeps a dataset alive.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Callable

#: States remembered per object as the loaders' iteration left them (the latest count).
MAX_LEFT = 8


@dataclass
class _Taken:
    ref: Callable[[], object | None]
    identity: dict[str, object]
    left: list[str] = field(default_factory=list)  # state hashes the loaders' own iteration left it with


_TAKEN: dict[int, _Taken] = {}


def _entry(instance: object) -> _Taken | None:
    taken = _TAKEN.get(id(instance))
    return taken if taken is not None and taken.ref() is instance else None


def recall(instance: object, fresh: dict[str, object]) -> dict[str, object]:
    """The identity of `instance`, whose identity computed now is `fresh`.

    An earlier loader's identity of this very object when the object is as that
    identity or that loader's iteration left it (same ``state_sha256``); else
    `fresh`, remembered from now on.
    """
    state = fresh.get("state_sha256")
    taken = _entry(instance)
    if taken is not None and (state == taken.identity.get("state_sha256") or state in taken.left) and \
            {k: v for k, v in fresh.items() if k != "state_sha256"} == \
            {k: v for k, v in taken.identity.items() if k != "state_sha256"}:
        return taken.identity
    try:
        ref = weakref.ref(instance)
    except TypeError:  # no weak references (``__slots__``): nothing to remember it by
        return fresh
    if taken is None:
        key = id(instance)
        weakref.finalize(instance, _TAKEN.pop, key, None)
    _TAKEN[id(instance)] = _Taken(ref, fresh)
    return fresh


def left(instance: object, state_sha256: Callable[[], str]) -> None:
    """A loader's iteration left `instance` with the state `state_sha256()` hashes (asked only of an
    object whose identity was taken): still the identity taken before."""
    taken = _entry(instance)
    if taken is None:
        return
    state = state_sha256()
    if state != taken.identity.get("state_sha256") and state not in taken.left:
        taken.left = [*taken.left[-(MAX_LEFT - 1):], state]
