"""Records: the self-describing byte form of one sample, used by the variable-size layouts.

A record is a 16-byte header, the sample's structure (its treedef, :mod:`cachestore.format.codec`) as
JSON, then each leaf, 16-byte aligned so leaves can be viewed in place without a copy. The
header holds a magic number, flags (zstd), the length of the structure JSON and the bytes of
the sample's leaves (0 where they do not fit 32 bits, and in records written before it was
recorded). With zstd, everything after the header is one compressed frame.

A record is read back from a store, which anyone may have written (docs/ARCHITECTURE.md,
"Untrusted stores"): its structure is parsed strictly (:func:`cachestore.format.structure.parse_treedef`),
every leaf must lie inside the record, and a compressed body is never decompressed beyond the
size its index (or header) gives, however large a size its frame declares.
"""

from __future__ import annotations

import json
import math
import struct
import threading
from typing import TYPE_CHECKING, Any, Sequence, cast

import numpy as np

from ..errors import CorruptSampleError, MalformedFileError, UnsupportedSampleError
from ..guard.untrusted import parse_json
from .codec import Leaf, TreeDef, leaf_bytes, leaf_specs, treedef_to_json
from .structure import parse_treedef

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer
    from zstandard import ZstdCompressor, ZstdDecompressor

    from .native import Bytes

_MAGIC = b"CSR1"
_HEADER = struct.Struct("<4sIII")  # magic, flags, structure length, leaf bytes (0: not recorded)
_FLAG_ZSTD = 1
ALIGN = 16
#: The structure JSON of one record at most: a sample of thousands of leaves takes far less.
MAX_STRUCTURE_BYTES = 4 << 20


def _pad(n: int) -> int:
    return -n % ALIGN


_local = threading.local()


def _zstd() -> tuple[ZstdCompressor, ZstdDecompressor]:
    # zstd contexts are not thread-safe; one pair per thread (and so per process).
    pair = getattr(_local, "zstd", None)
    if pair is None:
        import zstandard

        pair = (zstandard.ZstdCompressor(level=3), zstandard.ZstdDecompressor())
        _local.zstd = pair
    return pair


def encode_record(treedef: TreeDef, leaves: Sequence[Leaf], compress: bool = False) -> bytes:
    """Serialise one flattened sample into a self-describing record.

    Raises
    ------
    UnsupportedSampleError
        The sample's structure takes more than :data:`MAX_STRUCTURE_BYTES` as JSON (no reader
        would take it back).
    """
    meta = json.dumps(treedef_to_json(treedef), separators=(",", ":")).encode()
    if len(meta) > MAX_STRUCTURE_BYTES:
        raise UnsupportedSampleError(f"a sample of {len(leaves)} leaves has a structure of {len(meta)} bytes, "
                                     f"more than the {MAX_STRUCTURE_BYTES} a record holds; store fewer, larger arrays")
    parts: list[Any] = [meta, bytes(_pad(len(meta)))]
    raw = 0
    for leaf in leaves:
        parts.append(leaf_bytes(leaf))
        parts.append(bytes(_pad(leaf.nbytes)))
        raw += leaf.nbytes
    body = b"".join(parts)
    flags = 0
    if compress:
        body = _zstd()[0].compress(body)
        flags |= _FLAG_ZSTD
    return _HEADER.pack(_MAGIC, flags, len(meta), raw if raw < 1 << 32 else 0) + body


#: ``(dtype, shape, count, nbytes)`` of each leaf of a record.
LeafLayout = list[tuple[np.dtype[np.generic], tuple[int, ...], int, int]]
#: Record structure JSON -> (treedef, leaf layout): parsing it and sizing its leaves again for
#: every record cost more than reading a 48 KiB sample.
_treedef_cache: dict[bytes, tuple[TreeDef, LeafLayout]] = {}


def _structure(meta: bytes) -> tuple[TreeDef, LeafLayout]:
    """``(treedef, [(dtype, shape, count, nbytes) per leaf])`` of a record's structure JSON."""
    cached = _treedef_cache.get(meta)
    if cached is None:
        try:
            treedef = parse_treedef(parse_json(meta, "the record's structure", MAX_STRUCTURE_BYTES),
                                    "the record's structure")
        except MalformedFileError as exc:
            raise CorruptSampleError(f"record structure is unreadable: {exc}") from None
        layout = [(dtype, shape, math.prod(shape), dtype.itemsize * math.prod(shape))
                  for dtype, shape in leaf_specs(treedef)]
        cached = (treedef, layout)
        if len(_treedef_cache) < 4096:  # bounded: variable-shape data would grow it forever
            _treedef_cache[meta] = cached
    return cached


def _read_header(view: memoryview) -> tuple[int, int, int]:
    """``(flags, structure length, leaf bytes or 0)`` of a record, checking its magic."""
    if len(view) < _HEADER.size:
        raise CorruptSampleError("record shorter than its header")
    magic, flags, meta_len, raw = _HEADER.unpack_from(view)
    if magic != _MAGIC:
        raise CorruptSampleError("record has a bad magic number")
    if meta_len > MAX_STRUCTURE_BYTES:
        raise CorruptSampleError(f"record says its structure takes {meta_len} bytes, more than a record holds")
    return flags, meta_len, raw


def record_layout(buf: Bytes) -> tuple[TreeDef, int, list[tuple[int, int]]] | None:
    """Where the leaves of an uncompressed record lie, so a batch can be gathered without decoding.

    Returns ``(treedef, head, [(offset, nbytes) per leaf])`` with offsets from the start of
    the record; ``head`` is the length of header plus structure JSON, so records of the same
    length whose first ``head`` bytes are equal share this layout. ``None`` for a compressed
    record.
    """
    view = memoryview(cast("ReadableBuffer", buf)).cast("B")
    flags, meta_len, _ = _read_header(view)
    if flags & _FLAG_ZSTD:
        return None
    head = _HEADER.size + meta_len
    if head > len(view):
        raise CorruptSampleError("record is truncated")
    treedef, layout = _structure(bytes(view[_HEADER.size:head]))
    offset, spans = head + _pad(meta_len), []
    for _, _, _, nbytes in layout:
        if offset + nbytes > len(view):
            raise CorruptSampleError("record is truncated")
        spans.append((offset, nbytes))
        offset += nbytes + _pad(nbytes)
    return treedef, head, spans


def body_bound(meta_len: int, raw: int) -> int:
    """The most bytes the body of a record can take whose structure JSON takes `meta_len` bytes and
    whose leaves `raw`: the structure, the leaves, and the padding of each (a leaf takes at
    least 4 bytes of the structure, ``["i"]``)."""
    return meta_len + raw + (ALIGN - 1) * (meta_len // 4 + 2)


def _decompress(body: memoryview, bound: int | None) -> memoryview:
    """The compressed body of a record, decompressed to at most `bound` bytes.

    The bound is checked before anything is allocated: a frame declares its size, and the
    decompressor allocates that size (whatever ``max_output_size`` says): a 45 KB record
    declaring 1.5 GB was 1.5 GB allocated before it failed.
    """
    import zstandard

    try:
        declared = zstandard.frame_content_size(body)
        if bound is not None and declared > bound:
            raise CorruptSampleError(f"record decompresses to {declared} bytes, its index (or the store's "
                                     f"max_sample_bytes) says at most {bound}")
        if declared < 0 and bound is None:
            raise CorruptSampleError("record's compressed frame does not say its size")
        return memoryview(_zstd()[1].decompress(body, max_output_size=bound or 0))
    except zstandard.ZstdError as exc:
        raise CorruptSampleError(f"record does not decompress: {exc}") from None


def decode_record(buf: Bytes, copy: bool = True, raw: int | None = None,
                  limit: int | None = None) -> tuple[TreeDef, list[Leaf]]:
    """Parse a record into ``(treedef, leaves)``.

    With ``copy=False`` and an uncompressed record, leaves are read-only views
    into `buf` (valid only as long as `buf` is). `raw` is the bytes of the sample's leaves as
    its index gives them, which bounds a compressed body (else the record's header does,
    where it says; see :func:`_decompress`); `limit` (the store's ``max_sample_bytes``) bounds
    it whatever they say, since whoever wrote the record wrote them too.

    Raises
    ------
    CorruptSampleError
        The record is truncated, its structure malformed, or its body larger than its bound.
    """
    view = memoryview(cast("ReadableBuffer", buf)).cast("B")
    flags, meta_len, header_raw = _read_header(view)
    body = view[_HEADER.size:]
    if flags & _FLAG_ZSTD:
        known = [r for r in (raw, header_raw or None, limit) if r is not None]
        body = _decompress(body, body_bound(meta_len, min(known)) if known else None)
    if meta_len > len(body):
        raise CorruptSampleError("record is truncated")
    treedef, layout = _structure(bytes(body[:meta_len]))
    offset = meta_len + _pad(meta_len)
    leaves = []
    for dtype, shape, count, nbytes in layout:
        if offset + nbytes > len(body):
            raise CorruptSampleError("record is truncated")
        arr = np.frombuffer(body, dtype=dtype, count=count, offset=offset).reshape(shape)
        leaves.append(arr.copy() if copy else arr)
        offset += nbytes + _pad(nbytes)
    return treedef, leaves
