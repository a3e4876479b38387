"""Read access to stored samples: a committed generation (:class:`GenerationData`) and the samples a
staging area already holds (:class:`StagingData`). Each backend implements both beside its writer
(:mod:`cachestore.backends.base`)."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TypeAlias

import numpy as np

from ..errors import CorruptSampleError, PickleRefusedError
from ..format import codec
from ..format.codec import Batch, Leaf, LeafSpec, Sample, TreeDef
from ..format.collate import stack_samples
from .batch import Indices

#: ``(treedef, leaf specs)`` of a generation whose batches are gathered column-wise.
BatchLayout: TypeAlias = tuple[TreeDef, list[LeafSpec]]
#: What the error of a refused pickled leaf tells the reader to do.
PICKLE_HINT = ("loading it runs code of whoever wrote the store: pass allow_pickle=True (open_store(..., "
               "allow_pickle=True); the loader: cache_setting={..., 'allow_pickle': True}) only to read a store "
               "whose writer you trust")


def refused(where: str, generation: int | None, index: int) -> PickleRefusedError:
    """The error for sample `index` (of `generation` in `where`) holding a pickled leaf the reader
    did not allow."""
    of = f" of generation {generation}" if generation is not None else ""
    exc = PickleRefusedError(f"sample {index}{of} in {where} holds a pickled leaf; {PICKLE_HINT}")
    exc.generation, exc.index = generation, index
    return exc

class GenerationData(ABC):
    """Read access to one committed generation."""

    #: Whether ``read_batch`` may run in several threads at once (see ``Reader.parallel_batches``).
    threadsafe_batches = False

    def __init__(self, generation: int, num_samples: int, where: str, verify: bool, allow_pickle: bool = False) -> None:
        self.generation = generation
        self.num_samples = num_samples
        self.where = where
        self.verify = verify
        #: Whether a pickled leaf is loaded: only when the reading side said so (docs/ARCHITECTURE.md,
        #: "Untrusted stores"); else reading it is :class:`PickleRefusedError`.
        self.allow_pickle = allow_pickle
        #: The most bytes one sample may decompress to, whatever its record says (the store's
        #: ``max_sample_bytes`` or its schema's, see :meth:`bound_samples`; ``None``: its records' own bounds).
        self.max_sample_bytes: int | None = None
        #: The bytes of every sample's leaves where all share one schema (set by the subclass), else ``None``.
        self.uniform_bytes: int | None = None

    def bound_samples(self, limit: int | None) -> None:
        """Bound each sample by `limit` (the store's ``max_sample_bytes``) and, where every sample has
        this generation's schema, by the bytes of that schema: a record declaring more than its own
        schema takes is damage however much room the store allows (docs/ARCHITECTURE.md, "Untrusted
        stores")."""
        known = [b for b in (limit, self.uniform_bytes) if b is not None]
        self.max_sample_bytes = min(known) if known else None

    def __len__(self) -> int:
        return self.num_samples

    def check_index(self, index: int | np.integer) -> int:
        """`index` as an int in ``0..n-1`` (negative ones count from the end)."""
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)):
            raise TypeError(f"sample indices are ints, got {type(index).__name__}")
        i = int(index)
        if i < 0:
            i += self.num_samples
        if not 0 <= i < self.num_samples:
            raise IndexError(f"index {index} out of range for generation {self.generation} "
                             f"of {self.num_samples} samples")
        return i

    def corrupt(self, index: int, why: str) -> CorruptSampleError:
        """The error for sample `index` found corrupt (`why`), naming it and this generation."""
        exc = CorruptSampleError(f"sample {index} of generation {self.generation} in {self.where} is corrupt: {why}")
        exc.generation, exc.index = self.generation, index
        return exc

    def sample(self, index: int, treedef: TreeDef, leaves: list[Leaf]) -> Sample:
        """Sample `index` rebuilt from its leaves; a pickled leaf only with :attr:`allow_pickle`."""
        try:
            return codec.unflatten(treedef, leaves, allow_pickle=self.allow_pickle)
        except PickleRefusedError:
            raise refused(self.where, self.generation, index) from None
        except UnicodeDecodeError as exc:  # a str leaf whose (checked) bytes are not UTF-8
            raise self.corrupt(index, f"a text leaf is not UTF-8 ({exc})") from None

    @abstractmethod
    def read(self, index: int, copy: bool = True) -> Sample:
        """One sample; with ``copy=False`` arrays may be read-only views of storage."""

    def check(self, index: int) -> None:
        """Check sample `index` as :meth:`verify_all` does: its checksum and structure, always,
        without building the sample (a pickled leaf is checked, never loaded). The default
        reads it; backends with checksums override it."""
        try:
            self.read(index, copy=False)
        except PickleRefusedError:
            pass  # read and checked up to the leaf it would not load

    def batch_layout(self) -> BatchLayout | None:
        """``(treedef, leaf specs)`` when a batch can be gathered column-wise into
        caller-provided arrays (see :meth:`read_batch`), else ``None``."""
        return None

    def read_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        """The samples at `indices`, stacked (see :func:`cachestore.format.collate.stack_samples`).

        `out` - only when :meth:`batch_layout` is not ``None`` - gives one
        array of shape ``(len(indices), *shape)`` per leaf to gather into.
        """
        return stack_samples([self.read(self.check_index(i), copy=False) for i in indices])

    def data_bytes(self) -> int:
        """Bytes of the generation's data (what reading all of it brings into memory)."""
        return 0

    def reads_explicitly(self) -> bool:
        """Whether this generation is read with explicit I/O (:meth:`read_range`), not page faults:
        it does not fit the memory room (:mod:`cachestore.space.room`)."""
        return False

    def read_range(self, start: int, stop: int, out: list[Leaf]) -> None:
        """Samples ``start..stop-1`` of a fixed-layout generation into `out` (one array per leaf, of
        ``stop - start`` rows), every record verified. One large read per leaf where the backend
        stores them contiguously; the default gathers them.

        Raises
        ------
        CorruptSampleError
            Naming the first sample that failed its checksum.
        """
        self.read_batch(np.arange(start, stop, dtype=np.int64), out=out)

    def read_rows(self, indices: np.ndarray, out: list[Leaf]) -> None:
        """Samples `indices` of a fixed-layout generation into `out` (one array per leaf, a row per
        index), every record verified; with explicit reads where the backend reads that way.

        Raises
        ------
        CorruptSampleError
            Naming the first sample that failed its checksum.
        """
        self.read_batch(indices, out=out)

    def verify_all(self) -> list[CorruptSampleError]:
        """Check every record (:meth:`check`); return one error per bad sample, or a last one without
        an index when the generation itself broke (a file shrank under the reader)."""
        bad = []
        for i in range(self.num_samples):
            try:
                self.check(i)
            except CorruptSampleError as exc:
                bad.append(exc)
                if exc.index is None:
                    break
        return bad

    def close(self) -> None:
        """Release maps and handles."""


class StagingData(ABC):
    """Read access to samples already written into a staging area (a partial generation).

    Only indices reported by ``present()`` (or written and flushed since) can
    be read; a staging area is never served as a generation, but a generate
    epoch serves the samples it already holds from here instead of computing
    them again.
    """

    #: Whether a pickled leaf is loaded (see :attr:`GenerationData.allow_pickle`).
    allow_pickle = False

    @abstractmethod
    def read(self, index: int) -> Sample:
        """Sample `index` (a copy); :class:`CorruptSampleError` when its record fails its checksum."""

    def sample(self, index: int, treedef: TreeDef, leaves: list[Leaf], where: str) -> Sample:
        """Sample `index` of the staging area `where` rebuilt; a pickled leaf only with :attr:`allow_pickle`."""
        try:
            return codec.unflatten(treedef, leaves, allow_pickle=self.allow_pickle)
        except PickleRefusedError:
            raise refused(f"the staging area {where}", None, index) from None

    def close(self) -> None:
        """Release files and handles."""
