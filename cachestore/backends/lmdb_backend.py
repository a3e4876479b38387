"""LMDB backend: one LMDB environment per generation directory.

Dropping a generation is deleting its directory. Choices, and the failure
each avoids:

* ``writemap=False``: with a writable map, a full disk is a SIGBUS that kills
  the process; with ordinary writes it is an ``MDB_MAP_FULL``/``ENOSPC`` error.
* Environments are opened lazily and per pid: an LMDB handle must never cross
  a ``fork``.
* Shard writers buffer records and write them in one short transaction per
  flush, because an LMDB write transaction serialises every writer process.
* Committed generations are opened ``readonly=True, lock=False``: nobody
  writes them any more, and no lock file is needed (or left behind).
* Values are ``checksum (8 bytes) | record``; keys are big-endian indices so
  the key order is the index order.
* Each shard also appends the indices it stored to ``keys-<shard>.bin``
  (after its transaction commits). LMDB keeps one value per key, so without
  that log an index written twice would pass unseen; with it, commit refuses
  duplicates like every backend (see :class:`~.base.Backend`), and
  ``discard_shard_tail`` can forget what a dead worker wrote, like memmap.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import lmdb
import numpy as np
import numpy.typing as npt

from . import lmdb_columns
from ..errors import BudgetExceededError, CacheStoreError, CorruptSampleError
from ..format import codec, records
from ..format.checksums import checksum
from ..format.codec import Leaf, Sample, TreeDef
from ..guard import safefs
from ..guard.safefs import fsync_dir, write_json_atomic
from ..guard.untrusted import parse_shard_stats, read_document
from ..space.budget import Budget
from ..space.disk import allocated_bytes, is_out_of_space, out_of_space
from .base import ShardWriter, StagingToken
from .directory import DirectoryBackend
from .lmdb_generation import (ENVS, ENVS_LOCK, KEY, SUM, LmdbGeneration, acquire_env, open_env, record_key,
                              release_env)
from .manifest import Manifest
from .reading import GenerationData, StagingData
from .staging import check_complete, in_range

MAP_SIZE = 1 << 40  # address space only: the file grows with what is written
FLUSH_BYTES = 16 << 20
#: Size of a staging area's lock.mdb, allocated up front (LMDB needs 8 KiB for its default 126 readers).
LOCK_FILE_BYTES = 64 << 10
#: The store format (``store.json``) from which generations of fixed-shape samples are stored by column.
COLUMNS_FORMAT = 2


_LOG = np.dtype("<i8")  # one entry of a shard's keys-<shard>.bin


def _keys_file(staging: Path, shard_id: str) -> Path:
    return staging / f"keys-{shard_id}.bin"


def _append(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:  # a short write when the disk fills: the next call raises ENOSPC
        view = view[os.write(fd, view):]


def _disk_full(path: Path, needed: int) -> bool:
    """Whether the file system of `path` has less than `needed` bytes left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < needed


def _lmdb_error(exc: Exception, staging: Path, needed: int, doing: str) -> Exception:
    """The error to raise for an ``lmdb.Error`` while writing into `staging` (`exc` itself if none fits)."""
    # LMDB reports a full disk at commit as a bare EIO ("Input/output error"): look at the disk.
    if "No space" in str(exc) or _disk_full(staging, needed):
        return BudgetExceededError(f"disk full while {doing} into {staging}: {exc}")
    if not staging.is_dir():
        return CacheStoreError(f"staging area {staging} is gone (its generation was aborted or pruned) "
                               f"while {doing}: {exc}")
    return exc


def _allocate_lock_file(staging: Path, create: bool = False) -> None:
    """Give the staging area's ``lock.mdb`` its disk blocks before this process opens it.

    LMDB maps its lock file shared and writable and writes the reader table
    through the map: on a full disk, touching a page with no block behind it
    is a SIGBUS that kills the process (``writemap=False`` only covers the
    data file). With the blocks allocated first, a full disk is an ``ENOSPC``
    here instead. The owner sets the file's size (`create`) when it creates
    the staging area, before any process opens the environment, so every
    process sizes its reader table alike (LMDB keeps a lock file at least as
    large as it needs); each process then allocates it before opening, and
    the first one to find no room raises - inside the shard writer, where the
    loader applies ``on_budget_exceeded``.
    """
    path = staging / "lock.mdb"
    try:
        fd = safefs.open_nofollow(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644, "an LMDB lock file")
    except OSError as exc:
        if is_out_of_space(exc):  # not even an inode left
            raise out_of_space(exc, "creating the LMDB lock file", staging) from exc
        raise
    try:
        if create:
            os.ftruncate(fd, LOCK_FILE_BYTES)  # a size costs no blocks: this never fails for room
        os.posix_fallocate(fd, 0, LOCK_FILE_BYTES)
    except OSError as exc:
        if is_out_of_space(exc):
            if create:
                return  # the writers meet the full disk at their first flush
            raise out_of_space(exc, "allocating the LMDB lock file", staging) from exc
        # EOPNOTSUPP/EINVAL: no fallocate on this file system; LMDB uses the pages as they come.
        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
            raise
    finally:
        os.close(fd)


class LmdbShard(ShardWriter):
    """Writes one shard's records into the staging area's environment, a short transaction per flush."""

    def __init__(self, token: StagingToken, shard_id: str) -> None:
        super().__init__(token.generation, token.write_budget(), token.num_samples, token.compress,
                         token.allow_pickle)
        self.dir = Path(token.path)
        self.shard_id = shard_id
        self._env: lmdb.Environment | None = None
        self._env_pid = -1
        self._env_key = ("write", str(self.dir))
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_indices: list[int] = []
        self._pending_bytes = 0
        self._keys_fd: int | None = None
        # (record bytes, structure) every record of this shard shares, "mixed" once one differs:
        # the commit learns from the shards' stats, without reading a record, that a
        # generation's wide records share one layout (see lmdb_columns.RECORDS).
        self._layout: tuple[int, TreeDef] | str | None = None

    def _write(self, index: int, treedef: TreeDef, leaves: list[Leaf]) -> int:
        record = records.encode_record(treedef, leaves, self.compress)
        if self._layout is None:
            self._layout = (len(record), treedef)
        elif self._layout != "mixed" and self._layout != (len(record), treedef):
            self._layout = "mixed"
        self._pending.append((record_key(index), SUM.pack(checksum([record])) + record))
        self._pending_indices.append(index)
        self._pending_bytes += len(record)
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()
        return len(record) + SUM.size

    def _flush(self) -> None:
        if not self._pending:
            return
        try:
            self._write_pending()
        finally:
            # Written or not, these records are done with: after an error the generation is
            # discarded, and keeping them would only make close() try again, into a staging
            # area that is gone by then (an lmdb.Error in the next epoch instead of a clean start).
            self._pending = []
            self._pending_indices = []
            self._pending_bytes = 0
        layout = self._layout if isinstance(self._layout, str) or self._layout is None else \
            [self._layout[0], codec.treedef_to_json(self._layout[1])]
        stats = {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes, "count": self.count,
                 "layout": layout}
        write_json_atomic(self.dir / f"stats-{self.shard_id}.json", stats)  # out of space: BudgetExceededError

    def _write_pending(self) -> None:
        if self._env is None:
            if not self.dir.is_dir():
                raise CacheStoreError(f"staging area {self.dir} is gone (its generation was aborted or pruned)")
            _allocate_lock_file(self.dir)  # no room: BudgetExceededError, before LMDB could SIGBUS
        try:
            if self._env is None:
                self._env = acquire_env(self._env_key, lambda: open_env(
                    self.dir, map_size=MAP_SIZE, writemap=False, sync=False, metasync=False,
                    readahead=True, max_dbs=0, lock=True, create=False))  # never resurrect an aborted staging dir
                self._env_pid = os.getpid()
            with self._env.begin(write=True) as txn:
                for key, value in self._pending:
                    txn.put(key, value)
            if self._keys_fd is None:
                self._keys_fd = safefs.open_nofollow(_keys_file(self.dir, self.shard_id),
                                                     os.O_WRONLY | os.O_CREAT | os.O_APPEND)
            _append(self._keys_fd, np.asarray(self._pending_indices, dtype=_LOG).tobytes())
        except (lmdb.MapFullError, lmdb.DiskError) as exc:
            raise BudgetExceededError(f"no room to write generation {self.generation} into {self.dir}: {exc}") from exc
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, f"writing generation {self.generation}", self.dir) from exc
            raise
        except lmdb.Error as exc:
            err = _lmdb_error(exc, self.dir, self._pending_bytes, f"writing generation {self.generation}")
            if err is exc:
                raise
            raise err from exc

    def close(self) -> None:
        if not self.closed and self._pending and not self.dir.is_dir():
            # The generation was aborted (its staging removed): nothing to write the buffered
            # records into, and nothing to report - as a memmap shard writing into unlinked files.
            self._pending, self._pending_indices, self._pending_bytes = [], [], 0
        super().close()

    def _close(self) -> None:
        if self._keys_fd is not None:
            os.close(self._keys_fd)
            self._keys_fd = None
        if self._env is not None:
            self._env = None
            release_env(self._env_key, self._env_pid)

    def usage(self) -> int:
        return allocated_bytes(self.dir)


class LmdbBackend(DirectoryBackend):
    """Generations as LMDB environments, one per generation directory (see the module docstring).

    Records of every shard go into one environment per staging area; the commit
    rewrites fixed-shape samples by column (:mod:`.lmdb_columns`) when they fit that layout.
    """

    name = "lmdb"

    def begin(self, generation: int, budget: Budget, num_samples: int | None) -> StagingToken:
        token = super().begin(generation, budget, num_samples)
        try:
            _allocate_lock_file(Path(token.path), create=True)
        except BaseException:
            self.discard(token)
            raise
        return token

    def _shard(self, token: StagingToken, shard_id: str) -> ShardWriter:
        return LmdbShard(token, shard_id)

    def discard_shard_tail(self, token: StagingToken, shard_id: str, keep: int) -> None:
        # The records stay in LMDB; the replacement worker overwrites them (same keys).
        path = _keys_file(Path(token.path), shard_id)
        try:
            fd = safefs.open_nofollow(path, os.O_WRONLY)
        except FileNotFoundError:
            return
        try:
            os.ftruncate(fd, min(os.fstat(fd).st_size, keep * _LOG.itemsize))
        finally:
            os.close(fd)

    def _finalize(self, staging: Path, num_samples: int | None) -> Manifest:
        raw = stored = 0
        keys = np.zeros(0, dtype=np.int64)
        layouts = []
        for stats_file in staging.glob("stats-*.json"):
            stats = parse_shard_stats(read_document(stats_file), str(stats_file))
            raw += stats["raw_bytes"]
            stored += stats["stored_bytes"]
            if stats.get("count"):
                layouts.append(stats.get("layout", "unknown"))  # a shard of an older version: unknown
            stats_file.unlink()
        shared = layouts[0] if layouts and all(x == layouts[0] for x in layouts) else None
        one_layout = shared if isinstance(shared, list) else None  # [record bytes, structure]
        logged = []
        for log_file in sorted(staging.glob("keys-*.bin")):
            data = safefs.read_bytes(log_file)
            logged.append(np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG))
            log_file.unlink()
        # Every index as often as it was written: duplicates are refused here, as by every backend.
        n = check_complete(np.concatenate(logged) if logged else [], num_samples, f"generation in {staging}")
        try:
            if not (staging / "data.mdb").exists():
                # An empty generation, made here alone: no lock file (LMDB writes one through a mapping).
                env = open_env(staging, map_size=1 << 20, writemap=False, lock=False)
                env.close()
            else:
                _allocate_lock_file(staging)
                key = ("write", str(staging))  # shared with any shard writer of this process still open
                env = acquire_env(key, lambda: open_env(staging, map_size=MAP_SIZE, writemap=False,
                                                          readahead=False))
                try:
                    with env.begin() as txn:
                        keys = np.fromiter((KEY.unpack(k)[0] for k in txn.cursor().iternext(values=False)),
                                           dtype=np.int64)
                    env.sync(True)
                finally:
                    release_env(key, os.getpid())
        except lmdb.Error as exc:
            err = _lmdb_error(exc, staging, 1 << 20, "committing")
            if err is exc:
                raise
            raise err from exc
        if len(keys) != n or (len(keys) and keys.max() >= n):
            raise CacheStoreError(f"generation in {staging} cannot be committed: LMDB holds {len(keys)} "
                                  f"records where its writers logged indices 0..{n - 1}")
        summary: Manifest = {"num_samples": n, "layout": "records", "raw_bytes": raw, "stored_bytes": stored}
        store_format = (self.read_meta() or {}).get("format", 1)
        if n and not self.compression and isinstance(store_format, int) and store_format >= COLUMNS_FORMAT:
            columns = self._to_columns(staging, n, one_layout)
            if columns is not None and columns["lmdb_layout"] == lmdb_columns.LAYOUT:
                summary.update(columns, layout="fixed", stored_bytes=raw)
            elif columns is not None:
                summary.update(columns, layout="fixed")
        (staging / "lock.mdb").unlink(missing_ok=True)
        return summary

    def _to_columns(self, staging: Path, n: int,
                    one_layout: list[object] | None) -> lmdb_columns.LayoutFields | None:
        """Rewrite a generation of fixed-shape samples by column (see :mod:`.lmdb_columns`).

        `one_layout`: ``[record bytes, structure]`` when every shard reported that all its records
        share it (wide samples then keep their records, and the manifest says so), else ``None``.
        """
        key = ("write", str(staging))
        with ENVS_LOCK:
            if key in ENVS:  # a shard writer of this process still has the environment open
                return None
        target = staging / ".columns"
        env = open_env(staging, map_size=MAP_SIZE, writemap=False, readonly=True, lock=False)
        try:
            def corrupt(i: int, why: str) -> Exception:
                return CacheStoreError(f"generation in {staging} cannot be committed: sample {i}: {why}")
            with env.begin(buffers=True) as txn:
                columns = lmdb_columns.convert(txn, n, target, record_key, corrupt, one_layout)
        finally:
            env.close()
        if columns is not None and columns["lmdb_layout"] == lmdb_columns.LAYOUT:
            lmdb_columns.replace_data(staging, target)
        return columns

    def _open(self, gen_dir: Path, manifest: Manifest) -> GenerationData:
        return LmdbGeneration(gen_dir, manifest, self.verify, self.allow_pickle)

    # partial generations ----------------------------------------------------
    def _logged(self, staging: Path) -> npt.NDArray[np.int64]:
        parts = []
        for log_file in sorted(staging.glob("keys-*.bin")):
            data = safefs.read_bytes(log_file)
            parts.append(np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _adopt_shards(self, staging: Path, prefix: str, num_samples: int | None) -> int:
        # The dead writer's lock file may hold its stale reader slots: nobody has it open now
        # (we hold the writer lease, the owner and its workers are gone), so start a fresh one.
        (staging / "lock.mdb").unlink(missing_ok=True)
        _allocate_lock_file(staging, create=True)
        seen: set[int] = set()
        records = LmdbStaging(staging, verify=True)
        try:
            for log_file in sorted(staging.glob("keys-*.bin")):
                shard_id = log_file.name[len("keys-"):-len(".bin")]
                data = safefs.read_bytes(log_file)
                logged = np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG)
                keep = np.zeros(len(logged), dtype=bool)
                for k, i in enumerate(logged.tolist()):
                    # LMDB holds one value per key: any copy that verifies is the one a reader gets.
                    keep[k] = in_range(i, num_samples) and i not in seen and records.sound(i)
                    if keep[k]:
                        seen.add(i)
                safefs.write_new(_keys_file(staging, prefix + shard_id), logged[keep].tobytes())
                log_file.unlink()
                stats = staging / f"stats-{shard_id}.json"
                if stats.exists():
                    os.rename(stats, staging / f"stats-{prefix}{shard_id}.json")
        finally:
            records.close()
        fsync_dir(staging)
        return len(seen)

    def open_staging(self, token: StagingToken) -> StagingData:
        return LmdbStaging(Path(token.path), self.verify, self.allow_pickle)

    def _check_files(self, gen_dir: Path, manifest: Manifest) -> str | None:
        data = gen_dir / "data.mdb"
        kind = safefs.describe_entry(data)
        return None if kind == "a file" else f"{data} is {kind}"


class LmdbStaging(StagingData):
    """Samples of an LMDB staging area, read through this process's environment of it."""

    def __init__(self, staging: Path, verify: bool, allow_pickle: bool = False) -> None:
        self.dir = staging
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._key = ("write", str(staging))  # the environment shard writers of this process share
        self._env: lmdb.Environment | None = None
        self._pid = -1

    def _value(self, index: int) -> bytes | None:
        if self._env is None or self._pid != os.getpid():
            if not (self.dir / "data.mdb").exists():
                return None
            _allocate_lock_file(self.dir)
            self._env = acquire_env(self._key, lambda: open_env(
                self.dir, map_size=MAP_SIZE, writemap=False, sync=False, metasync=False,
                readahead=True, max_dbs=0, lock=True, create=False))
            self._pid = os.getpid()
        with self._env.begin() as txn:
            return txn.get(record_key(index))

    def _record(self, index: int) -> memoryview | None:
        value = self._value(index)
        if value is None or len(value) < SUM.size:
            return None
        record = memoryview(value)[SUM.size:]
        if self.verify and checksum([record]) != SUM.unpack_from(value)[0]:
            return None
        return record

    def sound(self, index: int) -> bool:
        return self._record(index) is not None

    def read(self, index: int) -> Sample:
        record = self._record(index)
        if record is None:
            raise CorruptSampleError(f"sample {index} in the staging area {self.dir} is missing or corrupt")
        return self.sample(index, *records.decode_record(record, copy=True), where=str(self.dir))

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            release_env(self._key, self._pid)
        self._env = None
