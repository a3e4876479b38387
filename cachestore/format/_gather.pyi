# Stub of the compiled verified gather (cachestore/format/_gather.c); the C docstrings give the contract.
from typing import TypeAlias

import numpy as np
import numpy.typing as npt
from _typeshed import ReadableBuffer, WriteableBuffer

# numpy arrays named apart: their stubs export the buffer protocol to Python 3.12 and later only.
_In: TypeAlias = ReadableBuffer | npt.NDArray[np.generic]
_Out: TypeAlias = WriteableBuffer | npt.NDArray[np.generic]

#: Most leaves (columns, spans) one call takes; a wider sample is gathered in Python.
MAX_LEAVES: int
#: Loops over a mapping report a file truncated under it (gather_verified -2, gather_records kind 3,
#: row_checksums False) instead of dying of SIGBUS.
GUARDED: int

def populate(buffer: _In, /) -> bool: ...
def pread_rows(fd: int, dest: _Out, width: int, rows: _In, slots: _In, /) -> int: ...
def row_checksums(columns: tuple[_In, ...], widths: tuple[int, ...], n: int, sums: _Out, /) -> bool: ...
def gather_verified(columns: tuple[_In, ...], widths: tuple[int, ...], idx: _In, outs: tuple[_Out, ...],
                    expected: _In, stream: bool = True) -> int: ...
def gather_records(values: list[_In | None], start: int, size: int, body: int, prefix: _In,
                   spans: tuple[tuple[int, int], ...], outs: tuple[_Out, ...], verify: bool,
                   stream: bool = True) -> tuple[int, int]: ...
def stat_digest(paths: list[str], threads: int, /) -> tuple[int, int]: ...
