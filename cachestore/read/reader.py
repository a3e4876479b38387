"""Read-only view of one committed generation, usable as a map-style dataset."""

from __future__ import annotations

import os

import numpy as np

from ..backends.batch import Indices
from ..backends.reading import BatchLayout, GenerationData
from ..backends.spec import StoreSpec
from ..errors import BatchStackError, CacheStoreError, CorruptSampleError
from ..format.checksums import check_contiguous
from ..format.codec import Batch, Leaf, Sample
from ..format.collate import stack_samples


class Reader:
    """One committed generation of a store: ``len(reader)``, ``reader[i]``, batches.

    A reader keeps seeing exactly its generation until closed, even while newer
    ones are committed. It pickles as the store's path and options plus the
    generation id and reopens lazily in the new process, so it can be handed to
    ``torch.utils.data.DataLoader(reader, num_workers=...)`` as it is (an
    in-RAM ``memory`` store's reader pickles with its arrays instead).

    Examples
    --------
    >>> reader = cachestore.open_store("cache/train").reader()   # doctest: +SKIP
    >>> sample = reader[0]
    >>> batch = reader.get_batch([3, 1, 4])
    """

    def __init__(self, spec: StoreSpec, generation: int, data: GenerationData | None = None) -> None:
        self.spec = spec
        self.generation = generation
        self._data: GenerationData | None = data
        self._pid = os.getpid()
        self._persistent = spec.persistent

    @property
    def survives_fork(self) -> bool:
        """Capability: a process forked from this one can read it (each process reopens it, by pid)."""
        return True

    @classmethod
    def open(cls, spec: StoreSpec, generation: int) -> "Reader":
        """Open committed `generation` of the store at `spec` in this process."""
        return cls(spec, generation, spec.open_backend().open_generation(generation))

    # pickling: the spec (+ arrays for an in-RAM store) ---------------------------
    def __getstate__(self) -> dict[str, object]:
        state: dict[str, object] = {"spec": self.spec, "generation": self.generation,
                 "_persistent": self._persistent, "_data": None, "_pid": -1}
        if not self._persistent:
            state["_data"] = self._data
            state["_pid"] = os.getpid()
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        self.__dict__.update(state)
        if not self._persistent:
            self._pid = os.getpid()

    @property
    def data(self) -> GenerationData:
        """The backend's handle, reopened after a fork or unpickling."""
        if self._data is None or (self._persistent and self._pid != os.getpid()):
            self._data = self.spec.open_backend().open_generation(self.generation)
            self._pid = os.getpid()
        return self._data

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> Sample:
        """The sample at `index`, as writable copies (safe to modify or hand to torch)."""
        return self.data.read(index, copy=True)

    def get(self, index: int, copy: bool = True) -> Sample:
        """The sample at `index`; ``copy=False`` returns read-only views of storage
        where the backend allows (``Store.backend.supports_zero_copy``)."""
        return self.data.read(index, copy=copy)

    def get_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        """The samples at `indices`, stacked like the loader's default collate.

        With a fixed layout (every sample the same structure and shapes) this is
        one vectorised gather per leaf; `out` may then give the destination
        arrays, one per leaf, shaped ``(len(indices), *shape)`` - see
        :meth:`batch_layout`. Each of them must be C-contiguous (``ValueError``
        otherwise: a strided array cannot take the rows as they are gathered).
        """
        if out is not None:
            check_contiguous(out)
        try:
            return self.data.read_batch(indices, out=out)
        except (ValueError, KeyError, TypeError, IndexError, RuntimeError) as exc:
            if isinstance(exc, CacheStoreError) or not _raised_stacking(exc):
                raise
            raise BatchStackError(f"samples of generation {self.generation} in {self.data.where} cannot be stacked "
                                  f"into one batch ({type(exc).__name__}: {str(exc)[:200]}): their structures "
                                  "differ; each reads alone (reader[i])") from None

    def batch_layout(self) -> BatchLayout | None:
        """``(treedef, [(dtype, shape) per leaf])`` for fixed-layout generations, else ``None``."""
        return self.data.batch_layout()

    def parallel_batches(self) -> bool:
        """Whether :meth:`get_batch` may run in several threads at once (and gains by it): a
        fixed-layout generation of a backend whose batch reads release the GIL (the compiled
        gather, or the numpy copies and xxh3 hashes of the pure-Python one)."""
        return self.data.threadsafe_batches and self.batch_layout() is not None

    def data_bytes(self) -> int:
        """Bytes of the generation's data: what reading all of it brings into memory."""
        return self.data.data_bytes()

    def reads_explicitly(self) -> bool:
        """Whether the generation does not fit the memory room, and is best read with
        :meth:`read_range` and :meth:`read_rows` (explicit I/O), not through page faults."""
        return self.data.reads_explicitly()

    def read_range(self, start: int, stop: int, out: list[Leaf]) -> None:
        """Samples ``start..stop-1`` into `out` (fixed layout), with one large read per leaf where
        the backend can, every record verified (``CorruptSampleError`` names the first bad one).
        `out` must be C-contiguous, as for :meth:`get_batch`."""
        check_contiguous(out)
        self.data.read_range(start, stop, out)

    def read_rows(self, indices: np.ndarray, out: list[Leaf]) -> None:
        """Samples `indices` into `out` (fixed layout), with explicit reads where the backend reads
        that way, every record verified. `out` must be C-contiguous, as for :meth:`get_batch`."""
        check_contiguous(out)
        self.data.read_rows(indices, out)

    def verify(self) -> list[CorruptSampleError]:
        """Check every checksum of this generation; one error per bad sample."""
        return self.data.verify_all()

    def close(self) -> None:
        """Release maps and handles (the reader reopens if used again)."""
        if self._data is not None and self._persistent:
            self._data.close()
            self._data = None

    def __enter__(self) -> "Reader":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Reader({self.spec.path!r}, generation={self.generation})"


def _raised_stacking(exc: BaseException) -> bool:
    """Whether `exc` came out of stacking samples (their structures differ: written so, or crafted records),
    not out of reading them."""
    tb = exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code is stack_samples.__code__:
            return True
        tb = tb.tb_next
    return False
