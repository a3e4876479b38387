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
import struct
import threading
import weakref
from pathlib import Path
from typing import Any, Callable

import lmdb
import numpy as np
import xxhash

from .. import codec, safefs
from ..collate import stack_samples
from ..disk import allocated_bytes, is_out_of_space, out_of_space
from ..errors import BudgetExceededError, CacheStoreError, CorruptSampleError
from . import lmdb_columns
from .base import GenerationData, ShardWriter, StagingData, batch_indices, checksum
from .directory import DirectoryBackend, StagingToken, check_complete, fsync_dir, write_json_atomic

_KEY = struct.Struct(">Q")
_SUM = struct.Struct("<Q")
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


def _key(index: int) -> bytes:
    return _KEY.pack(index)


def _disk_full(path: Path, needed: int) -> bool:
    """Whether the file system of `path` has less than `needed` bytes left."""
    try:
        st = os.statvfs(path)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < needed


# py-lmdb refuses to open an environment that is already open in this process (LMDB's fcntl
# locks belong to the (process, file) pair: a second open would share them and drop them on
# close), and a forked child inherits that refusal along with the parent's handles. So a
# process keeps one Environment per generation (readers) or staging area (shard writers),
# shared and counted. An entry inherited through fork is closed in the child - that touches
# none of the parent's locks or reader slots - and opened afresh.
_ENVS: dict[Any, list] = {}  # key -> [pid, env, refs]
# Re-entrant: opening an environment may run garbage collection, whose finalizers release others.
_ENVS_LOCK = threading.RLock()


def _acquire_env(key: Any, opener: Callable[[], Any]) -> Any:
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is not None and entry[0] != os.getpid():
            del _ENVS[key]
            entry[1].close()
            entry = None
        if entry is None:
            entry = [os.getpid(), opener(), 0]
            _ENVS[key] = entry
        entry[2] += 1
        return entry[1]


def _release_env(key: Any, pid: int) -> None:
    with _ENVS_LOCK:
        entry = _ENVS.get(key)
        if entry is None or entry[0] != pid or pid != os.getpid():
            return  # acquired before a fork: the child's entry is not ours to count down
        entry[2] -= 1
        if entry[2] <= 0:
            del _ENVS[key]
            entry[1].close()


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
        fd = os.open(path, os.O_RDWR | (os.O_CREAT if create else 0), 0o644)
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
    def __init__(self, token: StagingToken, shard_id: str) -> None:
        super().__init__(token.generation, token.budget, token.num_samples, token.compress, token.allow_pickle)
        self.dir = Path(token.path)
        self.shard_id = shard_id
        self._env: Any = None
        self._env_key = ("write", str(self.dir))
        self._pending: list[tuple[bytes, bytes]] = []
        self._pending_indices: list[int] = []
        self._pending_bytes = 0
        self._keys_fd: int | None = None

    def _write(self, index: int, treedef: tuple, leaves: list[np.ndarray]) -> int:
        record = codec.encode_record(treedef, leaves, self.compress)
        self._pending.append((_key(index), _SUM.pack(checksum([record])) + record))
        self._pending_indices.append(index)
        self._pending_bytes += len(record)
        if self._pending_bytes >= FLUSH_BYTES:
            self._flush()
        return len(record) + _SUM.size

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
        stats = {"raw_bytes": self.raw_bytes, "stored_bytes": self.stored_bytes, "count": self.count}
        write_json_atomic(self.dir / f"stats-{self.shard_id}.json", stats)  # out of space: BudgetExceededError

    def _write_pending(self) -> None:
        if self._env is None:
            if not self.dir.is_dir():
                raise CacheStoreError(f"staging area {self.dir} is gone (its generation was aborted or pruned)")
            _allocate_lock_file(self.dir)  # no room: BudgetExceededError, before LMDB could SIGBUS
        try:
            if self._env is None:
                self._env = _acquire_env(self._env_key, lambda: lmdb.open(
                    str(self.dir), map_size=MAP_SIZE, writemap=False, sync=False, metasync=False,
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
            _release_env(self._env_key, self._env_pid)

    def usage(self) -> int:
        return allocated_bytes(self.dir)


class LmdbBackend(DirectoryBackend):
    name = "lmdb"

    def begin(self, generation: int, budget: Any, num_samples: int | None) -> StagingToken:
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

    def _finalize(self, staging: Path, num_samples: int | None) -> dict:
        raw = stored = 0
        keys = np.zeros(0, dtype=np.int64)
        for stats_file in staging.glob("stats-*.json"):
            stats = safefs.read_json(stats_file)
            raw += stats["raw_bytes"]
            stored += stats["stored_bytes"]
            stats_file.unlink()
        logged = []
        for log_file in sorted(staging.glob("keys-*.bin")):
            data = safefs.read_bytes(log_file)
            logged.append(np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG))
            log_file.unlink()
        # Every index as often as it was written: duplicates are refused here, as by every backend.
        n = check_complete(np.concatenate(logged) if logged else [], num_samples, f"generation in {staging}")
        try:
            if not (staging / "data.mdb").exists():
                env = lmdb.open(str(staging), map_size=1 << 20, writemap=False)
                env.close()
            else:
                _allocate_lock_file(staging)
                key = ("write", str(staging))  # shared with any shard writer of this process still open
                env = _acquire_env(key, lambda: lmdb.open(str(staging), map_size=MAP_SIZE, writemap=False,
                                                          readahead=False))
                try:
                    with env.begin() as txn:
                        keys = np.fromiter((_KEY.unpack(k)[0] for k in txn.cursor().iternext(values=False)),
                                           dtype=np.int64)
                    env.sync(True)
                finally:
                    _release_env(key, os.getpid())
        except lmdb.Error as exc:
            err = _lmdb_error(exc, staging, 1 << 20, "committing")
            if err is exc:
                raise
            raise err from exc
        if len(keys) != n or (len(keys) and keys.max() >= n):
            raise CacheStoreError(f"generation in {staging} cannot be committed: LMDB holds {len(keys)} "
                                  f"records where its writers logged indices 0..{n - 1}")
        summary = {"num_samples": n, "layout": "records", "raw_bytes": raw, "stored_bytes": stored}
        if n and not self.compression and (self.read_meta() or {}).get("format", 1) >= COLUMNS_FORMAT:
            columns = self._to_columns(staging, n)
            if columns is not None and columns["lmdb_layout"] == lmdb_columns.LAYOUT:
                summary.update(columns, layout="fixed", stored_bytes=raw)
            elif columns is not None:
                summary.update(columns, layout="fixed")
        (staging / "lock.mdb").unlink(missing_ok=True)
        return summary

    def _to_columns(self, staging: Path, n: int) -> dict | None:
        """Rewrite a generation of fixed-shape samples by column (see :mod:`.lmdb_columns`)."""
        key = ("write", str(staging))
        with _ENVS_LOCK:
            if key in _ENVS:  # a shard writer of this process still has the environment open
                return None
        target = staging / ".columns"
        env = lmdb.open(str(staging), map_size=MAP_SIZE, writemap=False, readonly=True, lock=False)
        try:
            def corrupt(i: int, why: str) -> Exception:
                return CacheStoreError(f"generation in {staging} cannot be committed: sample {i}: {why}")
            with env.begin(buffers=True) as txn:
                columns = lmdb_columns.convert(txn, n, target, _key, corrupt)
        finally:
            env.close()
        if columns is not None and columns["lmdb_layout"] == lmdb_columns.LAYOUT:
            lmdb_columns.replace_data(staging, target)
        return columns

    def _open(self, gen_dir: Path, manifest: dict) -> GenerationData:
        return LmdbGeneration(gen_dir, manifest, self.verify)

    # partial generations ----------------------------------------------------
    def _logged(self, staging: Path) -> np.ndarray:
        parts = []
        for log_file in sorted(staging.glob("keys-*.bin")):
            data = safefs.read_bytes(log_file)
            parts.append(np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG))
        return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)

    def _adopt_shards(self, staging: Path, prefix: str, num_samples: int) -> int:
        # The dead writer's lock file may hold its stale reader slots: nobody has it open now
        # (we hold the writer lease, the owner and its workers are gone), so start a fresh one.
        (staging / "lock.mdb").unlink(missing_ok=True)
        _allocate_lock_file(staging, create=True)
        seen = np.zeros(num_samples, dtype=bool)
        records = LmdbStaging(staging, verify=True)
        try:
            for log_file in sorted(staging.glob("keys-*.bin")):
                shard_id = log_file.name[len("keys-"):-len(".bin")]
                data = safefs.read_bytes(log_file)
                logged = np.frombuffer(data[:len(data) - len(data) % _LOG.itemsize], dtype=_LOG)
                keep = np.zeros(len(logged), dtype=bool)
                for k, i in enumerate(logged.tolist()):
                    # LMDB holds one value per key: any copy that verifies is the one a reader gets.
                    keep[k] = 0 <= i < num_samples and not seen[i] and records.sound(i)
                    if keep[k]:
                        seen[i] = True
                safefs.write_new(_keys_file(staging, prefix + shard_id), logged[keep].tobytes())
                log_file.unlink()
                stats = staging / f"stats-{shard_id}.json"
                if stats.exists():
                    os.rename(stats, staging / f"stats-{prefix}{shard_id}.json")
        finally:
            records.close()
        fsync_dir(staging)
        return int(seen.sum())

    def open_staging(self, token: StagingToken) -> StagingData:
        return LmdbStaging(Path(token.path), self.verify)


class LmdbStaging(StagingData):
    """Samples of an LMDB staging area, read through this process's environment of it."""

    def __init__(self, staging: Path, verify: bool) -> None:
        self.dir = staging
        self.verify = verify
        self._key = ("write", str(staging))  # the environment shard writers of this process share
        self._env: Any = None
        self._pid = -1

    def _value(self, index: int) -> bytes | None:
        if self._env is None or self._pid != os.getpid():
            if not (self.dir / "data.mdb").exists():
                return None
            _allocate_lock_file(self.dir)
            self._env = _acquire_env(self._key, lambda: lmdb.open(
                str(self.dir), map_size=MAP_SIZE, writemap=False, sync=False, metasync=False,
                readahead=True, max_dbs=0, lock=True, create=False))
            self._pid = os.getpid()
        with self._env.begin() as txn:
            return txn.get(_key(index))

    def _record(self, index: int) -> memoryview | None:
        value = self._value(index)
        if value is None or len(value) < _SUM.size:
            return None
        record = memoryview(value)[_SUM.size:]
        if self.verify and checksum([record]) != _SUM.unpack_from(value)[0]:
            return None
        return record

    def sound(self, index: int) -> bool:
        return self._record(index) is not None

    def read(self, index: int) -> Any:
        record = self._record(index)
        if record is None:
            raise CorruptSampleError(f"sample {index} in the staging area {self.dir} is missing or corrupt")
        return codec.unflatten(*codec.decode_record(record, copy=True))

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            _release_env(self._key, self._pid)
        self._env = None

    def _check_files(self, gen_dir: Path, manifest: dict) -> str | None:
        data = gen_dir / "data.mdb"
        kind = safefs.describe_entry(data)
        return None if kind == "a file" else f"{data} is {kind}"


def _destinations(treedef: tuple, n: int, out: list[np.ndarray] | None) -> list[np.ndarray]:
    """The arrays a batch of `n` samples of `treedef` lands in: `out` (checked) or new ones."""
    specs = codec.leaf_specs(treedef)
    if out is None:
        return [np.empty((n, *shape), dtype=dtype) for dtype, shape in specs]
    if len(out) != len(specs) or any(a.shape != (n, *shape) or a.dtype != dtype or not a.flags.c_contiguous
                                     for a, (dtype, shape) in zip(out, specs)):
        raise ValueError(f"out= must be {len(specs)} C-contiguous arrays shaped like the batch: "
                         + ", ".join(f"{(n, *shape)} {dtype}" for dtype, shape in specs))
    return out


class LmdbGeneration(GenerationData):
    def __init__(self, gen_dir: Path, manifest: dict, verify: bool) -> None:
        super().__init__(int(manifest["generation"]), int(manifest["num_samples"]), str(gen_dir), verify)
        self.dir = gen_dir
        self._env: Any = None
        self._pid = -1
        self.columns: lmdb_columns.Columns | None = None
        self.fixed: tuple[tuple, list] | None = None  # (schema, leaf specs) of fixed-layout records
        try:
            if manifest.get("lmdb_layout") == lmdb_columns.LAYOUT:
                self.columns = lmdb_columns.Columns(manifest, self.num_samples, self.corrupt)
            elif manifest.get("lmdb_layout") == lmdb_columns.RECORDS:
                schema = codec.treedef_from_json(manifest["schema"])
                self.fixed = (schema, codec.leaf_specs(schema))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptSampleError(f"manifest of generation {self.generation} in {gen_dir} has no "
                                     f"usable schema: {exc}") from exc
        self.env  # open now so a damaged file fails at open, not at the first read

    @property
    def env(self) -> Any:
        if self._pid != os.getpid():
            data = self.dir / "data.mdb"
            try:
                st = os.stat(data)
            except FileNotFoundError:
                raise CorruptSampleError(f"generation {self.generation} in {self.dir} has no data file") from None
            # Keyed by the data file's identity, not its path: a generation removed and written
            # again at the same path must not be served from the old, still-open environment.
            key = ("read", st.st_dev, st.st_ino)
            self._env = _acquire_env(key, self._open)
            self._pid = os.getpid()
            self._release = weakref.finalize(self, _release_env, key, self._pid)
        return self._env

    def _open(self) -> Any:
        data = self.dir / "data.mdb"
        try:
            env = lmdb.open(str(self.dir), readonly=True, lock=False, readahead=True,
                            max_readers=1024, subdir=True)
        except lmdb.Error as exc:
            raise CorruptSampleError(f"{data} of generation {self.generation} cannot be opened: {exc}") from exc
        # LMDB maps the file and trusts its meta page: reading a page past the end of a
        # truncated file is a SIGBUS that kills the process, so check the size up front.
        needed = (env.info()["last_pgno"] + 1) * env.stat()["psize"]
        size = os.path.getsize(data)
        if size < needed:
            env.close()
            raise CorruptSampleError(f"data file {data} of generation {self.generation} is truncated: "
                                     f"{size} bytes, expected at least {needed}; "
                                     "the generation is damaged (prune it and rewrite)")
        entries = env.stat()["entries"]
        # A commit stores exactly indices 0..n-1, or each chunk of each column once.
        expected = self.num_samples if self.columns is None else self.columns.entries()
        if entries != expected:
            env.close()
            raise CorruptSampleError(f"data file {data} of generation {self.generation} holds {entries} records "
                                     f"but its manifest says {expected} ({self.num_samples} samples)")
        return env

    def _leaves(self, i: int, value: Any, copy: bool) -> tuple[tuple, list[np.ndarray]]:
        """Check and parse one stored value into ``(treedef, leaves)``."""
        if value is None:
            raise self.corrupt(i, "its record is missing")
        view = memoryview(value)
        if len(view) < _SUM.size:
            raise self.corrupt(i, "its record is truncated")
        record = view[_SUM.size:]
        if self.verify and checksum([record]) != _SUM.unpack_from(view)[0]:
            raise self.corrupt(i, "checksum mismatch")
        try:
            return codec.decode_record(record, copy=copy)
        except CorruptSampleError as exc:
            raise self.corrupt(i, str(exc)) from exc

    def _decode(self, i: int, value: Any, copy: bool) -> Any:
        return codec.unflatten(*self._leaves(i, value, copy))

    def read(self, index: int, copy: bool = True) -> Any:
        i = self.check_index(index)
        if self.columns is not None:
            try:
                with self.env.begin(buffers=True) as txn:
                    return codec.unflatten(self.columns.schema, self.columns.read(txn, i, self.verify))
            except lmdb.Error as exc:
                raise self.corrupt(i, f"LMDB error: {exc}") from exc
        try:
            with self.env.begin() as txn:
                value = txn.get(_key(i))
        except lmdb.Error as exc:
            raise self.corrupt(i, f"LMDB error: {exc}") from exc
        return self._decode(i, value, copy)

    def batch_layout(self) -> tuple[tuple, list] | None:
        return (self.columns.schema, self.columns.specs) if self.columns is not None else self.fixed

    def read_batch(self, indices: Any, out: Any = None) -> Any:
        if self.columns is not None:
            idx = batch_indices(indices, self.num_samples, self.generation)
            try:
                with self.env.begin(buffers=True) as txn:
                    out = self.columns.gather(txn, idx, out, self.verify)
            except lmdb.Error as exc:
                raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
            return codec.unflatten_batch(self.columns.schema, out)
        if out is not None and self.fixed is None:
            raise ValueError("out= is only supported for generations with a fixed layout")
        checked = batch_indices(indices, self.num_samples, self.generation).tolist()
        if out is not None and not checked:
            return codec.unflatten_batch(self.fixed[0], out)
        batch = self._gather(checked, out) if checked else None
        if batch is not None:
            return batch
        try:
            # bytes values (not transaction-bound buffers): the decoded views keep them alive.
            with self.env.begin() as txn:
                values = [txn.get(_key(i)) for i in checked]
        except lmdb.Error as exc:
            raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
        return stack_samples([self._decode(i, v, copy=False) for i, v in zip(checked, values)])

    def _gather(self, checked: list[int], out: list[np.ndarray] | None = None) -> Any:
        """The batch when its records share one uncompressed, stackable layout, else ``None``.

        In a generation whose manifest says its records share one layout, a record that
        differs is damaged, and the batch lands in `out` when it is given.

        Each leaf is copied once, from LMDB's map straight into its stacked array (values are
        transaction-bound buffers, not ``bytes``), at offsets read from the first record:
        no per-sample copy, decode, sample object or ``np.stack``, each of which cost as much
        as the copy itself. The copies are ``memoryview`` slice assignments: a ``frombuffer``
        and a numpy row assignment per leaf and sample cost about 1.5 us each, a third of a
        48 KiB sample's whole read. A record that differs sends the batch to the general path.
        """
        n, verify, pack, hash_of = len(checked), self.verify, _KEY.pack, xxhash.xxh3_64_intdigest
        body = _SUM.size
        try:
            with self.env.begin(buffers=True) as txn:
                for j, i in enumerate(checked):
                    value = txn.get(pack(i))
                    if j == 0:
                        self._leaves(i, value, copy=False)  # checks the first record fully
                        record = memoryview(value)[body:]
                        try:
                            layout = codec.record_layout(record)
                        except CorruptSampleError as exc:
                            raise self.corrupt(i, str(exc)) from exc
                        if layout is None or not codec.is_stackable(layout[0]):
                            return self._differs(i)
                        treedef, head, spans = layout
                        if self.fixed is not None and treedef != self.fixed[0]:
                            return self._differs(i)
                        size, prefix = len(value), bytes(record[:head])
                        out = _destinations(treedef, n, out)
                        copies = [(memoryview(dest).cast("B"), body + start, nbytes)
                                  for dest, (start, nbytes) in zip(out, spans) if nbytes]
                    elif value is None or len(value) != size or value[body:body + head] != prefix:
                        return self._differs(i)
                    for dest, start, nbytes in copies:
                        at = j * nbytes
                        dest[at:at + nbytes] = value[start:start + nbytes]
                    # Hashed after the copy, while the record is still in cache from it.
                    if j and verify and hash_of(value[body:]) != _SUM.unpack_from(value)[0]:
                        raise self.corrupt(i, "checksum mismatch")
        except lmdb.Error as exc:
            raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
        return codec.unflatten_batch(treedef, out)

    def _differs(self, i: int) -> None:
        """A record of another layout than the batch's first: the general path reads the batch,
        unless the manifest promised one layout for every record."""
        if self.fixed is not None:
            raise self.corrupt(i, "its record does not have the generation's fixed layout")
        return None

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._release()  # the environment closes with its last user in this process
        self._env = None
        self._pid = -1
