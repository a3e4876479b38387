"""The backend interface: how one generation's samples are written and read.

A backend is three small objects:

* :class:`Backend` - the catalog of one store: which generations exist, how a
  staging area is created, committed (atomically) or discarded.
* :class:`ShardWriter` - writes samples into a staging area. Backends that set
  ``supports_multiprocess_write`` accept several shard writers, in several
  processes, filling one generation together (each index once); that is how
  loader workers write without funnelling bytes through one process.
* :class:`~.reading.GenerationData` - read access to one committed generation
  (in :mod:`.reading`).

Concrete helpers built on the abstract methods (the budget checks of every put)
live here so a backend only implements storage. Around it:
:class:`~.reading.GenerationData`, with its index checks and generic batch read,
and :class:`~.reading.StagingData` are in :mod:`.reading`, the budget is
:mod:`cachestore.space.budget`, checksums :mod:`cachestore.format.checksums`, batch helpers
:mod:`.batch`, staging names and producer records :mod:`.staging`. The
conformance suite in ``tests/cachestore/test_conformance.py`` runs unchanged
against every backend.

Callers ask a backend what it can do through its capability flags
(``persistent``, ``supports_multiprocess_write``, ``supports_shared_write``,
``supports_zero_copy``, ``supports_streaming``), never its name, so a backend
plugged in with :func:`cachestore.register_backend` is judged as the built-in ones.
"""

from __future__ import annotations

import dataclasses
import time
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import ClassVar, Collection, TypeAlias

import numpy as np
import numpy.typing as npt

from ..errors import BudgetExceededError, CacheStoreError
from ..format import codec
from ..format.codec import Leaf, Sample, TreeDef
from ..guard.trust import OWN, Trust
from ..space.budget import Budget
from .reading import GenerationData, StagingData

#: A store's metadata document (``store.json``): plain JSON values.
StoreMeta: TypeAlias = dict[str, object]
#: What a staging area records of its producer (``Store.staging_record``): the generation, the
#: hash of the store's fingerprint, the sample count, the compression; plain JSON values.
ProducerRecord: TypeAlias = dict[str, object]


@dataclass(frozen=True)
class GenerationInfo:
    """What a store knows about one generation: committed, staging, or damaged.

    ``damaged`` is ``None`` for a sound generation; for a generation directory
    that cannot be served it says why, naming the file (a missing or garbage
    manifest, a data, index or schema file missing, truncated or a symlink).
    A damaged generation has ``committed=False``: ``Store.latest()`` and every
    "is generation g committed?" test skip it, ``Store.prune`` removes it
    whatever ``keep`` says, and a writer of the same id replaces it.
    """

    id: int
    num_samples: int
    nbytes: int
    committed: bool
    created: float
    path: str | None = None
    layout: str | None = None
    raw_bytes: int = 0
    stored_bytes: int = 0
    owner_pid: int | None = None
    damaged: str | None = None
    extra: dict[str, object] = field(default_factory=dict, compare=False)

    @property
    def compression_ratio(self) -> float | None:
        """Raw sample bytes per stored byte (``None`` when nothing is stored)."""
        return self.raw_bytes / self.stored_bytes if self.stored_bytes else None


@dataclass(frozen=True)
class StagingToken:
    """Names a staging area and how shards write into it; small and picklable, so worker
    processes get one (inside a :class:`cachestore.ShardSpec`).

    `path` is the staging directory (``memory:<n>`` for an in-RAM store). `budget` is ``None``
    only between :meth:`Backend.adopt` and :meth:`Backend.with_budget`.
    """

    path: str
    generation: int
    budget: Budget | None
    num_samples: int | None
    compress: bool
    allow_pickle: bool
    #: A shared staging area (:mod:`cachestore.write.shared`): its writers claim each sample first.
    shared: bool = False

    def write_budget(self) -> Budget:
        """The budget shard writers check (an adopted token gets it from :meth:`Backend.with_budget`)."""
        if self.budget is None:
            raise CacheStoreError(f"staging area {self.path} has no budget yet: an adopted token gets one "
                                  "from Backend.with_budget before anything is written")
        return self.budget


class ShardWriter(ABC):
    """Writes samples of one generation; one per process (or per worker).

    Subclasses implement :meth:`_write` and :meth:`_flush`; the base class
    flattens samples, enforces the budget and keeps the byte counts.
    """

    #: Samples (or bytes) after which the generation size is projected.
    PROJECT_AFTER_SAMPLES = 8
    PROJECT_AFTER_BYTES = 8 << 20
    #: Bytes written between two measurements of real allocated usage.
    USAGE_CHECK_BYTES = 64 << 20

    def __init__(self, generation: int, budget: Budget, num_samples: int | None,
                 compress: bool, allow_pickle: bool) -> None:
        self.generation = generation
        self.budget = budget
        self.num_samples = num_samples
        self.compress = compress
        self.allow_pickle = allow_pickle
        self.count = 0
        self.raw_bytes = 0
        self.stored_bytes = 0
        self._projected = False
        self._since_check = 0
        self.closed = False

    def put(self, index: int, sample: Sample) -> None:
        """Store `sample` at `index` (an int in ``0..num_samples-1``)."""
        if self.closed:
            raise ValueError("this shard writer is closed")
        if isinstance(index, bool) or not isinstance(index, (int, np.integer)) or index < 0:
            raise IndexError(f"sample index must be a non-negative int, got {index!r}")
        if self.num_samples is not None and index >= self.num_samples:
            raise IndexError(f"index {index} out of range for a generation of {self.num_samples} samples")
        treedef, leaves = codec.flatten(sample, self.allow_pickle)
        try:
            stored = self._write(int(index), treedef, leaves)
            self.count += 1
            self.raw_bytes += sum(leaf.nbytes for leaf in leaves)
            self.stored_bytes += stored
            self._since_check += stored
            self._check_budget()
        except BudgetExceededError:
            self._give_up()
            raise

    def _check_budget(self) -> None:
        # Every put: what this shard stored so far (a comparison, no syscall). Without it a
        # writer that does not know its sample count could fill the disk between two usage checks.
        self.budget.check_usage(self.generation, self.stored_bytes)
        if not self._projected and self.num_samples is not None and (
            self.count >= self.PROJECT_AFTER_SAMPLES or self.stored_bytes >= self.PROJECT_AFTER_BYTES
        ):
            self._projected = True
            self.budget.check_projection(self.generation, self.stored_bytes / self.count, self.num_samples)
        if self._since_check >= self.USAGE_CHECK_BYTES:
            self._since_check = 0
            self.budget.check_usage(self.generation, self.usage())

    def flush(self) -> None:
        """Make everything put so far durable enough to survive this process dying."""
        if not self.closed:
            try:
                self._flush()
            except BudgetExceededError:
                self._give_up()
                raise

    def _give_up(self) -> None:
        """After a budget error: close now, writing nothing more.

        The generation cannot be finished, and until its files are closed the
        blocks of the removed staging area stay allocated: a full disk would
        stay full for as long as this writer object lives.
        """
        if not self.closed:
            self.closed = True
            try:
                self._close()
            except OSError:
                pass  # closing what failed to write: the budget error is the one to report

    def close(self) -> None:
        """Flush and release files (idempotent)."""
        if not self.closed:
            try:
                self._flush()
            finally:
                # Even when the flush fails (disk full): an LMDB env or fd left open keeps the
                # deleted staging files allocated until this object is garbage-collected.
                self._close()
                self.closed = True

    @abstractmethod
    def _write(self, index: int, treedef: TreeDef, leaves: list[Leaf]) -> int:
        """Write one flattened sample; return the bytes it takes in storage."""

    @abstractmethod
    def _flush(self) -> None:
        """Persist buffered records and their index entries."""

    def _close(self) -> None:
        """Release resources after the final flush."""

    def usage(self) -> int:
        """Bytes the whole staging area takes now (all shards)."""
        return self.stored_bytes


def missing_generation(generation: int, where: str, staging: bool) -> str:
    """Why `generation` of the store `where` cannot be opened: it is not committed there (any more)."""
    text = (f"generation {generation} of {where} is not committed there: it was never committed, or was "
            "removed since (by `cachestore prune`, or by the writer that committed a newer one)")
    if staging:
        text += f"; a staging area of generation {generation} is there (being written, or kept by an interrupted run)"
    return text


class Backend(ABC):
    """The catalog of one store: generations, staging, commit, removal.

    Rules every backend follows (the conformance suite checks them):

    * **Each index exactly once.** A generation commits only when it holds
      every index ``0..n-1`` once. An index put twice - by one shard writer or
      by two - is refused at :meth:`commit` with :class:`CacheStoreError`
      (the staging area is then discarded), on every backend, even though
      LMDB or a dict could silently keep the last value: a duplicate means a
      writer bug or a re-run batch the owner should have dropped, and which
      copy wins would depend on the backend and on timing. The one sanctioned
      rewrite is after :meth:`discard_shard_tail`: the loader drops what a dead
      worker wrote for batches never delivered, and the replacement worker
      writes those indices again.
    * **Budget.** Each shard counts its stored bytes on every put against the
      budget fixed when the writer opened (and measures allocated blocks every
      ``USAGE_CHECK_BYTES``); :meth:`commit` checks the allocated size of the
      whole staging area, so a generation over budget never commits, however
      many shards wrote it.
    """

    name: ClassVar[str]
    #: Several :class:`ShardWriter` in several processes may fill one generation.
    supports_multiprocess_write: ClassVar[bool] = True
    #: ``read(i, copy=False)`` returns views of storage without copying.
    supports_zero_copy: ClassVar[bool] = False
    #: Data lives in files under the store path (so other processes can read it).
    persistent: ClassVar[bool] = True
    #: Several processes can write one staging area together, claiming samples (:mod:`cachestore.write.shared`).
    supports_shared_write: ClassVar[bool] = False
    #: A fixed-layout generation larger than memory is best read with explicit I/O
    #: (``GenerationData.read_range``/``read_rows``: large reads ahead of the loop), not page faults.
    supports_streaming: ClassVar[bool] = False

    def __init__(self, root: str, *, compression: str | None, allow_pickle: bool, verify: bool) -> None:
        self.root = root
        self.compression = compression
        self.allow_pickle = allow_pickle
        self.verify = verify
        #: Whose generations and staging areas are read besides this user's (set by the spec that opens it).
        self.trust: Trust = OWN
        #: The most bytes one sample may take (``max_sample_bytes``; set by the spec that opens it).
        self.max_sample_bytes: int | None = None

    # metadata -----------------------------------------------------------
    @abstractmethod
    def read_meta(self) -> StoreMeta | None:
        """The store's metadata document, ``None`` when there is no store yet."""

    @abstractmethod
    def write_meta(self, meta: StoreMeta) -> None:
        """Replace the metadata document atomically."""

    # catalog ------------------------------------------------------------
    @abstractmethod
    def generations(self) -> list[GenerationInfo]:
        """Committed generations and staging areas, oldest first."""

    @abstractmethod
    def begin(self, generation: int, budget: Budget, num_samples: int | None) -> StagingToken:
        """Create a staging area; return a picklable token naming it."""

    @abstractmethod
    def shard_writer(self, token: StagingToken, shard_id: str) -> ShardWriter:
        """A writer into the staging area `token`."""

    def discard_shard_tail(self, token: StagingToken, shard_id: str, keep: int) -> None:
        """Forget all but the first `keep` index entries of a shard whose writer died."""

    @abstractmethod
    def commit(self, token: StagingToken, num_samples: int | None, extra: dict[str, object]) -> GenerationInfo:
        """Validate and atomically publish the staging area as a committed generation.

        Raises :class:`CacheStoreError` when an index is missing or was written
        more than once, :class:`BudgetExceededError` when the generation takes
        more than its budget allows.
        """

    def install(self, token: StagingToken) -> GenerationInfo:
        """Publish a staging area that holds a whole committed generation's files (fetched from a
        remote and verified), as :meth:`commit` publishes one it merged."""
        raise CacheStoreError(f"the {self.name} backend cannot install a generation fetched from a remote")

    @abstractmethod
    def discard(self, token: StagingToken) -> None:
        """Remove a staging area and everything in it."""

    @abstractmethod
    def open_generation(self, generation: int) -> GenerationData:
        """Read access to a committed generation.

        Raises :class:`GenerationNotFoundError` when there is none, and
        :class:`CorruptSampleError` (``index=None``, ``generation`` set) naming
        the file when it is damaged: what listing reports in
        ``GenerationInfo.damaged``, plus what only opening finds (size and
        count checks against the manifest; never a full read).
        """

    @abstractmethod
    def remove_generation(self, generation: int) -> int:
        """Delete a committed generation; return the bytes freed."""

    def clear_damaged(self, generation: int) -> bool:
        """Make way for writing `generation` again: remove it when it is committed but damaged.

        Only for the one who may write `generation` now (the holder of the writer lock, or of the
        commit lock of processes writing it together), so nobody replaces it meanwhile.

        Returns
        -------
        bool
            ``True`` when a sound generation `generation` is committed (it stays).
        """
        return any(g.id == generation and g.committed for g in self.generations())

    def debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
               keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        """Crash leftovers ``(path, bytes)``, except those of live writer `keep_pid`, the staging
        areas in `keep_paths`, and partial generations whose producer record matches `keep_record`
        (any generation; see :meth:`adopt`)."""
        return []

    def remove_debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
                      keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        """Remove what :meth:`debris` lists; return it."""
        return []

    # partial generations --------------------------------------------------
    def record_staging(self, token: StagingToken, record: ProducerRecord) -> None:
        """Remember who produces the staging area `token` (generation, fingerprint hash, sample count)."""

    def keep(self, token: StagingToken) -> None:
        """Leave the staging area `token` for a later writer of the same generation (see :meth:`adopt`)."""
        self.discard(token)  # a backend that cannot keep one discards it

    def adopt(self, generation: int, num_samples: int | None, record: ProducerRecord) -> StagingToken | None:
        """Take over a partial staging area of `generation` whose producer record matches `record`.

        Only called by the holder of the writer lease, so no staging area is
        being written by anyone else. Returns the token (its ``budget`` still
        to be set, :meth:`with_budget`) or ``None`` when there is none to adopt.
        """
        return None

    def with_budget(self, token: StagingToken, budget: Budget) -> StagingToken:
        """`token` with its budget replaced (an adopted token gets one after the debris is gone)."""
        return dataclasses.replace(token, budget=budget)

    def present(self, token: StagingToken) -> npt.NDArray[np.int64]:
        """Sorted indices already written into the staging area `token` (a numpy int64 array)."""
        return np.zeros(0, dtype=np.int64)

    def keep_logged(self, token: StagingToken, tags: npt.NDArray[np.uint32]) -> None:
        """Before a shared area's commit: keep, of every index, only the copy its shard's tag names
        (``tags[i] == claims.shard_tag(shard id)``)."""
        raise CacheStoreError(f"the {self.name} backend cannot be written by several processes together")

    def open_staging(self, token: StagingToken) -> StagingData | None:
        """Read access to the samples written so far into `token` (``None`` when not supported here)."""
        return None

    def close(self) -> None:
        """Release everything the backend holds."""

    def now(self) -> float:
        """The time a backend stamps on what it creates."""
        return time.time()
