"""How the user's objects reach worker processes: by pickle, by value where pickle cannot name them.

Spawned workers are fresh interpreters: the dataset (its class and
parameters, or an instance), ``collate_fn`` and ``worker_init_fn`` reach them
pickled. Pickle sends classes and functions *by name*, and a worker must then
import them: that fails for what was defined in a notebook cell, in a script
piped to ``python -``, inside a function, or as a lambda. Those go *by value*
through cloudpickle (as Ray and Dask send them); importable ones still go by
name. What cannot be sent at all (an open file, a lock, a generator) is
refused before any worker starts, with :class:`~loader.errors.NotImportableError`
naming the object and the attribute at fault.
"""

from __future__ import annotations

import pickle
from typing import Generic, TypeVar

import cloudpickle

from ..dataset import DatasetSource
from ..errors import NotImportableError

T = TypeVar("T")

#: Containers and attributes looked into to name what cannot be sent, at most this deep.
MAX_DEPTH = 12


class Portable(Generic[T]):
    """An object on its way to worker processes: serialised once, here, then sent as bytes.

    Parameters
    ----------
    obj
        The object (the dataset source, a collate function, ...).
    what
        How messages name it (``"dataset"``, ``"collate_fn"``).

    Raises
    ------
    NotImportableError
        `obj` cannot be sent: the message names the attribute at fault.
    """

    def __init__(self, obj: T, what: str) -> None:
        self._obj = obj
        self._loaded = True
        self.what = what
        self._payload: bytes | None = None
        # Pickled anew as each worker process starts, not once here: it holds what multiprocessing hands
        # over only then (an mp.Value, a Semaphore, as torch's workers get them), see payload().
        self.at_start = False

    @property
    def obj(self) -> T:
        return self.load()

    def payload(self) -> bytes:
        """The bytes a worker loads (computed once); empty when the object goes pickled at each start.

        Raises
        ------
        NotImportableError
            The object cannot be sent at all (the message names the part at fault).
        """
        if self._payload is None and not self.at_start:
            try:
                self._payload = cloudpickle.dumps(self._obj, protocol=pickle.HIGHEST_PROTOCOL)
            except Exception as exc:  # pickling raises many types
                if not inherited_only(exc):
                    self._payload = dumps(self._obj, self.what)  # raises, naming the culprit
                self.at_start = True
        return self._payload or b""

    def forget_payload(self) -> None:
        """Drop the bytes :meth:`payload` computed (it computes them again when a worker is spawned): workers
        forked from this process never need them, and a dataset indexed by a million Python objects
        pickles to tens of MiB the training process would keep for nothing."""
        if self._loaded:
            self._payload = None

    def load(self) -> T:
        """The object: itself in this process, a copy where it arrived as bytes, unpickled at the first
        call (a worker that never builds its dataset never imports the dataset's module)."""
        if not self._loaded:
            assert self._payload is not None  # arrived as bytes
            self._obj = pickle.loads(self._payload)
            self._loaded = True
        return self._obj

    @staticmethod
    def arrived(payload: bytes, what: str) -> Portable[object]:
        """The object as a worker receives it: its bytes, unpickled at the first :meth:`load`."""
        received: Portable[object] = Portable(None, what)
        received._payload, received._loaded = payload, False
        return received

    def __reduce__(self) -> tuple[object, tuple[object, str]]:
        payload = self.payload()
        if self.at_start:
            return (Portable, (self._obj, self.what))  # pickled by the worker's start: multiprocessing's way
        return (Portable.arrived, (payload, self.what))


def inherited_only(exc: BaseException) -> bool:
    """Whether `exc` says an object may reach a child process only while it starts (``mp.Value``, locks,
    semaphores: multiprocessing pickles them then, and only then)."""
    return isinstance(exc, RuntimeError) and ("through inheritance" in str(exc) or "AuthenticationString" in str(exc))


class PortablePart(Portable[T]):
    """Item `index` of a tuple sent as one :class:`Portable`: objects sent together share their parts.

    The dataset and a ``worker_init_fn`` go as one pickle, so that ``worker_init_fn=dataset.open_files``
    (a bound method) arrives bound to the worker's own dataset, not to a second copy of it.
    """

    def __init__(self, whole: Portable[tuple[object, ...]], index: int, what: str) -> None:
        super().__init__(None, what)  # type: ignore[arg-type]
        self.whole, self.index = whole, index

    def payload(self) -> bytes:
        return self.whole.payload()

    def forget_payload(self) -> None:
        self.whole.forget_payload()

    def load(self) -> T:
        part: T = self.whole.load()[self.index]  # type: ignore[assignment]
        return part

    def __reduce__(self) -> tuple[object, tuple[Portable[tuple[object, ...]], int, str]]:  # type: ignore[override]
        return (PortablePart, (self.whole, self.index, self.what))



def dumps(obj: object, what: str) -> bytes:
    """`obj` as bytes a worker process can load (by name where it can, else by value).

    Raises
    ------
    NotImportableError
        Naming the part of `obj` that cannot be sent (``dataset.transform.lock``).
    """
    try:
        payload: bytes = cloudpickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        return payload
    except Exception as exc:  # pickling raises many types: TypeError, PicklingError, AttributeError, ...
        where, cause = culprit(obj, what, exc)
        raise NotImportableError(
            f"{where} cannot be sent to the worker processes ({type(cause).__name__}: {cause}). Objects go to "
            "workers by pickle, by value where pickle cannot name them, but this one cannot be sent at all (an "
            "open file, a lock, a connection, a generator?). Create it in the dataset itself (in __init__ from "
            "plain parameters, or lazily in __getitem__), or run the workers as threads (use_threading=True) "
            "or in this process (nb_worker=0)") from None


def culprit(obj: object, where: str, exc: BaseException, depth: int = 0) -> tuple[str, BaseException]:
    """The deepest part of `obj` that fails to serialise, named as a path from `where`, and its error."""
    if depth >= MAX_DEPTH:
        return where, exc
    for name, part in _parts(obj):
        try:
            cloudpickle.dumps(part, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception as inner:
            return culprit(part, f"{where}{name}", inner, depth + 1)
    return where, exc


def _parts(obj: object) -> list[tuple[str, object]]:
    """The named parts of `obj` a failure may hide in: items, attributes, closure cells."""
    if isinstance(obj, DatasetSource):  # named as the user gave it: dataset.<attr>, dataset_params[...]
        return [("", obj.instance)] if obj.instance is not None else [("_params", obj.params)]
    if isinstance(obj, dict):
        return [(f"[{key!r}]", value) for key, value in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", value) for i, value in enumerate(obj)]
    cells = getattr(obj, "__closure__", None)
    if cells:
        names = getattr(getattr(obj, "__code__", None), "co_freevars", ())
        return [(f".<closure {name}>", cell.cell_contents) for name, cell in zip(names, cells)]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return [(f".{key}", value) for key, value in state.items()]
    return []
