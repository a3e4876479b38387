"""The bytes the fingerprint's value hasher writes for plain scalars, written without a call each:
a dataset indexed by a million ``(path, class)`` pairs is hashed at the speed of joining bytes
(:mod:`loader.cache.fingerprint` writes them; ``docs/ARCHITECTURE.md``)."""

from __future__ import annotations

from typing import Any

#: Items the value hasher writes itself, with the type tags its ``tag`` writes.
FLAT: frozenset[type] = frozenset({str, int, bool, float, type(None)})
TAGS = {kind: len(kind.__name__).to_bytes(8, "little") + kind.__name__.encode() for kind in FLAT}
TUPLE_TAG = (5).to_bytes(8, "little") + b"tuple"
#: What an image folder's (path, class) pair starts with: ``tag("tuple", 2)`` and a string's tag.
PAIR_HEAD = TUPLE_TAG + (1).to_bytes(8, "little") + b"2" + TAGS[str]
#: The bytes of small lengths and of the small ints labels are, made once.
LENGTHS = [n.to_bytes(8, "little") for n in range(4097)]
SMALL_INTS = {k: TAGS[int] + len(str(k)).to_bytes(8, "little") + str(k).encode() for k in range(-1, 4096)}


def flat(item: Any, kind: type, chunks: list[bytes], paths: list[str]) -> None:
    """Append what ``tag(kind.__name__, item)`` hashes for a plain scalar; a string may name a file."""
    if kind is str:
        data = item.encode("utf-8", "surrogatepass")
    else:  # a float by its exact value, as feed() tags it
        data = (item.hex() if kind is float else str(item)).encode()
    chunks += (TAGS[kind], len(data).to_bytes(8, "little"), data)
    if kind is str:
        paths.append(item)
