"""Packing files into a few large objects, and reading them back out.

Per-object requests cost more than the bytes on an object store, so a generation's files
(or a part's) travel as a few large objects: the files are laid end to end and the stream
cut into objects of at least :data:`PACK_BYTES` (one object when it is all smaller), each
file's bytes recorded as chunks of at most :data:`CHUNK_BYTES` with their xxh3 (see
:mod:`.manifest`). The plan depends only on the files' names and sizes, and an object is
named by a hash of its chunks' checksums, so publishing the same files again names the same
objects: an interrupted publish is finished by skipping what is already there.

A file to pack is a :class:`Source`: extents of local files (a whole file, a slice of a
column, the records of a part scattered over shard segments) or bytes built in memory.
"""

from __future__ import annotations

import bisect
import os
from dataclasses import dataclass, field

import numpy as np
import xxhash

from ..guard import safefs
from .manifest import FileEntry, FileSet

PACK_BYTES = 64 << 20
CHUNK_BYTES = 8 << 20


@dataclass
class Source:
    """A file to publish: its name and its bytes, as `extents` ``(path, offset, length)`` of local
    files read in order, or as `data` held in memory."""

    name: str
    extents: list[tuple[str, int, int]] = field(default_factory=list)
    data: bytes | None = None

    @property
    def size(self) -> int:
        return len(self.data) if self.data is not None else sum(n for _, _, n in self.extents)

    def read_into(self, offset: int, dest: memoryview) -> None:
        """Bytes ``offset..offset+len(dest)-1`` of this file into `dest`."""
        if self.data is not None:
            dest[:] = self.data[offset:offset + len(dest)]
            return
        ends = np.cumsum([n for _, _, n in self.extents]).tolist()
        k = bisect.bisect_right(ends, offset)
        done = 0
        while done < len(dest):
            path, start, length = self.extents[k]
            before = ends[k] - length
            inner = offset + done - before
            take = min(length - inner, len(dest) - done)
            _pread(path, start + inner, dest[done:done + take])
            done += take
            k += 1


def _pread(path: str, offset: int, dest: memoryview) -> None:
    fd = safefs.open_nofollow(path, os.O_RDONLY)
    try:
        done = 0
        while done < len(dest):
            got = os.preadv(fd, [dest[done:]], offset + done)
            if got == 0:
                raise OSError(f"{path} ends before byte {offset + done}: it changed while it was published")
            done += got
    finally:
        os.close(fd)


@dataclass(frozen=True)
class Piece:
    """Bytes ``offset..offset+length-1`` of file `file`, at `obj_offset` of object `obj`."""

    file: int
    offset: int
    length: int
    obj: int
    obj_offset: int


def plan(sizes: list[int], pack_bytes: int | None = None, chunk_bytes: int | None = None) -> list[list[Piece]]:
    """The pieces of each object, for files of `sizes` laid end to end (empty files take none);
    :data:`PACK_BYTES` and :data:`CHUNK_BYTES` by default."""
    pack_bytes = pack_bytes or PACK_BYTES
    chunk_bytes = chunk_bytes or CHUNK_BYTES
    total = sum(sizes)
    if total == 0:
        return []
    count = max(1, total // pack_bytes)  # each object >= pack_bytes, or one object of everything
    bounds = [total * j // count for j in range(count + 1)]
    objects: list[list[Piece]] = [[] for _ in range(count)]
    pos = 0
    for f, size in enumerate(sizes):
        off = 0
        while off < size:
            obj = bisect.bisect_right(bounds, pos) - 1
            take = min(size - off, bounds[obj + 1] - pos, chunk_bytes)
            objects[obj].append(Piece(f, off, take, obj, pos - bounds[obj]))
            off += take
            pos += take
    return objects


@dataclass
class PackedObject:
    """One object's bytes, read and hashed, with its content name."""

    index: int
    name: str
    data: bytearray
    checksums: list[int]


def read_object(sources: list[Source], pieces: list[Piece]) -> PackedObject:
    """Read and hash the bytes of one planned object."""
    size = sum(p.length for p in pieces)
    buf = bytearray(size)
    view = memoryview(buf)
    sums = []
    for p in pieces:
        dest = view[p.obj_offset:p.obj_offset + p.length]
        sources[p.file].read_into(p.offset, dest)
        sums.append(xxhash.xxh3_64_intdigest(dest))
    digest = xxhash.xxh3_64(np.array(sums, dtype=np.uint64).tobytes() + size.to_bytes(8, "little")).hexdigest()
    return PackedObject(pieces[0].obj, f"pack-{pieces[0].obj:05d}-{digest}.bin", buf, sums)


def file_set(name: str, start: int, stop: int, sources: list[Source], objects: list[list[Piece]],
             packed: dict[int, tuple[str, list[int]]]) -> FileSet:
    """The manifest entry of a packed set of files (`packed`: object index -> (name, piece checksums))."""
    per_file: list[list[tuple[int, int, int, int]]] = [[] for _ in sources]
    for j, pieces in enumerate(objects):
        for p, checksum in zip(pieces, packed[j][1]):
            per_file[p.file].append((p.obj, p.obj_offset, p.length, checksum))
    files = []
    for src, chunks in zip(sources, per_file):
        rows = np.array([c[:3] for c in chunks], dtype=np.int64).reshape(-1, 3)
        files.append(FileEntry(src.name, src.size, rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy(),
                               np.array([c[3] for c in chunks], dtype=np.uint64)))
    objs = tuple((packed[j][0], sum(p.length for p in pieces)) for j, pieces in enumerate(objects))
    return FileSet(name, start, stop, objs, tuple(files))
