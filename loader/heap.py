"""Handing the training process's freed heap back to the system.

A generate epoch with many workers passes thousands of batches through the training
process (received, reordered, written, dropped). glibc's allocator keeps the memory
they freed for later allocations: after a generate epoch of a million small samples
with 8 workers the process held 75 MiB more than before it, none of it in use
(``docs/ARCHITECTURE.md``, "Memory with many workers"). ``malloc_trim`` returns it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from typing import Callable


@functools.lru_cache(maxsize=1)
def _malloc_trim() -> Callable[[int], int] | None:
    """glibc's ``malloc_trim``, ``None`` where the C library has none (musl, macOS)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), "malloc_trim") if name else None
    except (OSError, AttributeError):
        return None


def trim_heap() -> bool:
    """Return the heap's free pages to the system; whether the C library could (glibc)."""
    trim = _malloc_trim()
    if trim is None:
        return False
    trim(0)
    return True
