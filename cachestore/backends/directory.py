"""The on-disk catalog shared by the file-based backends (memmap, lmdb).

Layout of a store directory::

    store.json                     format version, backend, fingerprint, producer
    writer.lock                    present while a writer lives (see locking.py)
    gen-000003/                    a committed generation: manifest.json + data
    .staging-000004-<pid>-<hex>/   a generation being written (or a partial one kept); never read as one
    rotation-<pid>-<hex>/          a process's rotation window (see cachestore/space/scratch.py)

Commit protocol (why each step): data files are fsync'ed first, so the
manifest never names bytes still in the page cache only; the manifest is
written to a temp name, fsync'ed and renamed, so it is whole or absent; the
staging directory is then renamed to ``gen-NNNNNN`` in one ``rename(2)``, which
is atomic, and the parent directory fsync'ed so the rename survives a power
cut. A reader therefore sees a generation complete or not at all, and a crash
at any point leaves only a ``.staging-*`` directory, which the next writer adopts
(below) or removes. A fetch installs before the fsync, marked (:mod:`.settling`).

Partial generations: every staging area records its producer in
``staging.json`` (generation, sample count, compression and the hash of the
store's fingerprint). A writer that gives up without committing can *keep*
its staging area (``kept: true``) instead of removing it, and a crashed
writer leaves its own behind. The next writer of the same generation whose
record matches (``Store.writer(..., resume=True)``) *adopts* it: renames it
to its own name, renames the shards it finds (so its own shard ids never
append to or truncate someone else's), drops index entries that are out of
range, duplicated or fail their checksum, and continues; ``present()`` says
which indices are already in. Anything else is debris. Durability: a record
is indexed only after its bytes were written, so what the index lists
survives the writer's process being killed (the page cache keeps it);
commit fsyncs everything as before.

Damage after a commit: since a ``gen-NNNNNN`` directory only ever appears
whole, one that cannot be served is damage, never a commit in progress. The
manifest records the size of every data file and its own checksum, so
listing finds a missing, garbage or edited manifest, a missing, truncated or
symlinked file, without reading data (``GenerationInfo.damaged``); opening
adds the backend's checks (``_check_files``, LMDB's record count). Damaged
generations are listed with ``committed=False``, pruned whatever ``keep``
says, and replaced by the next writer of their id.

Debris is recognised by name only (:mod:`.debris`): a file the store did not
create is never touched, and a symlink among the debris is unlinked, never
followed. No other store-owned name is followed either (:mod:`..safefs`):
``store.json`` and manifests are read with ``O_NOFOLLOW``, temp files are
created with ``O_EXCL | O_NOFOLLOW``, a staging area must be a real directory
before anything is written into it or committed from it.
"""

from __future__ import annotations

import json
import logging
import os
import secrets
import stat
import time
from abc import abstractmethod
from pathlib import Path
from typing import Collection

import numpy as np
import numpy.typing as npt

from ..errors import (BudgetExceededError, CacheStoreError, CorruptSampleError, GenerationCommitted,
                      GenerationNotFoundError, MalformedFileError)
from ..guard import safefs, untrusted
from ..guard.claims import CLAIMS_NAME, DONE_NAME, done_map
from ..guard.safefs import TEMP_NAME, fsync_dir, write_json_atomic
from ..space.budget import Budget
from ..space.disk import allocated_bytes, is_out_of_space, out_of_space, remove_paths
from .base import (Backend, GenerationInfo, ProducerRecord, ShardWriter, StagingToken, StoreMeta,
                   missing_generation)
from .debris import find_debris
from .manifest import MANIFEST_NAME, Manifest, check_generation, manifest_checksum, manifest_int
from .reading import GenerationData
from .staging import (STAGING_META, has_members, idle_shared_areas, mark_committing, matches, members_path,
                      parse_shared, parse_staging, staging_dirname, staging_record, unshared_record)

log = logging.getLogger(__name__)

META_NAME = "store.json"
#: The bytes a ``store.json`` may take (a fingerprint and a producer's description).
META_BYTES = 1 << 20
GEN_PREFIX = "gen-"


def gen_dirname(generation: int) -> str:
    """The directory name of committed generation `generation` (``gen-000003``)."""
    return f"{GEN_PREFIX}{generation:06d}"


def parse_gen_dirname(name: str) -> int | None:
    """The generation a directory name names, ``None`` when it is no name :func:`gen_dirname` makes.

    Only that exact spelling: ``gen-٠`` (a Unicode digit) or ``gen-0`` is nobody's generation,
    and is left alone; read as generation 0, a prune took it for a damaged generation 0 and
    removed the sound ``gen-000000`` in its place.
    """
    if not name.startswith(GEN_PREFIX):
        return None
    generation = untrusted.decimal(name[len(GEN_PREFIX):])
    return generation if generation is not None and gen_dirname(generation) == name else None


class DirectoryBackend(Backend):
    """Catalog of generations as directories; subclasses store the samples."""

    def __init__(self, root: str, *, compression: str | None, allow_pickle: bool, verify: bool) -> None:
        super().__init__(root, compression=compression, allow_pickle=allow_pickle, verify=verify)
        self.path = Path(root)

    # metadata -----------------------------------------------------------
    def read_meta(self) -> StoreMeta | None:
        path = self.path / META_NAME
        try:
            return untrusted.parse_store_meta(untrusted.read_document(path, "the store metadata", META_BYTES,
                                                                      self.trust), str(path))
        except FileNotFoundError:
            return None
        except MalformedFileError as exc:
            raise MalformedFileError(f"{exc}; the store metadata is damaged") from None

    def write_meta(self, meta: StoreMeta) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, "creating the store directory", self.path.parent) from exc
            raise
        write_json_atomic(self.path / META_NAME, meta)

    # catalog ------------------------------------------------------------
    def generations(self) -> list[GenerationInfo]:
        infos: list[GenerationInfo] = []
        if not self.path.is_dir():
            return infos
        for entry in sorted(self.path.iterdir()):
            if parse_gen_dirname(entry.name) is not None:
                info = self._generation_info(entry)
                if info is not None:
                    infos.append(info)
            elif (parsed := parse_staging(entry.name)) is not None:
                try:
                    created = entry.lstat().st_mtime
                except FileNotFoundError:
                    continue  # committed (renamed) or removed since we listed the directory
                infos.append(GenerationInfo(
                    id=parsed[0], num_samples=0, nbytes=allocated_bytes(entry), committed=False,
                    created=created, path=str(entry), owner_pid=parsed[1],
                ))
            elif (shared := parse_shared(entry.name)) is not None:
                try:
                    created = entry.lstat().st_mtime
                except FileNotFoundError:
                    continue
                infos.append(GenerationInfo(
                    id=shared, num_samples=0, nbytes=allocated_bytes(entry), committed=False, created=created,
                    path=str(entry), extra={"shared": True, "members": has_members(entry)},
                ))
        infos.sort(key=lambda g: (g.id, g.committed))
        return infos

    def _generation_info(self, gen_dir: Path) -> GenerationInfo | None:
        """What listing shows of `gen_dir` (a name :func:`parse_gen_dirname` reads); ``None`` when it
        vanished (pruned) while we looked."""
        generation = parse_gen_dirname(gen_dir.name)
        if generation is None:
            return None
        try:
            manifest, damage = check_generation(gen_dir, generation, self._check_files, self.trust,
                                                self.max_sample_bytes)
            st = gen_dir.lstat()
        except FileNotFoundError:
            return None
        if damage is not None:
            return GenerationInfo(
                id=generation, num_samples=manifest_int(manifest, "num_samples"), nbytes=allocated_bytes(gen_dir),
                committed=False, created=st.st_mtime, path=str(gen_dir), damaged=damage,
                extra=manifest.get("extra", {}) if isinstance(manifest.get("extra"), dict) else {})
        return GenerationInfo(
            id=generation, num_samples=int(manifest["num_samples"]),
            nbytes=allocated_bytes(gen_dir), committed=True, created=float(manifest["created"]),
            path=str(gen_dir), layout=manifest.get("layout"),
            raw_bytes=manifest_int(manifest, "raw_bytes"), stored_bytes=manifest_int(manifest, "stored_bytes"),
            extra=manifest.get("extra", {}),
        )

    def _damaged(self, generation: int, why: str) -> CorruptSampleError:
        exc = CorruptSampleError(f"generation {generation} of {self.path} is damaged: {why}; "
                                 f"`cachestore prune {self.path}` removes it, and writing generation "
                                 f"{generation} again replaces it")
        exc.generation = generation  # the whole generation: index stays None
        return exc

    def clear_damaged(self, generation: int) -> bool:
        if not os.path.lexists(self.path / gen_dirname(generation)):
            return False
        try:
            # Opening, not listing: it finds what only opening does (an LMDB record count).
            self.open_generation(generation).close()
        except CorruptSampleError as exc:
            # The caller may write this generation and the name is the store's: replace the damage.
            log.warning("%s (replacing it now)", str(exc))  # text: a record must not keep frames alive
            self.remove_generation(generation)
            return False
        except GenerationNotFoundError:
            return False  # pruned since we looked
        return True

    def begin(self, generation: int, budget: Budget, num_samples: int | None) -> StagingToken:
        if self.clear_damaged(generation):
            # GenerationCommitted: a loader that planned to write it reads it instead (another process, a
            # concurrent run of another backend than memmap, committed it since it looked).
            raise GenerationCommitted(f"generation {generation} of {self.path} is already committed; "
                                  "write a new generation id or prune this one first")
        staging = self.path / staging_dirname(generation)
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, f"creating the staging area of generation {generation}", self.path) from exc
            raise
        return StagingToken(str(staging), generation, budget, num_samples,
                            self.compression == "zstd", self.allow_pickle)

    def shard_writer(self, token: StagingToken, shard_id: str) -> ShardWriter:
        safefs.require_real_dir(token.path, "staging area")
        return self._shard(token, shard_id)

    def commit(self, token: StagingToken, num_samples: int | None, extra: dict[str, object]) -> GenerationInfo:
        staging = Path(token.path)
        final = self.path / gen_dirname(token.generation)
        if os.path.lexists(final):
            raise GenerationCommitted(f"generation {token.generation} of {self.path} is already committed (another "
                                      "process installed or wrote it meanwhile)")
        safefs.require_real_dir(staging, "staging area")
        # Every writer has closed its shard by now: a temp file left is a killed writer's half-written
        # one (a rename that never came), not part of the generation.
        for entry in staging.iterdir():
            if TEMP_NAME.match(entry.name):
                safefs.unlink_name(entry)
        mark_committing(staging)
        try:
            summary = self._finalize(staging, num_samples)
            for entry in staging.iterdir():
                if stat.S_ISREG(entry.lstat().st_mode):
                    safefs.fsync_file(entry)
            # Sizes of the data files: opening (and listing) compares them, so a truncated
            # or replaced file is found without reading it.
            files = {entry.name: st.st_size for entry in staging.iterdir()
                     if stat.S_ISREG((st := entry.lstat()).st_mode)}
            manifest = {"generation": token.generation, "created": time.time(), "backend": self.name,
                        "compression": self.compression, "extra": extra, "files": files, **summary}
            manifest = json.loads(json.dumps(manifest, default=str))  # exactly what will be read back
            manifest["checksum"] = manifest_checksum(manifest)
            write_json_atomic(staging / MANIFEST_NAME, manifest)
            # Shards each kept within the budget; together, with index and manifest, they may not.
            token.write_budget().check_usage(token.generation, allocated_bytes(staging))
        except BudgetExceededError:
            raise
        except OSError as exc:
            if is_out_of_space(exc):  # the index or manifest did not fit
                raise BudgetExceededError(f"disk full while committing generation {token.generation} "
                                          f"of {self.path}: {exc}") from exc
            raise
        os.rename(staging, final)
        fsync_dir(self.path)
        return GenerationInfo(
            id=token.generation, num_samples=summary["num_samples"], nbytes=allocated_bytes(final),
            committed=True, created=manifest["created"], path=str(final), layout=summary.get("layout"),
            raw_bytes=summary.get("raw_bytes", 0), stored_bytes=summary.get("stored_bytes", 0), extra=extra,
        )

    def install(self, token: StagingToken) -> GenerationInfo:
        # The files came whole with their manifest (cachestore/remote/fetch.py checked them): the
        # commit's last steps only, so the generation appears whole or not at all.
        staging = Path(token.path)
        final = self.path / gen_dirname(token.generation)
        if os.path.lexists(final):
            raise GenerationCommitted(f"generation {token.generation} of {self.path} is already committed (another "
                                      "process installed or wrote it meanwhile)")
        safefs.require_real_dir(staging, "staging area")
        _, damage = check_generation(staging, token.generation, self._check_files, self.trust)
        if damage is not None:
            raise self._damaged(token.generation, damage)
        fsync_dir(staging)
        os.rename(staging, final)
        fsync_dir(self.path)
        info = self._generation_info(final)
        if info is None:
            raise GenerationNotFoundError(f"generation {token.generation} of {self.path} vanished as it was installed")
        return info

    def discard(self, token: StagingToken) -> None:
        remove_paths([token.path])  # a staging area swapped for a symlink: the link goes, its target stays

    # partial generations ----------------------------------------------------
    def record_staging(self, token: StagingToken, record: ProducerRecord) -> None:
        safefs.require_real_dir(token.path, "staging area")
        write_json_atomic(Path(token.path) / STAGING_META, {**record, "kept": False})

    def keep(self, token: StagingToken) -> None:
        staging = Path(token.path)
        if not safefs.is_real_dir(staging):
            return
        record = staging_record(staging)
        if record is None:
            self.discard(token)  # not a resuming writer's: nobody could adopt it
            return
        try:
            write_json_atomic(staging / STAGING_META, {**record, "kept": True})
        except OSError:  # BudgetExceededError included: on a full disk the room matters more
            self.discard(token)

    def adopt(self, generation: int, num_samples: int | None, record: ProducerRecord) -> StagingToken | None:
        if record.get("fingerprint") is None:
            return None  # nothing says the samples are this producer's
        # (num_samples None: a stream's generation, whose length is known at its end; the record's must be
        # None too, and the fingerprint covers the stream.)
        if os.path.lexists(self.path / gen_dirname(generation)):
            return None  # committed (or damaged): begin() decides
        wanted = {**record, "generation": generation}
        found = [entry for entry, parsed in self._staging_entries() if parsed[0] == generation
                 and safefs.is_real_dir(entry) and matches(staging_record(entry, self.trust), wanted)]
        # (Shared areas nobody writes now: the caller holds the writer lock exclusively.)
        found += [entry for entry in idle_shared_areas(self.path, generation)
                  if matches(unshared_record(entry, self.trust), wanted)]
        if not found:
            return None
        # The one with most written, by bytes; the others are debris the writer removes next.
        old = max(found, key=allocated_bytes)
        staging = self.path / staging_dirname(generation)
        try:
            if parse_shared(old.name) is not None and num_samples is not None:  # (a stream's is never shared)
                self._unshare(old, num_samples)
            os.rename(old, staging)
            fsync_dir(self.path)
            for entry in staging.iterdir():
                if entry.name.startswith(".") and entry.name.endswith(".tmp"):
                    safefs.unlink_name(entry)  # a dead writer's half-written temp file (its rename never came)
            kept = self._adopt_shards(staging, f"a{secrets.token_hex(3)}-", num_samples)
            write_json_atomic(staging / STAGING_META, {**record, "generation": generation, "kept": False})
        except OSError as exc:
            # Rewriting the shards' logs needs a little room: on a full disk the budget policy decides.
            # What could not be adopted stays a partial generation (a copy whose log went is not served).
            if is_out_of_space(exc) and not isinstance(exc, BudgetExceededError):
                raise out_of_space(exc, f"adopting the partial generation {generation}", self.path) from exc
            raise
        log.info("adopted the partial generation %d in %s (%d of %s samples present)", generation, old.name,
                 kept, num_samples if num_samples is not None else "a stream's")
        return StagingToken(str(staging), generation, None, num_samples, self.compression == "zstd",
                            self.allow_pickle)

    def _unshare(self, area: Path, num_samples: int) -> None:
        """Make a shared area an ordinary staging area: only the copies its done map names stay."""
        token = StagingToken(str(area), -1, None, num_samples, self.compression == "zstd", self.allow_pickle)
        self.keep_logged(token, done_map(area, num_samples))
        for name in (CLAIMS_NAME, DONE_NAME):
            if os.path.lexists(area / name):
                safefs.unlink_name(area / name)
        if os.path.lexists(members_path(area)):
            safefs.unlink_name(members_path(area))

    def present(self, token: StagingToken) -> npt.NDArray[np.int64]:
        return np.unique(self._logged(Path(token.path)))

    def _staging_entries(self) -> list[tuple[Path, tuple[int, int]]]:
        if not self.path.is_dir():
            return []
        return [(entry, parsed) for entry in sorted(self.path.iterdir())
                if (parsed := parse_staging(entry.name)) is not None]

    def open_generation(self, generation: int) -> GenerationData:
        gen_dir = self.path / gen_dirname(generation)
        try:
            identity = safefs.identity(gen_dir)
            manifest, damage = check_generation(gen_dir, generation, self._check_files, self.trust,
                                                self.max_sample_bytes)
        except FileNotFoundError:
            raise self._missing(generation) from None
        try:
            if damage is not None:
                raise MalformedFileError(damage)
            data = self._open(gen_dir, manifest)
            data.bound_samples(self.max_sample_bytes)
            return data
        except (CorruptSampleError, MalformedFileError, FileNotFoundError) as exc:
            # Or a removal racing this open (it renames the directory away first): not committed now.
            if safefs.identity_or_none(gen_dir) != identity:
                raise self._missing(generation) from None
            raise self._damaged(generation, str(exc)) from exc

    def _missing(self, generation: int) -> GenerationNotFoundError:
        staging = any(parsed[0] == generation for _, parsed in self._staging_entries())
        return GenerationNotFoundError(missing_generation(generation, str(self.path), staging))

    def remove_generation(self, generation: int) -> int:
        gen_dir = self.path / gen_dirname(generation)
        freed = allocated_bytes(gen_dir)
        # Rename first so a concurrent reader never opens a half-deleted generation.
        doomed = self.path / staging_dirname(generation, pid=0)
        try:
            os.rename(gen_dir, doomed)
        except FileNotFoundError:
            return 0
        remove_paths([str(doomed)])
        return freed

    def debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
               keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        return find_debris(self.path, keep_pid, keep_record, keep_paths)

    def remove_debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
                      keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        removed = self.debris(keep_pid, keep_record, keep_paths)
        remove_paths([path for path, _ in removed])
        return removed


    # for subclasses -------------------------------------------------------
    def _check_files(self, gen_dir: Path, manifest: Manifest) -> str | None:
        """Backend checks cheap enough for listing (headers, small files); why it is damaged, or ``None``."""
        return None

    @abstractmethod
    def _shard(self, token: StagingToken, shard_id: str) -> ShardWriter:
        """A shard writer for `token` (runs in any process)."""

    @abstractmethod
    def _finalize(self, staging: Path, num_samples: int | None) -> Manifest:
        """Merge shards, check every index is present once; return manifest fields
        (at least ``num_samples``; also ``layout``, ``raw_bytes``, ``stored_bytes``)."""

    @abstractmethod
    def _open(self, gen_dir: Path, manifest: Manifest) -> GenerationData:
        """Read access to a committed generation directory."""

    @abstractmethod
    def _logged(self, staging: Path) -> npt.NDArray[np.int64]:
        """Every index the shards of `staging` recorded as written (duplicates included)."""

    @abstractmethod
    def _adopt_shards(self, staging: Path, prefix: str, num_samples: int | None) -> int:
        """Make an adopted staging area writable by new shards; return the samples kept.

        Renames every shard to ``prefix + shard id`` and keeps, per index in
        ``0..num_samples-1``, one entry whose record passes its checksum.
        """
