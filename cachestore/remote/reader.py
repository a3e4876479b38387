"""Reading a published generation straight from the remote (no local copy): a map-style dataset.

For when the local disk budget cannot hold a generation. The remote is a source of byte ranges
(:class:`ObjectSource`: a file of a published set is a run of chunks in content-named objects)
read through the memmap backend's own format code (:class:`~cachestore.backends.memmap_ranges.RangeGeneration`):
the small files (the index, the schema) are read once at open, verified chunk by chunk, and
checked there; a batch is then one ranged read per run of consecutive samples and column (or
per record), the reads of each object sent together (obstore coalesces nearby ranges) and
several objects in parallel; every record is verified with the store's checksums; no pickled
leaf is loaded unless ``allow_pickle``.

Block order (blocks of consecutive records, docs/ARCHITECTURE.md "Larger than memory") suits it:
a batch of such blocks is a few large reads.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Sequence

import numpy as np
import xxhash

from ..backends.memmap_ranges import Part, RangeGeneration, Want
from ..backends.reading import GenerationData
from ..backends.spec import StoreSpec
from ..errors import CorruptSampleError, MalformedFileError
from ..format.codec import TreeDef
from ..read.reader import Reader
from ..space.room import sample_limit
from . import layout
from .client import runtime_started
from .errors import RemoteManifestError
from .leases import ReaderLease
from .manifest import FileSet, check_sizes
from .verify import check_treedef

if TYPE_CHECKING:
    from .base import RemoteBase

#: The most bytes a file read whole (an index, a schema) may take.
SMALL_FILE_BYTES = 1 << 30


class ObjectSource:
    """The files of a published generation's sets, read by byte ranges of their objects (a
    :class:`~cachestore.backends.memmap_ranges.ByteSource`); each read renews the reader lease."""

    def __init__(self, remote: "RemoteBase", generation: int, sets: Sequence[FileSet], where: str) -> None:
        self.remote, self.generation, self.sets, self.where = remote, generation, sets, where
        self.lease: ReaderLease | None = None
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()

    def size(self, part: int, name: str) -> int | None:
        f = self.sets[part].file(name)
        return None if f is None else f.size

    def whole(self, part: int, name: str) -> bytes | None:
        fs = self.sets[part]
        f = fs.file(name)
        if f is None:
            return None
        if f.size > SMALL_FILE_BYTES:
            raise RemoteManifestError(f"{self.where}: {name} of {fs.name} is {f.size} bytes, too large for an index")
        out = bytes(self.read([(part, name, 0, f.size)])[0])
        # The small files are verified chunk by chunk (records are verified by their own checksums).
        pos = 0
        for n, c in zip(f.lengths.tolist(), f.checksums.tolist()):
            if xxhash.xxh3_64_intdigest(out[pos:pos + n]) != c:
                raise CorruptSampleError(f"{self.where}: {name} of {fs.name} does not match its checksum")
            pos += n
        return out

    def read(self, wants: Sequence[Want]) -> list[bytes | memoryview]:
        """The bytes of each want; the ranges of one object go in one call, objects in parallel."""
        pieces: list[list[tuple[tuple[int, int], int]]] = []  # per want: ((set, object), slot in its group)
        groups: dict[tuple[int, int], tuple[list[int], list[int]]] = {}
        for s, name, off, n in wants:
            f = self.sets[s].file(name)
            assert f is not None  # the range reader reads only files it found at open
            mine = []
            starts = f.starts
            j = int(np.searchsorted(starts, off, side="right")) - 1
            while n > 0:
                inner = off - int(starts[j])
                take = min(n, int(f.lengths[j]) - inner)
                key = (s, int(f.objects[j]))
                group = groups.setdefault(key, ([], []))
                group[0].append(int(f.offsets[j]) + inner)
                group[1].append(int(f.offsets[j]) + inner + take)
                mine.append((key, len(group[0]) - 1))
                off, n, j = off + take, n - take, j + 1
            pieces.append(mine)
        keys = list(groups)
        if len(keys) == 1:
            got = {keys[0]: self._get(keys[0], groups[keys[0]])}
        else:
            got = dict(zip(keys, self._executor().map(lambda key: self._get(key, groups[key]), keys)))
        if self.lease is not None:
            self.lease.renew()
        return [got[mine[0][0]][mine[0][1]] if len(mine) == 1 else b"".join(bytes(got[key][slot]) for key, slot in mine)
                for mine in pieces]

    def _get(self, key: tuple[int, int], ranges: tuple[list[int], list[int]]) -> list[memoryview]:
        s, obj = key
        fs = self.sets[s]
        name = layout.data_object(self.remote.key, self.generation, fs.name, fs.objects[obj][0])
        return self.remote.client.get_ranges(name, *ranges)

    def _executor(self) -> ThreadPoolExecutor:
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=self.remote.settings.concurrency,
                                                thread_name_prefix="cachestore-remote-read")
            return self._pool

    def close(self) -> None:
        with self._pool_lock:
            if self._pool is not None:
                self._pool.shutdown(wait=True)
                self._pool = None
        if self.lease is not None:
            self.lease.release()
            self.lease = None


class RemoteGeneration(RangeGeneration):
    """A published generation read from the remote (see the module docstring)."""

    def __init__(self, remote: "RemoteBase", generation: int, allow_pickle: bool, verify: bool) -> None:
        m = remote.manifest(generation)
        where = f"{remote.path}/generations/{generation:06d}.json"
        for fs in m.sets:
            prefix = layout.data_prefix(remote.key, generation, fs.name)
            check_sizes(fs, {i.key.rsplit("/", 1)[-1]: i.size for i in remote.client.list_objects(prefix)}, where)
        self.objects = ObjectSource(remote, generation, m.sets, where)
        parts = [Part(fs.name, fs.start, fs.stop, m.layout == "whole") for fs in m.sets]
        try:
            super().__init__(self.objects, parts, generation, m.num_samples, where, verify, allow_pickle)
        except MalformedFileError as exc:  # the remote's files are not what its manifest says
            self.objects.close()
            raise RemoteManifestError(str(exc)) from None
        except BaseException:
            self.objects.close()
            raise
        limit = remote.max_sample_bytes
        self.bound_samples(sample_limit(None) if limit is None else limit)
        self.objects.lease = ReaderLease(remote, generation)
        self._nbytes = m.nbytes

    def check_structure(self, treedef: TreeDef, where: str) -> None:
        """A remote is untrusted input: a structure with a pickled leaf (unless ``allow_pickle``), an
        unknown node or an object dtype is damage, found before anything is built from it."""
        check_treedef(treedef, self.allow_pickle, where)

    def data_bytes(self) -> int:
        return self._nbytes

    def close(self) -> None:
        self.objects.close()


class RemoteReader(Reader):
    """A :class:`~cachestore.Reader` of a published generation, read from the remote.

    Picklable (as its remote store's settings, without credentials, and the generation):
    hand it to ``torch.utils.data.DataLoader(reader, num_workers=..., multiprocessing_context="spawn")``
    as it is; each process opens its own client. A worker forked from a process that read it already
    raises :class:`~.errors.RemoteForkError` (the client's runtime does not survive a fork) instead
    of waiting for ever.
    """

    def __init__(self, remote: "RemoteBase", generation: int) -> None:
        spec = StoreSpec(remote.path, remote.backend_name, None, remote.allow_pickle, remote.verify_reads)
        super().__init__(spec, generation, None)
        self.remote = remote

    @property
    def survives_fork(self) -> bool:
        """Whether a process forked from this one can read it: not once this process made requests (the
        client's runtime does not survive a fork; such a process raises :class:`RemoteForkError`)."""
        return not runtime_started()

    def __getstate__(self) -> dict[str, object]:
        return {"spec": self.spec, "generation": self.generation, "remote": self.remote, "_persistent": True,
                "_data": None, "_pid": -1}

    @property
    def data(self) -> GenerationData:
        if self._data is None or self._pid != os.getpid():
            self._data = RemoteGeneration(self.remote, self.generation, self.spec.allow_pickle, self.spec.verify)
            self._pid = os.getpid()
        return self._data

    def __repr__(self) -> str:
        return f"RemoteReader({self.remote.path!r}, generation={self.generation})"
