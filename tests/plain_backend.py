"""A backend of the tests' own, plugged in through :func:`cachestore.register_backend`: the proof that
the store and the loader judge a backend by its capability flags, never by its name.

``plainfiles`` keeps memmap's files, and declares fewer capabilities: its generations are never written
together by several processes (``supports_shared_write``) nor read with explicit I/O when larger than
memory (``supports_streaming``); ``plainstreaming`` is the same that says it can stream. Importing
this module registers both; a loader's spawned workers import
it with :class:`PlainArange`, the dataset its loader tests read, so they know the name too.
"""

from __future__ import annotations

from cachestore import register_backend
from cachestore.backends.memmap import MemmapBackend

from .loader.datasets import ArangeDataset


class PlainFilesBackend(MemmapBackend):
    """memmap's generations, written by one process at a time and read through the page cache only."""

    name = "plainfiles"
    supports_shared_write = False
    supports_streaming = False


class PlainStreamingBackend(PlainFilesBackend):
    """``plainfiles`` that says its generations larger than memory are read with explicit I/O (memmap's
    ``read_range``/``read_rows``, which it inherits)."""

    name = "plainstreaming"
    supports_streaming = True


for _backend in (PlainFilesBackend, PlainStreamingBackend):
    register_backend(_backend.name, _backend)


class PlainArange(ArangeDataset):
    """:class:`ArangeDataset`, from a module that registers ``plainfiles`` in every process importing it."""
