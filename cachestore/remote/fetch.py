"""Fetching a published generation into a local store, every byte and record verified.

The files are downloaded into a staging area by parallel streamed reads, each chunk checked
as it lands (:mod:`.download`); a memmap generation's column rows are checked against the
store's checksums as they land too (:class:`~.verify.ColumnCheck`). :func:`fetch` then checks
the generation as a commit would have left it and every other record (:mod:`.verify`), and installs it:
the staging area is renamed ``gen-NNNNNN`` under the store's writer lease, as a commit does.
A generation published as parts is assembled from them instead (:mod:`.parts`).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import TYPE_CHECKING

from ..backends import settling
from ..backends.base import GenerationInfo
from ..backends.memmap_files import SCHEMA
from ..errors import CacheStoreError, GenerationCommitted, GenerationNotFoundError
from ..store import Store
from .download import download_set, object_sizes
from .leases import ReaderLease
from .manifest import FileSet
from .parts import fetch_parts
from .verify import INDEX, ColumnCheck, verify_generation

if TYPE_CHECKING:
    from .base import RemoteBase


def fetch(remote: "RemoteBase", local: Store, generation: int | None = None) -> GenerationInfo:
    """Download published `generation` (the newest when ``None``) of `remote` into the local store `local`.

    The local store becomes as if it had committed the generation itself. Nothing is
    computed; the dataset is never called.

    Raises
    ------
    GenerationNotFoundError
        The remote has no such complete generation.
    BudgetExceededError
        The generation does not fit the local store's budget (read it with ``remote.reader()``).
    RemoteCorruptError, RemoteManifestError, CorruptSampleError
        The remote's copy is damaged or malformed; nothing is left in `local`.
    """
    if generation is None:
        generation = remote.latest()
        if generation is None:
            raise GenerationNotFoundError(f"{remote.path} has no complete generation to fetch")
    existing = _committed(local, generation)
    if existing is not None:
        return existing
    try:
        return _fetch(remote, local, generation)
    except GenerationCommitted:
        # Another process on the same local store (a rank of the node, another job) fetched or wrote
        # it meanwhile: it is there, as the caller wanted.
        existing = _committed(local, generation)
        if existing is None:
            raise
        return existing


def _committed(local: Store, generation: int) -> GenerationInfo | None:
    return next((g for g in local.generations() if g.id == generation and g.committed), None)


def _fetch(remote: "RemoteBase", local: Store, generation: int) -> GenerationInfo:
    """:func:`fetch` of a generation `local` did not hold when asked."""
    m = remote.manifest(generation)
    if m.backend != local.backend_name:
        raise CacheStoreError(f"generation {generation} on {remote.path} is a {m.backend} generation; "
                              f"{local.path} is a {local.backend_name} store")
    if m.layout == "parts":
        fetch_parts(remote, local, generation, len(m.sets))
        info = _committed(local, generation)
        if info is None:
            raise GenerationNotFoundError(f"generation {generation} of {local.path} vanished as it was fetched")
        return info
    fs = m.sets[0]
    with ReaderLease(remote, generation):
        object_sizes(remote, generation, fs)
        writer = local.writer(generation, m.num_samples)
        try:
            total = sum(f.size for f in fs.files)
            if m.num_samples:
                writer.token.write_budget().check_projection(generation, total / m.num_samples, m.num_samples)
            where = f"generation {generation} from {remote.path}"
            staging = Path(writer.token.path)
            checked = _download(remote, local, generation, fs, staging, where)
            verify_generation(local.backend, staging, generation, m.num_samples, local.allow_pickle, where, checked)
            # Installed before the disk has the bytes (the remote's copy is the durable one), marked with this
            # boot: a restart before they settle makes it damage, fetched again (cachestore/backends/settling.py).
            marked = settling.mark(staging)
            if not marked:
                settling.sync_files(staging)
            info = writer.install()
        except BaseException:
            writer.abort()
            raise
    if marked and info.path is not None:
        settling.settle_later(Path(info.path))
    return info


def _download(remote: "RemoteBase", local: Store, generation: int, fs: FileSet, staging: Path, where: str) -> bool:
    """Download `fs` into `staging`; whether its column rows were checked as they landed (a memmap
    generation with columns: its index and schema are downloaded first, for a :class:`ColumnCheck`)."""
    first = tuple(f for f in fs.files if f.name in (INDEX, SCHEMA))
    if local.backend_name != "memmap" or len(first) != 2:
        download_set(remote, generation, fs, staging, sync=False)
        return False
    rest = tuple(f for f in fs.files if f.name not in (INDEX, SCHEMA))
    download_set(remote, generation, replace(fs, files=first), staging, sync=False)
    check = ColumnCheck(staging, local.allow_pickle, where)
    try:
        download_set(remote, generation, replace(fs, files=rest), staging, landed=check.landed, sync=False)
        check.finish()
    finally:
        check.close()
    return True
