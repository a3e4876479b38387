"""The identity of a dataset's process-shared state, for the fingerprint.

A dataset may hold multiprocessing's synchronisation primitives (``Lock``, ``RLock``,
``Semaphore``, ``BoundedSemaphore``, ``Condition``, ``Event``, ``Barrier``), its queues
(``Queue``, ``JoinableQueue``, ``SimpleQueue``: what passes through them is messages), shared
memory (``Value``, ``Array``, ``RawValue``, ``RawArray``) or a manager's proxies
(``Manager().dict()``): its workers use them to coordinate (a counter, a barrier, a flag), as
torch's own tests do. They refuse pickling outside a process start (a proxy pickles as the
manager's socket and the object's address, new in every run), so hashing them "by what pickle
saves" fails, yet they are no content of the samples.

They are hashed by what they *are*, never by what they hold at the moment:

- a primitive by its class (a ``Semaphore(2)`` and a ``Semaphore(3)`` hash alike: the count
  decides how workers wait, not what they compute, and its current value is not even readable
  on every platform);
- shared memory by its class, its ctypes element type and its length: a counter of C ints
  and a table of doubles differ as a dtype and a shape do;
- a manager's proxy by its class and the type of the object it stands for (``dict``, ``list``);
- never the current value: workers write it while the loader runs, so hashing it would make
  the identity depend on how far an earlier epoch or loader got (a counter after the first
  epoch), and every run would store the same data under a new fingerprint. A dataset whose
  samples *do* depend on a shared value's content must name its identity itself
  (``cache_setting={"fingerprint": ...}``).
"""

from __future__ import annotations

import ctypes
import multiprocessing.heap
import multiprocessing.managers as managers
import multiprocessing.queues as queues
import multiprocessing.sharedctypes as sharedctypes
import multiprocessing.synchronize as synchronize

#: The primitives hashed by their class alone.
_PRIMITIVES = (synchronize.SemLock, synchronize.Condition, synchronize.Event, synchronize.Barrier, queues.Queue,
               queues.SimpleQueue)


def identity(obj: object) -> tuple[str, ...] | None:
    """The parts a fingerprint takes of `obj` when it is process-shared state, else ``None``.

    Examples
    --------
    >>> import multiprocessing as mp
    >>> identity(mp.Value("i", 7))
    ('shared', 'multiprocessing.sharedctypes.Synchronized', 'c_int', '1')
    >>> identity(mp.Semaphore(2))
    ('primitive', 'multiprocessing.synchronize.Semaphore')
    >>> identity([1]) is None
    True
    """
    kind = type(obj)
    if isinstance(obj, _PRIMITIVES):
        return ("primitive", _path(kind))
    if isinstance(obj, sharedctypes.SynchronizedBase):
        raw = obj.get_obj()  # the ctypes object; reading its type takes no lock and no value
        return ("shared", _path(kind), *_ctype(raw))
    if isinstance(obj, managers.BaseProxy):  # its token's typeid: what it stands for, read without a round trip
        return ("proxy", _path(kind), str(getattr(obj, "_token").typeid))
    if isinstance(obj, (ctypes.Array, ctypes._SimpleCData)) and \
            isinstance(getattr(obj, "_wrapper", None), multiprocessing.heap.BufferWrapper):
        return ("shared", "raw", *_ctype(obj))  # RawValue / RawArray: a ctypes object in shared memory
    return None


def _ctype(raw: object) -> tuple[str, str]:
    """Element type and length of a shared ctypes object (a value counts as one element)."""
    if isinstance(raw, ctypes.Array):
        return getattr(raw, "_type_").__name__, str(len(raw))
    return type(raw).__name__, "1"


def _path(kind: type) -> str:
    return f"{kind.__module__}.{kind.__qualname__}"
