"""Record checksums: the xxh3 of a record's bytes, or of a fixed-layout sample's leaves.

One definition for every backend and both gathers: :func:`checksum` is what a
record is written with, and :func:`row_checksums` gives the same value for each
row of a batch laid out as one 2-D ``uint8`` array per leaf, so a batch is
verified row by row from the gathered arrays (see docs/ARCHITECTURE.md,
"Verified reads").
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Sequence, cast

import numpy as np
import numpy.typing as npt
import xxhash

from ..errors import CorruptSampleError
from .native import native_gather

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

    from .native import Bytes

#: Rows up to this many bytes are hashed from one ``bytes`` copy of their block: a Python call per
#: row on a numpy row view costs more than hashing 1 KiB.
SMALL_ROW_BYTES = 1024


def checksum(parts: Sequence[Bytes]) -> int:
    """64-bit xxh3 of the concatenation of `parts` (buffers).

    xxh3 rather than crc32, which is several times slower: with crc32 a verified
    batch read could not come near memory bandwidth.
    """
    # numpy arrays are buffers on every Python; their stubs say so from 3.12 on.
    buffers = cast("Sequence[ReadableBuffer]", parts)
    if len(buffers) == 1:
        return xxhash.xxh3_64_intdigest(buffers[0])
    h = xxhash.xxh3_64()
    for part in buffers:
        h.update(part)
    return h.intdigest()


def row_checksums(rows: Sequence[npt.NDArray[np.uint8]], n: int) -> list[int]:
    """:func:`checksum` of each row's leaves, for rows laid out as one 2-D ``uint8`` array per leaf.

    Row ``j``'s checksum hashes ``rows[0][j]``, ``rows[1][j]``, ... concatenated: the same value
    :func:`checksum` gives for the sample's leaves, so stored checksums need no new definition.
    """
    rows = [r for r in rows if r.shape[1]]
    if not rows:
        return [checksum([b""])] * n
    native = native_gather()
    if native is not None and len(rows) <= native.MAX_LEAVES and all(r.flags.c_contiguous for r in rows):
        sums = np.empty(n, dtype=np.uint64)
        if not native.row_checksums(tuple(rows), tuple(r.shape[1] for r in rows), n, sums):
            raise CorruptSampleError("a page of the rows could not be read: the file mapped behind them "
                                     "was truncated since it was mapped")
        return sums.tolist()
    width = sum(r.shape[1] for r in rows)
    hash_one = xxhash.xxh3_64_intdigest
    if width <= SMALL_ROW_BYTES:
        # One contiguous copy of the block, then a bytes slice per row: a hasher fed numpy row
        # views pays a Python call per row, and that call dominated a verified read of small samples.
        data = (rows[0] if len(rows) == 1 else np.concatenate(rows, axis=1)).tobytes()
        return [hash_one(data[o:o + width]) for o in range(0, n * width, width)]
    if len(rows) == 1:
        (only,) = rows
        return [hash_one(only[j]) for j in range(n)]
    hasher, found = xxhash.xxh3_64(), []
    for j in range(n):
        hasher.reset()
        for r in rows:
            hasher.update(r[j])
        found.append(hasher.intdigest())
    return found


def flat_rows(arrays: Sequence[npt.NDArray[np.generic]], n: int) -> list[npt.NDArray[np.uint8]]:
    """Each array of `n` rows as a 2-D ``uint8`` view ``(n, row bytes)``.

    Raises
    ------
    ValueError
        An array is not C-contiguous: its reshape would be a copy, and what is written into the
        rows would never reach the array (a caller's `out` left unfilled without a word).
    """
    check_contiguous(arrays)
    return [a.reshape(n, math.prod(a.shape[1:])).view(np.uint8) for a in arrays]


def check_contiguous(out: Sequence[npt.NDArray[np.generic]]) -> None:
    """Raise ``ValueError`` naming the first array of `out` that is not C-contiguous.

    Batches are gathered into `out` as rows of bytes, which a strided array (``big[:, ::2]``,
    a transposed one) does not have; a contiguous copy of it would be filled instead, and lost.
    """
    for k, a in enumerate(out):
        if not a.flags.c_contiguous:
            raise ValueError(f"out leaf {k} (shape {a.shape}, strides {a.strides}) is not C-contiguous: batches "
                             "are gathered into out as rows of bytes; pass C-contiguous arrays (or slices of "
                             "their first axis)")


def first_mismatch(sums: list[int], expected: list[int]) -> int | None:
    """Position of the first row whose checksum differs, or ``None``."""
    if sums == expected:
        return None
    return next(j for j, (a, b) in enumerate(zip(sums, expected)) if a != b)
