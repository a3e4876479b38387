"""Manifests on the remote: built when publishing, parsed strictly when reading.

A remote is untrusted input: whoever can write to the bucket must not get into the nodes
that read it. Every document is parsed here, bounded in size, with exact types and
fields, before anything else looks at it:

* names are plain (:data:`FILE_NAME`: no ``/``, no ``..``, no leading dot), so a name
  can never lead outside the directory it is written into;
* objects are named by the pattern of :mod:`.layout`, never by a key from the document;
* the chunks of every file tile it exactly, and lie inside their object's declared size
  (the real sizes are compared when the objects are read, :func:`check_sizes`);
* ints are ints (no bools, no floats), within bounds; a checksum is 16 hex digits.

A malformed document is :class:`~.errors.RemoteManifestError` naming the key and the field.

The document of a set of files (a whole generation, or one part)::

    {"name": "whole" | "part-0001-of-0004", "start": 0, "stop": n,
     "objects": [{"name": "pack-00000-<hash>.bin", "size": bytes}, ...],
     "files": [{"name": "col-0.bin", "size": bytes,
                "chunks": [[object, offset in object, length, "xxh3 hex"], ...]}, ...]}

A file's chunks, in order, are its bytes; the xxh3 of each is checked on every read.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import xxhash

from .errors import RemoteManifestError
from .layout import MAX_GENERATION, MAX_PARTS, OBJECT_NAME, SET_NAME, STORE_KEY

FORMAT = 1
#: Bounds on what a document may hold (a manifest of a generation of terabytes stays far below).
MAX_DOC_BYTES = 64 << 20
MAX_OBJECTS = 100_000
MAX_FILES = 100_000
MAX_CHUNKS = 4_000_000
MAX_INT = 1 << 53
FILE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
CHECKSUM = re.compile(r"^[0-9a-f]{16}$")
KIND_STORE, KIND_GENERATION, KIND_PART = "cachestore-remote-store", "cachestore-remote-generation", "cachestore-remote-part"


@dataclass(frozen=True)
class FileEntry:
    """One file of a set: its chunks as arrays (object index, offset in it, length, xxh3), in file order."""

    name: str
    size: int
    objects: npt.NDArray[np.int64]
    offsets: npt.NDArray[np.int64]
    lengths: npt.NDArray[np.int64]
    checksums: npt.NDArray[np.uint64]

    @property
    def starts(self) -> npt.NDArray[np.int64]:
        """Where each chunk begins in the file."""
        return (np.cumsum(self.lengths) - self.lengths).astype(np.int64)


@dataclass(frozen=True)
class FileSet:
    """The files of a whole generation or of one part, packed into objects."""

    name: str
    start: int
    stop: int
    objects: tuple[tuple[str, int], ...]  # (name, size)
    files: tuple[FileEntry, ...]

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    @property
    def nbytes(self) -> int:
        return sum(size for _, size in self.objects)


@dataclass(frozen=True)
class GenerationManifest:
    """A generation on the remote: ``layout`` ``"whole"`` (one set, the local generation's files) or
    ``"parts"`` (one set per part, each its samples ``start..stop-1``)."""

    store: str
    generation: int
    num_samples: int
    backend: str
    layout: str
    sets: tuple[FileSet, ...]
    created: float

    @property
    def nbytes(self) -> int:
        return sum(s.nbytes for s in self.sets)


@dataclass(frozen=True)
class PartManifest:
    """Part ``part`` of ``nparts`` of a generation, published by ``node``."""

    store: str
    generation: int
    num_samples: int
    part: int
    nparts: int
    node: str
    set: FileSet
    created: float


# building -----------------------------------------------------------------------
def doc_checksum(doc: Mapping[str, Any]) -> str:
    """xxh3 of a document's canonical JSON without its ``checksum`` field."""
    body = {k: v for k, v in doc.items() if k != "checksum"}
    return xxhash.xxh3_64_hexdigest(json.dumps(body, sort_keys=True).encode())


def encode(doc: dict[str, Any]) -> bytes:
    """A document as the bytes written to the remote, with its checksum."""
    doc = {**doc, "format": FORMAT}
    doc["checksum"] = doc_checksum(doc)
    return json.dumps(doc, sort_keys=True).encode()


def set_doc(fs: FileSet) -> dict[str, Any]:
    return {"name": fs.name, "start": fs.start, "stop": fs.stop,
            "objects": [{"name": n, "size": s} for n, s in fs.objects],
            "files": [{"name": f.name, "size": f.size,
                       "chunks": [[int(o), int(off), int(n), f"{int(c):016x}"] for o, off, n, c in
                                  zip(f.objects, f.offsets, f.lengths, f.checksums)]} for f in fs.files]}


def generation_doc(m: GenerationManifest) -> dict[str, Any]:
    return {"kind": KIND_GENERATION, "store": m.store, "generation": m.generation, "num_samples": m.num_samples,
            "backend": m.backend, "layout": m.layout, "created": m.created, "sets": [set_doc(s) for s in m.sets]}


def part_doc(m: PartManifest) -> dict[str, Any]:
    return {"kind": KIND_PART, "store": m.store, "generation": m.generation, "num_samples": m.num_samples,
            "part": m.part, "nparts": m.nparts, "node": m.node, "created": m.created, "set": set_doc(m.set)}


# parsing ------------------------------------------------------------------------
class _Doc:
    """Typed field access to one JSON object of a document, every failure naming `where`."""

    def __init__(self, value: object, where: str, what: str) -> None:
        if not isinstance(value, dict):
            raise RemoteManifestError(f"{where}: {what} is not a JSON object")
        self.d, self.where, self.what = value, where, what

    def fail(self, field: str, why: str) -> RemoteManifestError:
        return RemoteManifestError(f"{self.where}: {self.what}: field {field!r} {why}; the remote's manifest is "
                                   "malformed (written by something else, or damaged): nothing was read from it")

    def integer(self, field: str, lo: int = 0, hi: int = MAX_INT) -> int:
        value = self.d.get(field)
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(field, f"must be an int from {lo} to {hi}")
        return value

    def text(self, field: str, pattern: re.Pattern[str] | None = None, choices: Sequence[str] = ()) -> str:
        value = self.d.get(field)
        if not isinstance(value, str) or len(value) > 256 or (pattern is not None and not pattern.match(value)) \
                or (choices and value not in choices):
            raise self.fail(field, "is missing or not an allowed name")
        return value

    def number(self, field: str) -> float:
        value = self.d.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 <= value < 1e11:
            raise self.fail(field, "must be a timestamp")
        return float(value)

    def items(self, field: str, most: int) -> list[Any]:
        value = self.d.get(field)
        if not isinstance(value, list) or len(value) > most:
            raise self.fail(field, f"must be a list of at most {most} entries")
        return value


def load(data: bytes, where: str, kind: str) -> _Doc:
    """Parse a document of `kind`: bounded, JSON, its checksum right."""
    if len(data) > MAX_DOC_BYTES:
        raise RemoteManifestError(f"{where}: {len(data)} bytes, more than a manifest may hold ({MAX_DOC_BYTES})")
    try:
        value = json.loads(data)
    except (ValueError, RecursionError) as exc:
        raise RemoteManifestError(f"{where} is not valid JSON ({str(exc)[:200]}); the remote is damaged or was "
                                  "written by something else") from None
    doc = _Doc(value, where, "the document")
    if doc.d.get("kind") != kind or doc.d.get("format") != FORMAT:
        raise doc.fail("kind", f"must be {kind!r} of format {FORMAT} (a newer cachestore may have written it)")
    if doc.d.get("checksum") != doc_checksum(doc.d):
        raise RemoteManifestError(f"{where} does not match its checksum (damaged or edited)")
    return doc


def _file(value: object, where: str, nobjects: list[int]) -> FileEntry:
    doc = _Doc(value, where, "a file entry")
    name = doc.text("name", FILE_NAME)
    size = doc.integer("size")
    chunks = doc.items("chunks", MAX_CHUNKS)
    rows = np.zeros((len(chunks), 3), dtype=np.int64)
    sums = np.zeros(len(chunks), dtype=np.uint64)
    for j, chunk in enumerate(chunks):
        if not (isinstance(chunk, list) and len(chunk) == 4 and all(
                isinstance(x, int) and not isinstance(x, bool) and 0 <= x < MAX_INT for x in chunk[:3])
                and isinstance(chunk[3], str) and CHECKSUM.match(chunk[3])):
            raise doc.fail("chunks", f"entry {j} of file {name!r} is not [object, offset, length, checksum]")
        obj, off, length = chunk[:3]
        if obj >= len(nobjects) or off + length > nobjects[obj] or length == 0:
            raise doc.fail("chunks", f"entry {j} of file {name!r} lies outside object {obj}'s declared size")
        rows[j] = (obj, off, length)
        sums[j] = int(chunk[3], 16)
    if int(rows[:, 2].sum()) != size:
        raise doc.fail("chunks", f"of file {name!r} hold {int(rows[:, 2].sum())} bytes, not its size {size}")
    return FileEntry(name, size, rows[:, 0].copy(), rows[:, 1].copy(), rows[:, 2].copy(), sums)


def parse_set(value: object, where: str, num_samples: int) -> FileSet:
    doc = _Doc(value, where, "a set of files")
    name = doc.text("name", SET_NAME)
    start, stop = doc.integer("start", 0, num_samples), doc.integer("stop", 0, num_samples)
    if start > stop:
        raise doc.fail("stop", "is before start")
    objects = []
    for j, entry in enumerate(doc.items("objects", MAX_OBJECTS)):
        obj = _Doc(entry, where, f"object {j}")
        objects.append((obj.text("name", OBJECT_NAME), obj.integer("size", 1)))
    if len({n for n, _ in objects}) != len(objects):
        raise doc.fail("objects", "names an object twice")
    sizes = [s for _, s in objects]
    files = tuple(_file(f, where, sizes) for f in doc.items("files", MAX_FILES))
    if len({f.name for f in files}) != len(files):
        raise doc.fail("files", "names a file twice")
    # A publish packs the files' bytes side by side: chunks holding more than their object would make a
    # download write that object many times over (300 chunks of one 3.5 KB object: 300 times its size).
    held = np.zeros(len(sizes), dtype=np.int64)
    for f in files:
        np.add.at(held, f.objects, f.lengths)
    over = np.flatnonzero(held > np.asarray(sizes, dtype=np.int64))
    if over.size:
        raise doc.fail("files", f"chunks hold {int(held[over[0]])} bytes of object {int(over[0])}, which takes "
                                f"{sizes[int(over[0])]}: a publish never repeats an object's bytes")
    return FileSet(name, start, stop, tuple(objects), files)


def parse_generation(data: bytes, where: str, store: str, generation: int) -> GenerationManifest:
    """A generation manifest, checked to be `generation` of `store` (see the module docstring)."""
    doc = load(data, where, KIND_GENERATION)
    if doc.text("store", STORE_KEY) != store or doc.integer("generation", 0, MAX_GENERATION) != generation:
        raise doc.fail("store", f"names another store or generation than {store} {generation}")
    n = doc.integer("num_samples")
    layout = doc.text("layout", choices=("whole", "parts"))
    sets = tuple(parse_set(s, where, n) for s in doc.items("sets", MAX_PARTS))
    if not sets:
        raise doc.fail("sets", "is empty")
    if layout == "whole" and (len(sets) != 1 or sets[0].name != "whole" or (sets[0].start, sets[0].stop) != (0, n)):
        raise doc.fail("sets", "of a whole generation must be one set 'whole' of every sample")
    if layout == "parts":
        check_tiling([(s.start, s.stop) for s in sets], n, doc)
    return GenerationManifest(store, generation, n, doc.text("backend", re.compile(r"^[a-z][a-z0-9_]{0,31}$")),
                              layout, sets, doc.number("created"))


def check_tiling(ranges: list[tuple[int, int]], n: int, doc: _Doc) -> None:
    """The parts' ranges, in order, cover ``0..n-1`` once."""
    edge = 0
    for start, stop in ranges:
        if start != edge:
            raise doc.fail("sets", f"parts do not cover the samples in order (a part starts at {start}, not {edge})")
        edge = stop
    if edge != n:
        raise doc.fail("sets", f"parts end at sample {edge}, not {n}")


def parse_part(data: bytes, where: str, store: str, generation: int, part: int, nparts: int) -> PartManifest:
    doc = load(data, where, KIND_PART)
    if (doc.text("store", STORE_KEY), doc.integer("generation", 0, MAX_GENERATION), doc.integer("part", 0, MAX_PARTS),
            doc.integer("nparts", 1, MAX_PARTS)) != (store, generation, part, nparts):
        raise doc.fail("part", f"names another store, generation or part than {store} {generation} {part}/{nparts}")
    n = doc.integer("num_samples")
    fs = parse_set(doc.d.get("set"), where, n)
    return PartManifest(store, generation, n, part, nparts, doc.text("node")[:128], fs, doc.number("created"))


def parse_store(data: bytes, where: str, store: str) -> dict[str, Any]:
    """The remote ``store.json``: ``backend``, ``compression``, ``fingerprint`` (JSON), ``fingerprint_hash``."""
    doc = load(data, where, KIND_STORE)
    backend = doc.text("backend", re.compile(r"^[a-z][a-z0-9_]{0,31}$"))
    fp_hash = doc.text("fingerprint_hash", re.compile(r"^[0-9a-f]{16}$"))
    if f"{backend}-{fp_hash}" != store:
        raise doc.fail("fingerprint_hash", f"does not match the store's key {store}")
    compression = doc.d.get("compression")
    if compression not in (None, "zstd"):
        raise doc.fail("compression", "must be null or 'zstd'")
    return {"backend": backend, "fingerprint_hash": fp_hash, "compression": compression,
            "fingerprint": doc.d.get("fingerprint"), "producer": doc.d.get("producer"),
            "format": doc.integer("store_format", 0, 1000)}


def check_sizes(fs: FileSet, real: Mapping[str, int], where: str) -> None:
    """Every object of `fs` is on the remote with exactly its declared size (`real`: name -> size)."""
    for name, size in fs.objects:
        found = real.get(name)
        if found is None:
            raise RemoteManifestError(f"{where}: object {name} it names is missing from the remote")
        if found != size:
            raise RemoteManifestError(f"{where}: object {name} is {found} bytes on the remote, the manifest says "
                                      f"{size}")
