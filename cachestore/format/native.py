"""The compiled verified gather (``cachestore/format/_gather.c``), when it is built and not turned off.

The module is optional: ``pip install`` builds it with the machine's C compiler, and without it
(or with ``CACHESTORE_NATIVE=0``) every read uses the pure-Python gather, with the same
checksums and the same errors (see docs/ARCHITECTURE.md, "Verified reads").
"""

from __future__ import annotations

import os
import warnings
from typing import TYPE_CHECKING, Protocol, TypeAlias

import numpy as np
import numpy.typing as npt

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

    # Any buffer; numpy arrays named apart, since their stubs export the buffer protocol to
    # Python 3.12 and later only.
    Bytes: TypeAlias = ReadableBuffer | npt.NDArray[np.generic]
    WritableBytes: TypeAlias = WriteableBuffer | npt.NDArray[np.generic]


class Gather(Protocol):
    """What the readers use of ``cachestore.format._gather`` (its stub, ``_gather.pyi``, is checked against this)."""

    MAX_LEAVES: int
    GUARDED: int

    def populate(self, buffer: Bytes, /) -> bool: ...

    def pread_rows(self, fd: int, dest: WritableBytes, width: int, rows: Bytes, slots: Bytes, /) -> int: ...

    def row_checksums(self, columns: tuple[Bytes, ...], widths: tuple[int, ...], n: int,
                      sums: WritableBytes, /) -> bool: ...

    def gather_verified(self, columns: tuple[Bytes, ...], widths: tuple[int, ...],
                        idx: Bytes, outs: tuple[WritableBytes, ...], expected: Bytes,
                        stream: bool = True) -> int: ...

    def gather_records(self, values: list[Bytes | None], start: int, size: int, body: int,
                       prefix: Bytes, spans: tuple[tuple[int, int], ...],
                       outs: tuple[WritableBytes, ...], verify: bool, stream: bool = True) -> tuple[int, int]: ...

    def stat_digest(self, paths: list[str], threads: int) -> tuple[int, int]: ...


#: What the readers call of the module: a build older than one of them (``cachestore/format/_gather.c``
#: changed, the extension not rebuilt) is not used at all, rather than half. ``GUARDED``: its loops
#: over a mapping report a truncated file instead of dying of SIGBUS (docs/ARCHITECTURE.md,
#: "Untrusted stores"), and say so with the return values the readers expect.
REQUIRED = ("MAX_LEAVES", "GUARDED", "populate", "pread_rows", "row_checksums", "gather_verified", "gather_records",
            "stat_digest")


def _load_native() -> Gather | None:
    if os.environ.get("CACHESTORE_NATIVE", "1") == "0":
        return None
    try:
        from . import _gather
    except ImportError:  # not built (no C compiler at install) or no XXH3 in the xxhash package
        return None
    missing = [name for name in REQUIRED if not hasattr(_gather, name)]
    if missing:
        warnings.warn(f"the compiled gather {_gather.__file__} is older than cachestore (it lacks "
                      f"{', '.join(missing)}): reads use the pure-Python gather; rebuild it with "
                      "`python setup.py build_ext --inplace` or reinstall cachestore", RuntimeWarning, stacklevel=2)
        return None
    return _gather


#: The compiled verified gather (``cachestore/format/_gather.c``), or ``None`` where it is not built or
#: ``CACHESTORE_NATIVE=0`` turned it off; reads then use the pure-Python gather, same checksums.
NATIVE = _load_native()


def native_gather() -> Gather | None:
    """The compiled gather module in use, or ``None`` (see :data:`NATIVE`)."""
    return NATIVE
