"""How a batch's leaves lie in one flat buffer: aligned, one after the other.

Shared by the shared-memory slots that carry batches from workers
(:mod:`loader.executors.process`) and the buffers the training process's
gather threads fill (:mod:`loader.epochs.reads.threads`).
"""

from __future__ import annotations

import ctypes
import math
import mmap
from typing import Sequence, Union

import numpy as np

from cachestore.format.codec import LeafSpec


#: Every leaf starts at a multiple of this many bytes (a cache line).
ALIGN = 64
#: What leaves are laid over: a slot's mapping, or a ctypes array that exports part of one.
Buffer = Union[mmap.mmap, "ctypes.Array[ctypes.c_char]", bytearray]


def round_up(n: int, to: int) -> int:
    return -(-n // to) * to


def plan_layout(leaf_specs: Sequence[LeafSpec]) -> tuple[list[int], int]:
    """Offsets of each leaf in one buffer, and the buffer's size."""
    offsets: list[int] = []
    end = 0
    for dtype, shape in leaf_specs:
        offsets.append(end)
        end = round_up(end + dtype.itemsize * math.prod(shape), ALIGN)
    return offsets, end


def leaf_views(buf: Buffer, specs: Sequence[LeafSpec], offsets: Sequence[int]) -> list[np.ndarray]:
    """Writable arrays over `buf`, one per leaf."""
    out = []
    for (dtype, shape), off in zip(specs, offsets):
        count = math.prod(shape)
        # numpy reads any buffer-protocol object; its stubs do not list ctypes arrays.
        out.append(np.frombuffer(buf, dtype=dtype, count=count, offset=off).reshape(shape))  # type: ignore[arg-type]
    return out


