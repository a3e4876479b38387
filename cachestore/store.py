"""The public store object: generations of samples under one path."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable, TypeAlias

import xxhash

from .backends import get_backend
from .backends.base import Backend, GenerationInfo, ProducerRecord, StoreMeta
from .backends.spec import StoreSpec
from .errors import (CacheStoreError, CorruptSampleError, FingerprintMismatchError, GenerationNotFoundError,
                     MalformedFileError, NotAStoreError, StoreLockedError)
from .guard import untrusted
from .guard.locking import SharedWriterLock, WriterLease, WriterLock, lock_holder
from .guard.trust import Trust, warn_if_shared
from .pruning import Removed, prune_store
from .read.readable import ReadableStore
from .read.reader import Reader
from .space.budget import Budget
from .space.disk import allocated_bytes, free_bytes, parse_size
from .space.room import memory_room, sample_limit
from .write.shared import SharedWriter
from .write.writer import GenerationWriter

#: 2: LMDB generations of fixed-shape samples are stored by column (stores made as 1 keep writing
#: records, which the cachestore that made them reads; see cachestore/backends/lmdb_columns.py).
FORMAT_VERSION = 2
COMPRESSIONS = (None, "zstd")
#: RAM the memory backend leaves to everything else.
RAM_RESERVE_FRACTION = 0.10
#: What identifies the producer of a store's samples (the loader's dataset fingerprint): JSON values.
Fingerprint: TypeAlias = dict[str, object]


def _read_existing_backend(path: str) -> str | None:
    try:
        meta = untrusted.parse_store_meta(untrusted.read_document(Path(path) / "store.json"), path)
    except (OSError, ValueError):  # a symlinked or malformed store.json is refused by read_meta
        return None
    backend = meta.get("backend")
    return backend if isinstance(backend, str) else None


def sample_bytes(value: int | str | None) -> int | None:
    """``max_sample_bytes`` as bytes (``None``: not given), checked."""
    limit = parse_size(value)
    if limit is not None and limit < 1:
        raise ValueError(f"max_sample_bytes must be a size >= 1, got {value!r}")
    return limit


class Store(ReadableStore):
    """Generations of samples under one path, which this process may also write (see
    :class:`~cachestore.read.readable.ReadableStore`). Create with :func:`open_store`."""

    def __init__(self, path: str | os.PathLike[str], backend: str | None = None, *, compression: str | None = None,
                 disk_budget: int | str | None = None, allow_pickle: bool = False, readonly: bool = False,
                 fingerprint: Fingerprint | None = None, producer: dict[str, object] | None = None,
                 verify: bool = True, trusted_uids: Iterable[int] | None = None,
                 trusted_gids: Iterable[int] | None = None, max_sample_bytes: int | str | None = None) -> None:
        # "~/cache" means the home directory, as for every tool that takes a path.
        self.path = os.path.expanduser(os.fspath(path))
        # An in-RAM store only borrows the path as a name: files there are none of its business.
        in_ram = backend is not None and not get_backend(backend).persistent
        existing = None if in_ram else _read_existing_backend(self.path)
        if backend is None:
            backend = existing or "memmap"
        elif existing is not None and existing != backend:
            raise ValueError(f"{self.path} holds a {existing!r} store; open it with backend={existing!r} "
                             f"(or use another path for a {backend!r} store)")
        if compression not in COMPRESSIONS:
            raise ValueError(f"compression must be None or 'zstd', got {compression!r}")
        self.disk_budget = parse_size(disk_budget)
        self.readonly = readonly
        self.allow_pickle = allow_pickle
        self.verify_reads = verify
        limit = sample_bytes(max_sample_bytes)
        if limit is None:
            limit = sample_limit(self.disk_budget)
        self.spec = StoreSpec.of(self.path, backend, compression, allow_pickle, verify,
                                 Trust.of(trusted_uids, trusted_gids), limit)
        try:
            self.backend: Backend = self.spec.open_backend()
        except ValueError as exc:  # an unknown name
            if backend != existing:
                raise
            raise MalformedFileError(f"{Path(self.path) / 'store.json'} names backend {backend!r}: {exc} "
                                     "(a store of a newer cachestore, or of a backend registered elsewhere "
                                     "with register_backend?)") from None
        self.backend_name = backend
        self.compression = compression
        if self.backend.persistent:
            warn_if_shared(self.path)
        self._lock = WriterLock(self.path) if self.backend.persistent else None
        self._lease: WriterLease | None = None
        meta: StoreMeta | None = self.backend.read_meta()
        if meta is None:
            if readonly:
                raise NotAStoreError(f"{self.path} is not a cachestore store (no store.json); "
                                     "check the path, it is the loader's cache prefix")
            meta = {"format": FORMAT_VERSION, "backend": backend, "compression": compression,
                    "fingerprint": fingerprint, "producer": producer, "created": time.time()}
            self.backend.write_meta(meta)
        else:
            stored_format = meta.get("format", 0)  # an int (untrusted.parse_store_meta)
            if isinstance(stored_format, int) and stored_format > FORMAT_VERSION:
                raise CacheStoreError(f"{self.path} was written by a newer cachestore (format {meta['format']}); "
                                      "upgrade cachestore to read it")
            stale = fingerprint is not None and meta.get("fingerprint") not in (None, fingerprint)
            if (stale and not readonly and not any(g.committed for g in self.backend.generations())
                    and lock_holder(self.path) is None):
                stale = False  # nothing committed, nobody writing: the new producer takes over
                meta = {**meta, "fingerprint": None}
            if stale:
                raise FingerprintMismatchError(
                    f"{self.path} holds samples produced by something else:\n"
                    f"  stored:    {meta.get('fingerprint')}\n  requested: {fingerprint}\n"
                    "Use another path (prefix) for this dataset, or remove the old samples with "
                    f"`cachestore prune {self.path} --keep 0` (or delete the directory)"
                )
            if fingerprint is not None and meta.get("fingerprint") is None and not readonly:
                meta = {**meta, "fingerprint": fingerprint, "producer": producer}
                self.backend.write_meta(meta)
        self.meta = meta

    # pickling ------------------------------------------------------------------
    def __reduce__(self) -> tuple[Callable[[StoreSpec, int | None, bool], Store], tuple[StoreSpec, int | None, bool]]:
        if not self.backend.persistent:
            raise TypeError("a memory store lives in one process and cannot be pickled; "
                            "pickle its reader() instead, or use the memmap backend")
        return (_reopen, (self.spec, self.disk_budget, self.readonly))

    @property
    def writable(self) -> bool:
        """Whether this process may write generations here (not opened ``readonly``)."""
        return not self.readonly

    @property
    def fingerprint(self) -> Fingerprint | None:
        """What produced the samples, as recorded in ``store.json`` (``None``: not recorded)."""
        fingerprint = self.meta.get("fingerprint")
        return fingerprint if isinstance(fingerprint, dict) else None

    # writing -------------------------------------------------------------------
    def writer(self, generation: int, num_samples: int | None = None, resume: bool = False) -> GenerationWriter:
        """Open generation `generation` for writing (one writer per store at a time).

        Parameters
        ----------
        generation
            Id of the generation to write; must not be committed already.
        num_samples
            Expected number of samples. Enables the early budget projection and
            makes commit check that exactly these indices were written.
        resume
            Adopt a partial generation `generation` left by a writer that
            crashed or called :meth:`GenerationWriter.keep`, when it was
            produced for the same fingerprint and `num_samples` (a store
            without a fingerprint never adopts): ``writer.present()`` then
            lists the indices already written, which must not be written again.

        Raises
        ------
        StoreLockedError
            Another live process (or writer) is writing this store.
        """
        if self.readonly:
            raise CacheStoreError(f"{self.path} was opened readonly=True; it cannot be written")
        lease = self._take_lease()
        try:
            return GenerationWriter(self.spec, self.backend, generation, num_samples, lease, self.budget,
                                    record=self.staging_record(num_samples), resume=resume)
        except BaseException:
            lease.release()
            raise

    def join(self, generation: int, num_samples: int) -> SharedWriter:
        """Write generation `generation` together with every other process that writes it.

        The processes (ranks of a node, concurrent jobs) share one staging area
        and claim each sample before computing it, so each is written once;
        the first one to leave with every sample in commits (see
        :mod:`cachestore.write.shared`). Needs a
        fingerprint (what makes the other writers' samples this producer's)
        and a backend that supports it (memmap).

        Raises
        ------
        GenerationCommitted
            The generation was committed meanwhile: read it.
        StoreLockedError
            A writer that does not share (:meth:`writer`) holds the store.
        """
        if self.readonly:
            raise CacheStoreError(f"{self.path} was opened readonly=True; it cannot be written")
        record = self.staging_record(num_samples)
        if record["fingerprint"] is None or not self.backend.supports_shared_write:
            raise CacheStoreError(f"{self.path}: generations are written together only by a {self.backend_name} "
                                  "store with a fingerprint; use writer()" if record["fingerprint"] is None else
                                  f"the {self.backend_name} backend cannot be written by several processes "
                                  "together; use writer()")
        if self.writing:
            raise StoreLockedError(f"store {self.path} already has an open writer in this process")
        Path(self.path).mkdir(parents=True, exist_ok=True)
        lock = SharedWriterLock(self.path)
        lock.acquire()
        self._lease = lease = WriterLease(lock)
        return SharedWriter(self.spec, self.backend, generation, num_samples, lease, self.budget, record,
                            self._current_fingerprint)

    def _current_fingerprint(self) -> object:
        """The hash of the fingerprint ``store.json`` holds now (another process may have rewritten it);
        one removed with the rest of the store (``rm -rf``) is written again, as this store's."""
        meta = self.backend.read_meta()
        if meta is None:
            self.backend.write_meta(self.meta)
        else:
            self.meta = meta
        return self.staging_record(None)["fingerprint"]

    def staging_record(self, num_samples: int | None) -> ProducerRecord:
        """What a staging area records of its producer, so only the same producer adopts it."""
        fingerprint = self.fingerprint
        digest = None if fingerprint is None else xxhash.xxh3_64_hexdigest(
            json.dumps(fingerprint, sort_keys=True, default=str).encode())
        return {"fingerprint": digest, "num_samples": num_samples, "compression": self.compression}

    def partial_record(self) -> ProducerRecord | None:
        """What the partial generations of this store's producer have in common (``None``: no fingerprint)."""
        fingerprint = self.staging_record(None)["fingerprint"]
        return None if fingerprint is None else {"fingerprint": fingerprint}

    @property
    def writing(self) -> bool:
        """Whether this process holds the store's writer lease now."""
        return self._lease is not None and not self._lease.released

    def _take_lease(self) -> WriterLease:
        if self.writing:
            raise StoreLockedError(f"store {self.path} already has an open writer in this process")
        if self._lock is not None:
            Path(self.path).mkdir(parents=True, exist_ok=True)
            self._lock.acquire()
        self._lease = WriterLease(self._lock)
        return self._lease

    def lock_holder(self) -> int | None:
        """Pid of the live process writing this store, else ``None``.

        -1 when it has not written its pid yet;
        :data:`~cachestore.guard.locking.SHARED_WRITERS` (-2) when processes write
        one generation together (:meth:`join`), and no single pid is the writer.
        """
        if self.writing:
            return os.getpid()
        return lock_holder(self.path) if self.backend.persistent else None

    def budget(self, reclaim: int = 0) -> Budget:
        """Bytes a new generation may take now: the budget less committed generations, capped by free space.

        `reclaim`: bytes already taken by the generation itself (an adopted
        partial one), counted as free.

        Returns
        -------
        Budget
            ``available`` is ``None`` when nothing limits it.
        """
        used = sum(g.nbytes if self.backend.persistent else g.stored_bytes
                   for g in self.generations() if g.committed)
        if self.backend.persistent:
            free, unit = free_bytes(self.path) + reclaim, "disk"
        else:
            # What this process may still take: a container's memory limit, not the host's free memory.
            free, unit = max(0, int(memory_room() * (1 - RAM_RESERVE_FRACTION))), "memory"
        available = free if self.disk_budget is None else min(free, max(0, self.disk_budget - used))
        return Budget(available=available, limit=self.disk_budget, used=used, where=f"store {self.path}", unit=unit)

    # reading -------------------------------------------------------------------
    def generations(self) -> list[GenerationInfo]:
        """Committed generations, staging areas and damaged generations, oldest first.

        A damaged generation (``info.damaged`` says why, naming the file) has
        ``committed=False``: treat it as missing. Writing its id replaces it,
        :meth:`prune` removes it, :meth:`reader` of it raises
        :class:`CorruptSampleError`. Some damage is only found when a
        generation is opened (see :meth:`Backend.open_generation`).
        """
        return self.backend.generations()

    def reader(self, generation: int | None = None) -> Reader:
        """A read-only view of a committed generation (the newest when ``None``)."""
        if generation is not None:
            return Reader(self.spec, generation, self.backend.open_generation(generation))
        while True:
            newest = self.latest()
            if newest is None:
                damaged = [g.id for g in self.generations() if g.damaged]
                why = f" (damaged, not served: generation {', '.join(map(str, damaged))})" if damaged else ""
                raise GenerationNotFoundError(f"store {self.path} has no committed generation yet{why}")
            try:
                return Reader(self.spec, newest, self.backend.open_generation(newest))
            except GenerationNotFoundError:
                # Pruned between listing and opening: a newer one was committed; take that.
                if self.latest() in (None, newest):
                    raise

    def verify(self) -> list[CorruptSampleError]:
        """Check every checksum of every committed generation; one error per bad sample,
        and one (``index=None``) per damaged generation."""
        bad: list[CorruptSampleError] = []
        for info in self.generations():
            if info.committed or info.damaged:
                try:
                    data = self.backend.open_generation(info.id)
                except CorruptSampleError as exc:
                    exc.generation = info.id  # the whole generation: index stays None
                    bad.append(exc)
                    continue
                try:
                    bad.extend(data.verify_all())
                finally:
                    if self.backend.persistent:
                        data.close()
        return bad

    def usage(self) -> int:
        """Bytes the store takes on disk (allocated blocks; 0 for memory)."""
        return allocated_bytes(self.path) if self.backend.persistent else 0

    # maintenance ---------------------------------------------------------------
    def prune(self, keep: int = 1, dry_run: bool = False, max_bytes: int | str | None = None,
              partial: bool = False) -> list[Removed]:
        """Remove committed generations beyond the newest `keep`, and crash debris.

        Parameters
        ----------
        keep
            Number of newest committed generations to keep.
        dry_run
            Only report what would be removed.
        max_bytes
            Then remove the oldest remaining generations until the store takes
            at most this many bytes.
        partial
            Also remove partial generations of this store's producer (staging
            areas kept by a writer that stopped, or left by one that crashed,
            with this store's fingerprint), which are otherwise kept for the
            next writer of their generation to adopt. Those of another
            fingerprint are always removed.

        Returns
        -------
        list of Removed
            What was removed (or would be). Damaged generations go whatever
            `keep` says (while another process writes, the next prune removes
            them). Staging areas of a live writer and rotation windows of live
            processes are never touched.
        """
        return prune_store(self, keep, dry_run, max_bytes, partial)

    def close(self) -> None:
        """Release the store (a memory store frees its arrays)."""
        if self._lock is not None and not self.writing:
            self._lock.release()
        if not self.backend.persistent:
            self.backend.close()

    def __repr__(self) -> str:
        return f"Store({self.path!r}, backend={self.backend_name!r})"


def _reopen(spec: StoreSpec, disk_budget: int | None, readonly: bool) -> Store:
    return Store(spec.path, spec.backend, compression=spec.compression, disk_budget=disk_budget,
                 allow_pickle=spec.allow_pickle, readonly=readonly, verify=spec.verify, trusted_uids=spec.trust.uids,
                 trusted_gids=spec.trust.gids, max_sample_bytes=spec.max_sample_bytes)


def open_local(path: str | os.PathLike[str], backend: str | None = None, *, compression: str | None = None,
               disk_budget: int | str | None = None, allow_pickle: bool = False, readonly: bool = False,
               fingerprint: Fingerprint | None = None, producer: dict[str, object] | None = None,
               verify: bool = True, trusted_uids: Iterable[int] | None = None,
               trusted_gids: Iterable[int] | None = None, max_sample_bytes: int | str | None = None) -> Store:
    """Open (or create) the local store at `path` (:func:`cachestore.open_store` also opens a URL).

    Parameters
    ----------
    path
        Directory of the store (the loader's ``prefix``); created if missing
        unless `readonly`. For ``backend="memory"`` only a name.
    backend
        ``"memmap"`` (default for new stores), ``"lmdb"``, ``"memory"`` or a
        name given to :func:`register_backend`. ``None`` opens an existing store
        with the backend it was created with.
    compression
        ``None`` or ``"zstd"`` (per record) for what this process writes.
    disk_budget
        Bytes (or ``"20GB"``) the whole store may take. ``None``: the free space
        of the file system minus a reserve (free RAM for ``memory``).
    allow_pickle
        Store samples of unsupported types with pickle instead of refusing them, and load such
        samples when reading. Loading one runs code of whoever wrote the store: pass it only for
        a store whose writer you trust (without it, reading one is :class:`PickleRefusedError`;
        verifying checks it without loading it).
    readonly
        Never create or write; a missing store raises :class:`NotAStoreError`.
    fingerprint
        What produced the samples; opening a store recorded with another
        fingerprint raises :class:`FingerprintMismatchError`.
    producer
        Free-form description of the producer, shown by ``cachestore inspect``.
    verify
        Check each record's checksum when it is read.
    trusted_uids, trusted_gids
        Users (and groups) besides this process's own user whose generations and staging areas
        are read, adopted and joined; another user's are damage, replaced by this process's own
        (see the README's "Security").
    max_sample_bytes
        Bytes (or ``"64MB"``) one sample may take when read back: a record decompressing to more, or
        a generation whose schema says more, is damage. Default: derived from the schema and the
        budget: `disk_budget` (without one, a quarter of this process's memory room), and in a
        generation whose samples all share one schema, that schema's bytes.

    Returns
    -------
    Store
    """
    return Store(path, backend, compression=compression, disk_budget=disk_budget, allow_pickle=allow_pickle,
                 readonly=readonly, fingerprint=fingerprint, producer=producer, verify=verify,
                 trusted_uids=trusted_uids, trusted_gids=trusted_gids, max_sample_bytes=max_sample_bytes)
