"""The remote layout: every key the remote tier reads or writes, built here and nowhere else.

Below a remote root (``s3://bucket/path`` or ``file:///shared/path``)::

    <store>/store.json                            the store: backend, compression, fingerprint (written once)
    <store>/generations/000003.json               generation 3's manifest: written last, so a generation
                                                  is visible only when every object it names is there
    <store>/data/000003/<set>/pack-00000-<h>.bin  its data: the files of a generation (or of a part),
                                                  packed into large objects named by their content
    <store>/parts/000003/of-0004/part-0001.json   part 1 of 4 of generation 3: written last of the part
    <store>/parts/000003/of-0004/claim-0001.<a>   who computes part 1 (attempt <a>, a conditional create)
    <store>/readers/000003/<reader id>            a lease of a process reading generation 3 (prune keeps it)

``<store>`` is ``<backend>-<fingerprint hash>``: stores of different producers (dataset,
parameters, code) or backends never share a key, so they never mix. ``<set>`` is ``whole``
for a generation published at once, ``part-0001-of-0004`` for a part. Object names carry a
hash of their content, so two nodes publishing the same bytes write the same object and
different bytes never overwrite each other.

Nothing a manifest says becomes a key by itself: keys are built from validated ints and
names that match the patterns below (see :mod:`.manifest`).
"""

from __future__ import annotations

import re

STORE_DOC = "store.json"
#: ``<backend>-<16 hex digits>``: the key of a store below a root.
STORE_KEY = re.compile(r"^[a-z][a-z0-9_]{0,31}-[0-9a-f]{16}$")
OBJECT_NAME = re.compile(r"^pack-[0-9]{5}-[0-9a-f]{16}\.bin$")
SET_NAME = re.compile(r"^(whole|part-[0-9]{4}-of-[0-9]{4})$")
MAX_GENERATION = 999_999
MAX_PARTS = 9999


def store_key(backend: str, fingerprint_hash: str) -> str:
    """The key of the store of `backend` whose fingerprint hashes to `fingerprint_hash`."""
    return f"{backend}-{fingerprint_hash[:16]}"


def store_doc(store: str) -> str:
    return f"{store}/{STORE_DOC}"


def generation_manifest(store: str, generation: int) -> str:
    return f"{store}/generations/{generation:06d}.json"


def generations_prefix(store: str) -> str:
    return f"{store}/generations"


def parse_generation_manifest(name: str) -> int | None:
    """The generation of a manifest's file name (``000003.json``), ``None`` if it is not one."""
    m = re.match(r"^([0-9]{6})\.json$", name)
    return int(m.group(1)) if m else None


def data_prefix(store: str, generation: int, set_name: str = "") -> str:
    base = f"{store}/data/{generation:06d}"
    return f"{base}/{set_name}" if set_name else base


def data_object(store: str, generation: int, set_name: str, object_name: str) -> str:
    return f"{data_prefix(store, generation, set_name)}/{object_name}"


def part_set(part: int, nparts: int) -> str:
    return f"part-{part:04d}-of-{nparts:04d}"


def parts_prefix(store: str, generation: int, nparts: int | None = None) -> str:
    base = f"{store}/parts/{generation:06d}"
    return base if nparts is None else f"{base}/of-{nparts:04d}"


def part_manifest(store: str, generation: int, part: int, nparts: int) -> str:
    return f"{parts_prefix(store, generation, nparts)}/part-{part:04d}.json"


def claim_key(store: str, generation: int, part: int, nparts: int, attempt: int) -> str:
    return f"{parts_prefix(store, generation, nparts)}/claim-{part:04d}.{attempt}"


def parse_claim(name: str) -> tuple[int, int] | None:
    """``(part, attempt)`` of a claim's name, ``None`` if it is not one."""
    m = re.match(r"^claim-([0-9]{4})\.([0-9]{1,6})$", name)
    return (int(m.group(1)), int(m.group(2))) if m else None


def readers_prefix(store: str, generation: int | None = None) -> str:
    return f"{store}/readers" if generation is None else f"{store}/readers/{generation:06d}"
