"""Every file of a store is untrusted input: the strict parsers of what a store reads back.

A store is a directory on a shared disk (a cluster's scratch space, a copy someone sent), or
objects on a shared bucket: whoever can write those files must not get into the process, the
files or the data of whoever reads them. So nothing a store reads is taken as it was written:

* **names** are ASCII digits and the store's own patterns (:func:`decimal`, :func:`file_name`):
  ``gen-²`` or ``gen-٠`` is nobody's generation (``str.isdigit`` takes both, and ``int`` reads
  the second as 0), and a shard named ``../../x`` is no file of the store;
* **documents** (``store.json``, manifests, schemas, shard lists, record structures) are bounded
  in size before they are parsed and in depth after (:func:`parse_json`), and every field is
  checked for its type and range (:func:`parse_store_meta`, :func:`parse_manifest`,
  :func:`parse_shard_ids`; a sample's structure by :func:`cachestore.format.structure.parse_treedef`);
* **index rows** name only shards that exist and only offsets and sizes that can be
  (:func:`check_index_rows`), so that no size is allocated before it is checked.

A malformed field is a :class:`~cachestore.errors.MalformedFileError` naming the file; the
catalog reports a generation holding one as damaged. Sizes are checked against the files
elsewhere (:mod:`cachestore.backends.manifest`); what a file's bytes mean is covered by
checksums (records, and the schema through the manifest's own checksum). Code comments cite
docs/ARCHITECTURE.md, "Untrusted stores".
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import Any, Sequence, TypeGuard

import numpy as np
import numpy.typing as npt

from . import safefs
from ..errors import MalformedFileError
from .trust import Trust

#: The bytes a document of the store may take: a manifest lists every data file, and shard lists grow
#: with the workers; everything else is far smaller.
DOCUMENT_BYTES = 16 << 20
#: Nesting of a document (or of a sample's structure) beyond which it is refused, so that no parser
#: (nor ``json.dumps`` of a fingerprint, nor ``inspect``) recurses into a RecursionError.
MAX_DEPTH = 64
#: Samples of one generation.
MAX_SAMPLES = 1 << 40
#: Bytes of one leaf of one sample: beyond any disk, and far inside an int64.
MAX_LEAF_BYTES = 1 << 48
_DIGITS = re.compile(r"[0-9]{1,18}", re.ASCII)
#: The largest number a name of the store holds (generation ids, pids): 18 digits.
MAX_DECIMAL = 10 ** 18 - 1
LAYOUTS = (None, "fixed", "records", "mixed")
COMPRESSIONS = (None, "zstd")


def decimal(text: str) -> int | None:
    """`text` as an int when it is 1 to 18 ASCII digits, else ``None``.

    ``str.isdigit`` and ``int`` take any Unicode digit (``"²"`` passes the first and fails the
    second; ``"٠"`` passes both, as 0), so two names could be one generation to ``int``.
    """
    return int(text) if _DIGITS.fullmatch(text) else None


def is_file_name(name: object) -> TypeGuard[str]:
    """Whether `name` can be the name of a file in one of the store's directories: a str of 1 to
    200 characters the file system can take, no separator, not ``.`` or ``..``."""
    if not isinstance(name, str) or not 0 < len(name) <= 200 or "/" in name or "\0" in name or name in (".", ".."):
        return False
    try:
        os.fsencode(name)
    except UnicodeError:  # a lone surrogate from a JSON escape: no file has that name
        return False
    return True


def file_name(name: object, where: str) -> str:
    """`name` (read from `where`) when it can name a file of the store (:func:`is_file_name`);
    else :class:`MalformedFileError`. Only a name inside the store's directory, which the store
    then opens without following a symlink (:mod:`cachestore.guard.safefs`)."""
    if not is_file_name(name):
        raise MalformedFileError(f"{where} names {shown(name)}, which is no file of the store "
                                 "(a path outside its directory?); the store is damaged or was tampered with")
    return name


def _depth_exceeds(obj: object, limit: int) -> bool:
    """Whether `obj` (parsed JSON) nests lists and dicts deeper than `limit` (walked without recursion)."""
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        node, depth = stack.pop()
        children: Sequence[object] | None = (list(node.values()) if isinstance(node, dict)
                                             else node if isinstance(node, list) else None)
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def parse_json(data: bytes | memoryview, where: str, limit: int = DOCUMENT_BYTES) -> Any:
    """The JSON document `data` (from `where`), at most `limit` bytes and :data:`MAX_DEPTH` deep.

    Raises
    ------
    MalformedFileError
        Naming `where`, for a document too large, nested too deeply or not JSON.
    """
    if len(data) > limit:
        raise MalformedFileError(f"{where} takes {len(data)} bytes, more than the {limit} a store writes there")
    try:
        obj = json.loads(bytes(data))
    except RecursionError:
        raise MalformedFileError(f"{where} is nested too deeply to be a document of the store") from None
    except (ValueError, UnicodeDecodeError) as exc:
        raise MalformedFileError(f"{where} is not JSON ({exc})") from None
    if _depth_exceeds(obj, MAX_DEPTH):
        raise MalformedFileError(f"{where} is nested deeper than {MAX_DEPTH} levels, which the store never writes")
    return obj


def read_document(path: str | os.PathLike[str], what: str = "", limit: int = DOCUMENT_BYTES,
                  trust: Trust | None = None) -> Any:
    """The JSON document in the store's file `path`: never through a symlink nor a FIFO, its size
    checked before it is read (see :func:`parse_json`), its owner one `trust` trusts where given
    (:class:`~cachestore.errors.UntrustedOwnerError`). A missing file is ``FileNotFoundError``."""
    fd = safefs.open_nofollow(path, os.O_RDONLY, what=what)
    try:
        if trust is not None:
            trust.check_fd(fd, path, what or "the file")
        size = os.fstat(fd).st_size
        if size > limit:
            raise MalformedFileError(f"{path} takes {size} bytes, more than the {limit} a store writes there")
        data = os.pread(fd, limit + 1, 0)
    finally:
        os.close(fd)
    return parse_json(data, str(path), limit)


def integer_in(value: object, where: str, name: str, low: int = 0, high: int = MAX_LEAF_BYTES) -> int:
    """`value` when it is an int (not a bool) in ``low..high``, else a :class:`MalformedFileError`
    naming `where` and the field `name`."""
    if type(value) is not int or not low <= value <= high:
        raise MalformedFileError(f"{where}: {name!r} is {shown(value)}, not an integer in {low}..{high}")
    return value


def shown(value: object) -> str:
    """`value` as a message shows it: its repr, cut to 80 characters (the value is anyone's)."""
    text = repr(value)
    return text if len(text) <= 80 else text[:77] + "..."


def _optional(doc: dict[str, Any], key: str, types: tuple[type, ...], where: str) -> None:
    value = doc.get(key)
    if value is not None and (not isinstance(value, types) or isinstance(value, bool)):
        kinds = " or ".join(t.__name__ for t in types)
        raise MalformedFileError(f"{where}: {key!r} is {shown(value)}, not {kinds}")


def parse_store_meta(obj: object, path: str) -> dict[str, object]:
    """``store.json`` (`obj` as parsed) with every field the store reads checked.

    Unknown fields stay (a newer cachestore may add some); ``format`` is an int, ``backend`` a
    str, ``compression`` one the store knows, ``fingerprint`` and ``producer`` objects.
    """
    if not isinstance(obj, dict):
        raise MalformedFileError(f"{path} holds a {type(obj).__name__}, not the store's metadata (a JSON object)")
    integer_in(obj.get("format", 0), path, "format", 0, 1 << 16)
    _optional(obj, "backend", (str,), path)
    _optional(obj, "fingerprint", (dict,), path)
    _optional(obj, "producer", (dict,), path)
    _optional(obj, "created", (int, float), path)
    if obj.get("compression") not in COMPRESSIONS:
        raise MalformedFileError(f"{path}: 'compression' is {shown(obj.get('compression'))}, not one of "
                                 f"{COMPRESSIONS} (written by a newer cachestore?)")
    return obj


def parse_manifest(obj: object, path: str, generation: int) -> dict[str, Any]:
    """A generation's manifest (`obj` as parsed) with every common field checked.

    The fields a commit writes: ``generation`` (the one its directory names), ``num_samples``,
    ``created``, ``layout``, ``files`` (``{name: bytes}``, none in older stores), ``checksum``,
    ``raw_bytes``, ``stored_bytes``, ``extra``, ``schema`` (a sample structure); a backend's own
    fields (``lmdb_layout``, ``chunk_rows``) are checked by it, their types here.
    """
    if not isinstance(obj, dict):
        raise MalformedFileError(f"{path} holds a {type(obj).__name__}, not a manifest (a JSON object)")
    if type(obj.get("generation")) is not int or obj["generation"] != generation:
        raise MalformedFileError(f"{path}: 'generation' is {shown(obj.get('generation'))}, "
                                 f"not {generation} (the generation its directory names)")
    integer_in(obj.get("num_samples"), path, "num_samples", 0, MAX_SAMPLES)
    if not isinstance(obj.get("created"), (int, float)) or isinstance(obj.get("created"), bool) \
            or not math.isfinite(obj["created"]):
        raise MalformedFileError(f"{path}: 'created' is {shown(obj.get('created'))}, not a time")
    for key in ("raw_bytes", "stored_bytes", "chunk_rows"):
        if key in obj:
            integer_in(obj[key], path, key, 1 if key == "chunk_rows" else 0)
    if obj.get("layout") not in LAYOUTS:
        raise MalformedFileError(f"{path}: 'layout' is {shown(obj.get('layout'))}, not one of {LAYOUTS}")
    _optional(obj, "extra", (dict,), path)
    _optional(obj, "checksum", (str,), path)
    _optional(obj, "lmdb_layout", (str,), path)
    files = obj.get("files", {})
    if not isinstance(files, dict):
        raise MalformedFileError(f"{path}: 'files' is {shown(files)}, not an object of file sizes")
    for name, size in files.items():
        file_name(name, f"{path} ('files')")
        integer_in(size, path, f"files.{name}", 0, 1 << 62)
    return obj


def parse_shard_stats(obj: object, path: str) -> dict[str, Any]:
    """A shard writer's running totals in a staging area (LMDB's ``stats-<shard>.json``, `obj` as
    parsed): ``raw_bytes``, ``stored_bytes``, ``count`` and ``layout`` (``None``, ``"mixed"``, or
    ``[record bytes, structure]``, whose structure the commit parses before it trusts it)."""
    if not isinstance(obj, dict):
        raise MalformedFileError(f"{path} holds a {type(obj).__name__}, not a shard's totals (a JSON object)")
    for key in ("raw_bytes", "stored_bytes"):
        integer_in(obj.get(key), path, key)
    integer_in(obj.get("count", 0), path, "count", 0, MAX_SAMPLES)
    layout = obj.get("layout")
    if not (layout is None or isinstance(layout, str)
            or (isinstance(layout, list) and len(layout) == 2 and type(layout[0]) is int)):
        raise MalformedFileError(f"{path}: 'layout' is {shown(layout)}, not a record layout")
    return obj


def parse_shard_ids(obj: object, path: str) -> list[str]:
    """``shards.json``: the list of a generation's shard names, each a file name of the store."""
    if not isinstance(obj, list):
        raise MalformedFileError(f"{path} holds {shown(obj)}, not a list of shard names")
    names = [file_name(name, str(path)) for name in obj]
    if len(set(names)) != len(names):
        raise MalformedFileError(f"{path} names a shard twice")
    return names


def check_index_rows(rows: npt.NDArray[np.void], num_samples: int, num_shards: int, path: str,
                     first: int = 0) -> None:
    """Rows of a generation's index (fields ``index``, ``shard``, ``offset``, ``length``, ``raw``), or
    of the part of one that holds its samples from `first` on: row ``i`` is sample ``first + i``; its
    shard is ``-1`` (the columns) or one of the `num_shards` listed; offsets, lengths and raw sizes
    are >= 0 and an offset plus its length stays inside an int64. Vectorised: a check of a million rows costs milliseconds, once per opening."""
    if len(rows) != num_samples:
        raise MalformedFileError(f"{path} has {len(rows)} rows, the generation {num_samples} samples")
    if not len(rows):
        return
    why = None
    if not np.array_equal(rows["index"], np.arange(first, first + num_samples)):
        why = f"its rows are not samples {first}..{first + num_samples - 1} in order"
    elif rows["shard"].min() < -1 or rows["shard"].max() >= num_shards:
        bad = rows["shard"][(rows["shard"] < -1) | (rows["shard"] >= num_shards)][0]
        why = f"a row names shard {bad}, and the generation has {num_shards} (shards.json)"
    elif min(rows["offset"].min(), rows["length"].min(), rows["raw"].min()) < 0:
        why = "a row has a negative offset or size"
    elif (rows["length"] > MAX_LEAF_BYTES).any() or (rows["offset"] > (1 << 62)).any():
        why = "a row has an offset or size beyond any file"
    if why is not None:
        raise MalformedFileError(f"{path} is not an index the store wrote: {why}")
