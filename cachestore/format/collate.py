"""Stacking a list of samples into a batch: the default collate.

Shared by the store (batch reads of variable-size layouts) and the loader
(batches of freshly computed samples), so a cached epoch yields exactly the
structure a generate epoch yields.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from .codec import Batch, Sample, is_tensor


def stack_samples(samples: Sequence[Sample]) -> Batch:
    """Stack `samples` recursively.

    numpy arrays and numpy scalars become one stacked numpy array, torch
    tensors one stacked tensor, ``bool``/``int``/``float`` a numpy array
    (``bool``, ``int64``, ``float64``); dicts, lists, tuples and namedtuples
    are stacked per key / position (a namedtuple of batches, as torch's
    ``default_collate`` makes); anything else (str, bytes, None, objects, arrays of differing shapes)
    becomes a list. A batch of one sample is stacked like any other.
    """
    if len(samples) == 0:
        raise ValueError("cannot collate an empty batch")
    rows: Sequence[Any] = samples  # each branch below checks the structure it indexes into
    first = rows[0]
    if isinstance(first, np.ndarray) or isinstance(first, np.generic):
        shape = np.shape(first)
        if all(isinstance(s, (np.ndarray, np.generic)) and np.shape(s) == shape for s in rows):
            return np.stack(rows)
    elif is_tensor(first):
        import torch

        if first.is_nested or first.layout != torch.strided:
            kind = "nested" if first.is_nested else "sparse"
            raise RuntimeError(f"Batches of {kind} tensors are not currently supported by the default collate_fn; "
                               "please provide a custom collate_fn to handle them appropriately.")  # torch's words
        if all(is_tensor(s) and s.shape == first.shape for s in rows):
            return torch.stack(list(rows))
    elif isinstance(first, dict):
        return {k: stack_samples([s[k] for s in rows]) for k in first}
    elif type(first) in (list, tuple) or _is_namedtuple(first):
        n = len(first)
        if any(len(s) != n for s in rows):
            raise ValueError("cannot collate sequences of different lengths in one batch")
        columns = [stack_samples([s[i] for s in rows]) for i in range(n)]
        if type(first) is list:
            return columns
        return tuple(columns) if type(first) is tuple else type(first)(*columns)
    elif type(first) is bool and all(type(s) is bool for s in samples):
        return np.array(samples, dtype=np.bool_)
    elif type(first) in (int, float) and all(type(s) in (int, float) for s in samples):
        dtype = np.int64 if all(type(s) is int for s in samples) else np.float64
        return np.array(samples, dtype=dtype)
    return list(samples)


def _is_namedtuple(sample: object) -> bool:
    return isinstance(sample, tuple) and hasattr(type(sample), "_fields")
