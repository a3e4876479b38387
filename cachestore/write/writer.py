"""Writing one generation: the owner's writer and the shard specs it hands out."""

from __future__ import annotations

import os
import weakref
from types import TracebackType
from typing import Callable, Protocol

import numpy as np
import numpy.typing as npt

from ..backends.base import Backend, GenerationInfo, ProducerRecord, ShardWriter, StagingToken
from ..backends.reading import StagingData
from ..backends.spec import StoreSpec
from ..errors import BudgetExceededError, CacheStoreError
from ..format.codec import Sample
from ..guard import untrusted
from ..guard.locking import WriterLease
from ..guard.untrusted import MAX_DECIMAL as MAX_GENERATION
from ..space.budget import Budget
from ..space.disk import allocated_bytes
from .sink import PutResult, SampleSink


class ShardSpec:
    """A picklable ticket to write into a generation from another process.

    ``spec.open(shard_id)`` returns a :class:`~cachestore.backends.ShardWriter`;
    each process (or worker) uses its own `shard_id` and calls ``close()`` when
    done, before the owner commits.
    """

    def __init__(self, spec: StoreSpec, token: StagingToken, backend: Backend | None = None) -> None:
        self.spec = spec
        self.token = token
        self._backend = backend  # only meaningful in the owning process

    def __getstate__(self) -> dict[str, object]:
        return {"spec": self.spec, "token": self.token, "_backend": None}

    def open(self, shard_id: str) -> ShardWriter:
        """A shard writer for this process; `shard_id` must be unique per generation, and a name
        a file can take in the staging area (no ``/``: a reader refuses a shard outside it)."""
        if not untrusted.is_file_name(shard_id):
            raise ValueError(f"shard_id {shard_id!r} cannot name a file in the staging area")
        backend = self._backend if self._backend is not None else self.spec.open_backend()
        return backend.shard_writer(self.token, shard_id)

    def open_staging(self) -> StagingData | None:
        """Read access to the samples already written (``None`` when the backend cannot give it here)."""
        backend = self._backend if self._backend is not None else self.spec.open_backend()
        return backend.open_staging(self.token)

    def sink(self, shard_id: str, stop_when_full: bool = False) -> SampleSink:
        """Where a producer puts the samples it computes, claimed first where processes write the
        generation together; each put says whether the sample was written, is already there, or must
        be waited for (see :mod:`cachestore.write.sink`)."""
        return SampleSink(self, shard_id, stop_when_full)


class Writer(Protocol):
    """A writer of one generation: :class:`GenerationWriter` (this process holds the store's writer lock)
    or :class:`cachestore.write.shared.SharedWriter` (processes write the generation together).

    What a loader holds while it writes a generation: it hands :meth:`shard_spec` to the processes that
    compute samples (each puts them through :meth:`ShardSpec.sink`), and commits, keeps or aborts.
    """

    @property
    def generation(self) -> int: ...

    @property
    def num_samples(self) -> int | None: ...

    @property
    def backend(self) -> Backend: ...

    @property
    def token(self) -> StagingToken: ...

    @property
    def state(self) -> str:
        """``"open"``, then ``"committed"``, ``"kept"``, ``"left"`` or ``"aborted"``."""

    @property
    def shared(self) -> bool:
        """Whether other processes write this generation too (a commit may then leave it to them)."""

    def put(self, index: int, sample: Sample) -> PutResult:
        """Store `sample` at `index`: ``WRITTEN``; when processes write together, ``PRESENT`` (another has
        written it) or ``UNWRITTEN`` (their area went away under this one)."""

    def present(self) -> npt.NDArray[np.int64]:
        """Sorted indices already written."""

    def shard_spec(self) -> ShardSpec:
        """A picklable ticket other processes write with."""

    def discard_shard_tail(self, shard_id: str, keep: int) -> None:
        """Forget what a dead shard writer wrote after its first `keep` samples (where that is needed)."""

    def commit(self, extra: dict[str, object] | None = None) -> GenerationInfo | None:
        """Publish the generation; ``None`` when it is left to other processes writing it."""

    def keep(self) -> None:
        """Leave what was written for the next writer of this generation."""

    def abort(self) -> None:
        """Discard what was written (what others wrote together stays theirs)."""


class BudgetSource(Protocol):
    """What a writer asks for its budget (:meth:`cachestore.Store.budget`)."""

    def __call__(self, reclaim: int = 0) -> Budget: ...


def _allocated(token: StagingToken) -> int:
    return allocated_bytes(token.path) if os.path.isdir(token.path) else 0


def _abandon(backend: Backend, token: StagingToken, lease: WriterLease, resuming: bool) -> None:
    """Finalizer of a writer nobody committed, aborted or kept (an exception or a second Ctrl-C cut
    its owner's clean-up short): a resuming writer's staging area is a partial generation, kept as a
    SIGKILL would have left it; any other is dropped. The lease goes back either way."""
    try:
        if resuming:
            backend.keep(token)
        else:
            backend.discard(token)
    except Exception:
        pass  # at interpreter exit, or a vanished directory: the next writer or prune sees to it
    finally:
        lease.release()


class GenerationWriter:
    """Writes one generation; commits on clean exit of ``with``, discards on error.

    Obtained from :meth:`cachestore.Store.writer`, which hands it the store's
    writer `lease`: the writer holds it from creation to :meth:`commit`,
    :meth:`abort` or :meth:`keep` (or garbage collection) and gives it back
    exactly once.

    With `resume` (and a `record` naming the producer), a partial generation
    left by an earlier resuming writer of the same generation and producer is
    adopted: :meth:`present` lists what it already holds, and those indices
    must not be written again; this writer's own staging area records the
    producer so a later one can adopt it in turn. Every other staging area
    left behind is removed.
    """

    shared = False

    def __init__(self, spec: StoreSpec, backend: Backend, generation: int, num_samples: int | None,
                 lease: WriterLease, budget: BudgetSource, record: ProducerRecord | None = None,
                 resume: bool = False) -> None:
        if isinstance(generation, bool) or not isinstance(generation, int) or not 0 <= generation <= MAX_GENERATION:
            raise ValueError(f"generation must be an int in 0..{MAX_GENERATION}, got {generation!r}")
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(f"num_samples must be a non-negative int or None, got {num_samples!r}")
        self.spec = spec
        self.backend = backend
        self.generation = generation
        self.num_samples = num_samples
        self._lease = lease
        self.adopted = False
        try:
            # We hold the lease: any staging area left is a dead (or kept) writer's.
            token = backend.adopt(generation, num_samples, record) if resume and record is not None else None
            backend.remove_debris(keep_paths=[token.path] if token is not None else [])
            if token is not None:
                self.adopted = True
                # What the adopted area holds is part of this generation, not of the space taken.
                self.token = backend.with_budget(token, budget(reclaim=_allocated(token)))
            else:
                self.token = backend.begin(generation, budget(), num_samples)  # budget after the debris is gone
                if resume and record is not None:  # only a resuming writer leaves a partial generation
                    try:
                        backend.record_staging(self.token, {**record, "generation": generation})
                    except OSError:
                        # No room for even the record (a full disk): write on; without its record
                        # the staging area is not adoptable, and whether samples fit is the shards' call.
                        pass
        except BaseException:
            lease.release()
            raise
        self._finalizer = weakref.finalize(self, _abandon, backend, self.token, lease,
                                           resume and record is not None)
        self._shard: ShardWriter | None = None
        self.state = "open"

    def __enter__(self) -> "GenerationWriter":
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.state != "open":
            return
        if exc_type is None:
            self.commit()
        else:
            self.abort()

    def _check_open(self) -> None:
        if self.state != "open":
            raise CacheStoreError(f"this writer of generation {self.generation} is {self.state}")

    def put(self, index: int, sample: Sample) -> PutResult:
        """Store `sample` at `index` of this generation (``WRITTEN``: nobody else writes it)."""
        self._check_open()
        if self._shard is None:
            self._shard = self.backend.shard_writer(self.token, f"owner-{os.getpid()}")
        try:
            self._shard.put(index, sample)
        except BudgetExceededError:
            # The generation cannot be finished: drop its staging now (as the error says),
            # not when the caller gets round to abort() or the writer is collected.
            self.abort()
            raise
        return PutResult.WRITTEN

    def shard_spec(self) -> ShardSpec:
        """A picklable spec other processes use to write into this generation."""
        self._check_open()
        return ShardSpec(self.spec, self.token, self.backend)

    def present(self) -> npt.NDArray[np.int64]:
        """Sorted indices (numpy int64) already written: adopted, and flushed by any shard since."""
        return self.backend.present(self.token)

    def keep(self) -> None:
        """Give the lease back and leave what was written for the next writer of this generation.

        The staging area stays (it is the partial generation, not debris):
        ``Store.writer(generation, n, resume=True)`` with the same producer
        record adopts it. Every shard writer must be closed first (the
        loader's workers included). Idempotent; a no-op after commit or abort.
        """
        self._end("kept", self.backend.keep)

    def discard_shard_tail(self, shard_id: str, keep: int) -> None:
        """Keep only the first `keep` samples a dead shard writer recorded."""
        self.backend.discard_shard_tail(self.token, shard_id, keep)

    def commit(self, extra: dict[str, object] | None = None) -> GenerationInfo:
        """Publish the generation atomically; every index ``0..n-1`` must be present once."""
        self._check_open()
        try:
            if self._shard is not None:
                self._shard.close()
            meta = self.backend.read_meta()
            if meta is not None and meta.get("backend") not in (None, self.backend.name):
                # The prefix was removed and made again, by another process, as a store of another backend.
                raise CacheStoreError(f"{self.spec.path} now holds a {meta.get('backend')} store (its store.json was "
                                      f"written again after this writer opened it as {self.backend.name}): "
                                      f"generation {self.generation} is not committed there")
            info = self.backend.commit(self.token, self.num_samples, dict(extra or {}))
        except BaseException:
            self.abort()
            raise
        return self._committed(info)

    def install(self) -> GenerationInfo:
        """Publish the staging area as it is: it already holds a committed generation's files, verified
        (a generation fetched from a remote, :mod:`cachestore.remote.fetch`), so nothing is merged."""
        self._check_open()
        try:
            if self._shard is not None:
                raise CacheStoreError("a generation that was written into cannot be installed; commit it")
            info = self.backend.install(self.token)
        except BaseException:
            self.abort()
            raise
        return self._committed(info)

    def _committed(self, info: GenerationInfo) -> GenerationInfo:
        """The generation is published: nothing left to abort, the writer lease goes."""
        self.state = "committed"
        self._finalizer.detach()
        self._lease.release()
        return info

    def abort(self) -> None:
        """Discard everything written (idempotent)."""
        self._end("aborted", self.backend.discard)

    def _end(self, state: str, finish: Callable[[StagingToken], None]) -> None:
        """Leave the open state for `state`: close this process's shard, `finish(token)` (keep or
        discard the staging area), give the lease back. A no-op unless open."""
        if self.state != "open":
            return
        self.state = state
        try:
            if self._shard is not None:
                self._shard.close()
        except Exception:  # what it could not flush is not kept, and must not mask the cause
            pass
        self._finalizer.detach()
        try:
            finish(self.token)
        finally:
            self._lease.release()
