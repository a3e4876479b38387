"""Reading a committed LMDB generation, and the registry of the environments a process has open.

The registry is shared with the writers in :mod:`.lmdb_backend` (staging
areas): see the note above :data:`ENVS`. A generation's layouts (records,
``"fixed-records"``, columns) are described in :mod:`.lmdb_columns`.

LMDB maps its data file and trusts it: a page beyond the end of a file truncated under an open
generation is a SIGBUS, which kills the process (a store is untrusted input,
docs/ARCHITECTURE.md, "Untrusted stores"). So a reader holds the data file open and checks its
size (``fstat``) before each read transaction; the compiled gather of wide records catches the
SIGBUS itself. A file cut in the middle of a transaction is the one case left to the kernel.
"""

from __future__ import annotations

import os
import stat
import struct
import threading
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, TypeAlias, cast

import lmdb
import numpy as np
import xxhash

from . import lmdb_columns
from ..errors import CacheStoreError, CorruptSampleError, exhausted
from ..format import codec, records
from ..format.checksums import checksum
from ..format.codec import Batch, Leaf, Sample, TreeDef
from ..format.collate import stack_samples
from ..format.native import native_gather
from ..guard import safefs
from ..space.room import fits
from .batch import Indices, batch_indices
from .manifest import Manifest, manifest_int
from .reading import BatchLayout, GenerationData

if TYPE_CHECKING:
    from _typeshed import WriteableBuffer

    from ..format.native import Bytes

KEY = struct.Struct(">Q")  # a record's key: its index, big-endian so the key order is the index order
SUM = struct.Struct("<Q")  # the checksum a record's value starts with


def record_key(index: int) -> bytes:
    """The LMDB key of sample `index`'s record."""
    return KEY.pack(index)


# py-lmdb refuses to open an environment that is already open in this process (LMDB's fcntl
# locks belong to the (process, file) pair: a second open would share them and drop them on
# close), and a forked child inherits that refusal along with the parent's handles. So a
# process keeps one Environment per generation (readers) or staging area (shard writers),
# shared and counted. An entry inherited through fork is closed in the child - that touches
# none of the parent's locks or reader slots - and opened afresh.
#: ``("read", st_dev, st_ino)`` of a generation's data file, ``("write", path)`` of a staging area.
EnvKey: TypeAlias = tuple[str | int, ...]


@dataclass
class _Env:
    pid: int  # the process that opened it
    env: lmdb.Environment
    refs: int


ENVS: dict[EnvKey, _Env] = {}
# Re-entrant: opening an environment may run garbage collection, whose finalizers release others.
ENVS_LOCK = threading.RLock()


def acquire_env(key: EnvKey, opener: Callable[[], lmdb.Environment]) -> lmdb.Environment:
    """This process's environment for `key`, opened with `opener()` if it has none; counted."""
    with ENVS_LOCK:
        entry = ENVS.get(key)
        if entry is not None and entry.pid != os.getpid():
            del ENVS[key]
            entry.env.close()
            entry = None
        if entry is None:
            entry = _Env(os.getpid(), opener(), 0)
            ENVS[key] = entry
        entry.refs += 1
        return entry.env


def open_env(path: Path, **options: Any) -> lmdb.Environment:
    """``lmdb.open(path, **options)`` once `path` is a real directory whose ``data.mdb`` and ``lock.mdb``,
    where present, are regular files: LMDB opens them by name, following links, and writes its lock
    header into ``lock.mdb`` (a symlink put there, in a prefix others can write, would have it write
    a file outside the store); a FIFO would block it.

    Raises
    ------
    SymlinkError, NotRegularFileError
        Naming the file (or the directory) that is not what LMDB may open.
    """
    safefs.require_real_dir(path, "an LMDB environment")
    for name in ("data.mdb", "lock.mdb"):
        st = safefs.lstat_or_none(path / name)
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise safefs.symlink_error(path / name, "an LMDB file")
        if st is not None and not stat.S_ISREG(st.st_mode):
            raise safefs.not_regular_error(path / name, "an LMDB file")
    return lmdb.open(str(path), **options)


def release_env(key: EnvKey, pid: int) -> None:
    """Count down what :func:`acquire_env` counted in process `pid`; close with the last user."""
    with ENVS_LOCK:
        entry = ENVS.get(key)
        if entry is None or entry.pid != pid or pid != os.getpid():
            return  # acquired before a fork: the child's entry is not ours to count down
        entry.refs -= 1
        if entry.refs <= 0:
            del ENVS[key]
            entry.env.close()


def _destinations(treedef: TreeDef, n: int, out: list[Leaf] | None) -> list[Leaf]:
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
    """A committed LMDB generation: records, fixed-layout records, or columns."""

    def __init__(self, gen_dir: Path, manifest: Manifest, verify: bool, allow_pickle: bool = False) -> None:
        super().__init__(int(manifest["generation"]), int(manifest["num_samples"]), str(gen_dir), verify,
                         allow_pickle)
        self.dir = gen_dir
        self._env: lmdb.Environment | None = None
        self._pid = -1
        self._fd = -1  # the data file, held open for its size checks (see the module docstring)
        self._needed = 0
        # Bounds a compressed record written before records said the size of their leaves.
        self._raw_bytes = manifest_int(manifest, "raw_bytes")
        self.columns: lmdb_columns.Columns | None = None
        self.fixed: BatchLayout | None = None  # of fixed-layout records
        try:
            if manifest.get("lmdb_layout") == lmdb_columns.LAYOUT:
                self.columns = lmdb_columns.Columns(manifest, self.num_samples, self.corrupt)
                self.uniform_bytes = sum(self.columns.widths)
            elif manifest.get("lmdb_layout") == lmdb_columns.RECORDS:
                schema = lmdb_columns.stackable_schema(manifest, str(gen_dir / "manifest.json"))
                self.fixed = (schema, codec.leaf_specs(schema))
                self.uniform_bytes = sum(codec.row_bytes(self.fixed[1]))
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise CorruptSampleError(f"manifest of generation {self.generation} in {gen_dir} has no "
                                     f"usable schema: {exc}") from exc
        self.env  # open now so a damaged file fails at open, not at the first read

    @property
    def env(self) -> lmdb.Environment:
        """This process's environment of the generation (opened again after a fork)."""
        if self._env is None or self._pid != os.getpid():
            data = self.dir / "data.mdb"
            try:
                fd = safefs.open_nofollow(data, os.O_RDONLY | os.O_NONBLOCK)
            except FileNotFoundError:
                raise CorruptSampleError(f"generation {self.generation} in {self.dir} has no data file") from None
            except OSError as exc:  # a symlink (SymlinkError) among them
                if exhausted(exc):
                    raise
                raise CorruptSampleError(f"data file {data} of generation {self.generation}: {exc}") from None
            st = os.fstat(fd)
            if self._fd >= 0:
                os.close(self._fd)  # inherited through a fork: this process holds its own
            self._fd = fd
            # Keyed by the data file's identity, not its path: a generation removed and written
            # again at the same path must not be served from the old, still-open environment.
            key = ("read", st.st_dev, st.st_ino)
            self._env = acquire_env(key, self._open)
            self._pid = os.getpid()
            self._release = weakref.finalize(self, _release, key, self._pid, fd)
            self._needed = (self._env.info()["last_pgno"] + 1) * self._env.stat()["psize"]
            self._check_size()
        return self._env

    def _check_size(self) -> None:
        """Raise unless the data file still has every page LMDB may read (else: SIGBUS)."""
        if self._env is None:
            raise CacheStoreError(f"generation {self.generation} in {self.dir} was closed")
        size = os.fstat(self._fd).st_size
        if size < self._needed:
            exc = CorruptSampleError(f"data file {self.dir / 'data.mdb'} of generation {self.generation} is {size} "
                                     f"bytes, {self._needed} needed: it was truncated; the generation is damaged "
                                     "(`cachestore prune` removes it)")
            exc.generation = self.generation
            raise exc

    def _checked_env(self) -> lmdb.Environment:
        """:attr:`env`, once the data file is checked to hold every page: what a transaction begins on."""
        env = self.env
        self._check_size()
        return env

    def _open(self) -> lmdb.Environment:
        data = self.dir / "data.mdb"
        try:
            # Read-ahead only while the generation fits the memory room: past it, the read-ahead of a
            # page fault (megabytes on some disks) is evicted before it is used.
            env = open_env(self.dir, readonly=True, lock=False, readahead=fits(os.path.getsize(data)),
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

    def _leaves(self, i: int, value: bytes | memoryview | None, copy: bool,
                verify: bool | None = None) -> tuple[TreeDef, list[Leaf]]:
        """Check and parse one stored value into ``(treedef, leaves)`` (never unpickled)."""
        if value is None:
            raise self.corrupt(i, "its record is missing")
        view = memoryview(value)
        if len(view) < SUM.size:
            raise self.corrupt(i, "its record is truncated")
        record = view[SUM.size:]
        if (self.verify if verify is None else verify) and checksum([record]) != SUM.unpack_from(view)[0]:
            raise self.corrupt(i, "checksum mismatch")
        try:
            return records.decode_record(record, copy=copy, raw=self._raw_bytes or None, limit=self.max_sample_bytes)
        except CorruptSampleError as exc:
            raise self.corrupt(i, str(exc)) from exc

    def _decode(self, i: int, value: bytes | None, copy: bool) -> Sample:
        return self.sample(i, *self._leaves(i, value, copy))

    def _sample_leaves(self, i: int, copy: bool, verify: bool) -> tuple[TreeDef, list[Leaf]]:
        """Sample `i` as ``(treedef, leaves)``, its checksum checked when `verify` (never unpickled)."""
        try:
            if self.columns is not None:
                with self._checked_env().begin(buffers=True) as txn:
                    return self.columns.schema, self.columns.read(txn, i, verify)
            with self._checked_env().begin() as txn:
                value = txn.get(record_key(i))
        except lmdb.Error as exc:
            raise self.corrupt(i, f"LMDB error: {exc}") from exc
        return self._leaves(i, value, copy, verify)

    def read(self, index: int, copy: bool = True) -> Sample:
        i = self.check_index(index)
        return self.sample(i, *self._sample_leaves(i, copy, self.verify))

    def check(self, index: int) -> None:
        self._sample_leaves(self.check_index(index), False, True)

    def batch_layout(self) -> BatchLayout | None:
        return (self.columns.schema, self.columns.specs) if self.columns is not None else self.fixed

    def read_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        if self.columns is not None:
            idx = batch_indices(indices, self.num_samples, self.generation)
            try:
                with self._checked_env().begin(buffers=True) as txn:
                    out = self.columns.gather(txn, idx, out, self.verify)
            except lmdb.Error as exc:
                raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
            return codec.unflatten_batch(self.columns.schema, out)
        if out is not None and self.fixed is None:
            raise ValueError("out= is only supported for generations with a fixed layout")
        checked: list[int] = batch_indices(indices, self.num_samples, self.generation).tolist()
        if out is not None and not checked and self.fixed is not None:
            return codec.unflatten_batch(self.fixed[0], out)
        batch = self._gather(checked, out) if checked else None
        if batch is not None:
            return batch
        try:
            # bytes values (not transaction-bound buffers): the decoded views keep them alive.
            with self._checked_env().begin() as txn:
                values = [txn.get(record_key(i)) for i in checked]
        except lmdb.Error as exc:
            raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
        return stack_samples([self._decode(i, v, copy=False) for i, v in zip(checked, values)])

    def _gather(self, checked: list[int], out: list[Leaf] | None = None) -> Batch | None:
        """The batch when its records share one uncompressed, stackable layout, else ``None``.

        In a generation whose manifest says its records share one layout, a record that
        differs is damaged, and the batch lands in `out` when it is given.

        Each leaf is copied once, from LMDB's map straight into its stacked array (values are
        transaction-bound buffers, not ``bytes``), at offsets read from the first record:
        no per-sample copy, decode, sample object or ``np.stack``, each of which cost as much
        as the copy itself. The copies are ``memoryview`` slice assignments: a ``frombuffer``
        and a numpy row assignment per leaf and sample cost more than the copy of a large
        sample; with the compiled gather (``cachestore/format/_gather.c``) the records
        after the first are checked, hashed and copied in one call without the GIL. A record that
        differs sends the batch to the general path.
        """
        n, verify, pack, hash_of = len(checked), self.verify, KEY.pack, xxhash.xxh3_64_intdigest
        body = SUM.size
        try:
            with self._checked_env().begin(buffers=True) as txn:
                i, first = checked[0], txn.get(pack(checked[0]))
                self._leaves(i, first, copy=False)  # checks the first record fully
                value = cast(memoryview, first)  # not None: _leaves raised if it were missing
                record = value[body:]
                try:
                    layout = records.record_layout(record)
                except CorruptSampleError as exc:
                    raise self.corrupt(i, str(exc)) from exc
                if layout is None or not codec.is_stackable(layout[0]):
                    self._differs(i)
                    return None
                treedef, head, spans = layout
                if self.fixed is not None and treedef != self.fixed[0]:
                    self._differs(i)
                    return None
                size, prefix = len(value), bytes(record[:head])
                out = _destinations(treedef, n, out)
                copies = [(memoryview(cast("WriteableBuffer", dest)).cast("B"), body + start, nbytes)
                          for dest, (start, nbytes) in zip(out, spans) if nbytes]
                for dest, start, nbytes in copies:
                    dest[:nbytes] = value[start:start + nbytes]
                native = native_gather()
                if native is not None and len(copies) <= native.MAX_LEAVES:
                    # The rest in one call, the GIL released: hashed, then copied from the cache.
                    values: list[Bytes | None] = [value, *(txn.get(pack(i)) for i in checked[1:])]
                    kind, j = native.gather_records(values, 1, size, body, prefix,
                                                    tuple((start, nbytes) for _, start, nbytes in copies),
                                                    tuple(dest for dest, _, _ in copies), verify)
                    if kind == 1:
                        self._differs(checked[j])
                        return None
                    if kind == 2:
                        raise self.corrupt(checked[j], "checksum mismatch")
                    if kind == 3:  # a page could not be read (SIGBUS): the data file was cut
                        self._check_size()
                        raise self.corrupt(checked[j], "its record could not be read (its file was truncated)")
                    return codec.unflatten_batch(treedef, out)
                for j in range(1, n):
                    i, other = checked[j], txn.get(pack(checked[j]))
                    if other is None or len(other) != size or other[body:body + head] != prefix:
                        self._differs(i)
                        return None
                    for dest, start, nbytes in copies:
                        at = j * nbytes
                        dest[at:at + nbytes] = other[start:start + nbytes]
                    # Hashed after the copy, while the record is still in cache from it.
                    if verify and hash_of(other[body:]) != SUM.unpack_from(other)[0]:
                        raise self.corrupt(i, "checksum mismatch")
        except lmdb.Error as exc:
            raise CorruptSampleError(f"generation {self.generation} in {self.dir}: LMDB error: {exc}") from exc
        return codec.unflatten_batch(treedef, out)

    def _differs(self, i: int) -> None:
        """A record of another layout than the batch's first: the general path reads the batch,
        unless the manifest promised one layout for every record."""
        if self.fixed is not None:
            raise self.corrupt(i, "its record does not have the generation's fixed layout")

    def close(self) -> None:
        if self._env is not None and self._pid == os.getpid():
            self._release()  # the environment closes with its last user in this process, the data file now
            self._fd = -1
        self._env = None
        self._pid = -1


def _release(key: EnvKey, pid: int, fd: int) -> None:
    """Give back a generation's environment and close its data file (in the process that opened them)."""
    if pid == os.getpid():
        os.close(fd)
    release_env(key, pid)
