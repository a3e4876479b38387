"""Batch reads shared by the backends: checked indices, and rows gathered from columns."""

from __future__ import annotations

from typing import Sequence, TypeAlias

import numpy as np
import numpy.typing as npt

from ..format.codec import Leaf, LeafSpec

#: The indices of a batch: ints, or an integer numpy array.
Indices: TypeAlias = Sequence[int] | npt.NDArray[np.integer]


def batch_indices(indices: Indices, n: int, generation: int) -> npt.NDArray[np.int64]:
    """`indices` as an int64 array in ``0..n-1``; negative ones count from the end, like ``read``."""
    idx = np.asarray(indices)
    if idx.size and idx.dtype.kind not in "iu":  # as read(): no floats or bools taken for indices
        raise TypeError(f"sample indices are ints, got an array of {idx.dtype}")
    idx = idx.astype(np.int64, copy=False)
    if idx.size and (idx.min() < -n or idx.max() >= n):
        bad = idx[(idx < -n) | (idx >= n)][0]
        raise IndexError(f"index {bad} out of range for generation {generation} of {n} samples")
    if idx.size and idx.min() < 0:
        idx = np.where(idx < 0, idx + n, idx)
    return idx


def gather_columns(columns: Sequence[Leaf], specs: Sequence[LeafSpec], idx: npt.NDArray[np.int64],
                   out: list[Leaf] | None) -> list[Leaf]:
    """Rows `idx` of each column (fixed layout), gathered into `out` (allocated when ``None``).

    `idx` must already be checked (:func:`batch_indices`).
    """
    if out is None:
        out = [np.empty((idx.size, *shape), dtype=dtype) for dtype, shape in specs]
    for col, dest in zip(columns, out):
        # mode="clip": the indices are checked, and the default mode="raise" makes np.take
        # gather into a temporary and copy it into `out` (half the speed).
        np.take(col, idx, axis=0, out=dest, mode="clip")
    return out
