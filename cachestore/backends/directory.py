"""The on-disk catalog shared by the file-based backends (memmap, lmdb).

Layout of a store directory::

    store.json                     format version, backend, fingerprint, producer
    writer.lock                    present while a writer lives (see locking.py)
    gen-000003/                    a committed generation: manifest.json + data
    .staging-000004-<pid>-<hex>/   a generation being written; never read
    rotation-<pid>-<hex>/          a loader's disk rotation window (removed on close)

Commit protocol (why each step): data files are fsync'ed first, so the
manifest never names bytes still in the page cache only; the manifest is
written to a temp name, fsync'ed and renamed, so it is whole or absent; the
staging directory is then renamed to ``gen-NNNNNN`` in one ``rename(2)``, which
is atomic, and the parent directory fsync'ed so the rename survives a power
cut. A reader therefore sees a generation complete or not at all, and a crash
at any point leaves only a ``.staging-*`` directory, which the next writer or
``prune`` removes.

Debris is recognised by name only (``.staging-*``, ``rotation-<pid>-<hex>``
of a dead pid, ``.<name>.<pid>.<hex>.tmp`` of a dead pid): a file the store did
not create is never touched, and a symlink among the debris is unlinked, never
followed.
"""

from __future__ import annotations

import errno
import json
import os
import re
import secrets
import shutil
import time
from abc import abstractmethod
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..disk import allocated_bytes, is_out_of_space, out_of_space
from ..errors import BudgetExceededError, CacheStoreError, GenerationNotFoundError
from .base import Backend, Budget, GenerationData, GenerationInfo, ShardWriter

META_NAME = "store.json"
MANIFEST_NAME = "manifest.json"
GEN_PREFIX = "gen-"
STAGING_PREFIX = ".staging-"
ROTATION_PREFIX = "rotation-"
_ROTATION_RE = re.compile(r"^rotation-(\d+)-[0-9a-f]+$")
# Temp names made by write_json_atomic: .<name>.<pid>.<hex>.tmp
_TMP_RE = re.compile(r"^\..+\.(\d+)\.[0-9a-f]+\.tmp$")


def gen_dirname(generation: int) -> str:
    return f"{GEN_PREFIX}{generation:06d}"


def write_json_atomic(path: Path, obj: Any) -> None:
    """Write `obj` as JSON to `path` via a temp file, fsync and rename."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
    try:
        with open(tmp, "w") as f:
            json.dump(obj, f, indent=1, sort_keys=True, default=str)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fsync_dir(path.parent)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if is_out_of_space(exc):
            raise out_of_space(exc, f"writing {path.name}", path.parent) from exc
        raise


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@dataclass(frozen=True)
class StagingToken:
    """Names a staging area; small and picklable so worker processes can write into it."""

    path: str
    generation: int
    budget: Budget
    num_samples: int | None
    compress: bool
    allow_pickle: bool


def parse_staging(name: str) -> tuple[int, int] | None:
    """``(generation, pid)`` of a staging directory name, ``None`` if it is not one."""
    if not name.startswith(STAGING_PREFIX):
        return None
    parts = name[len(STAGING_PREFIX):].split("-")
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    return int(parts[0]), int(parts[1])


def parse_rotation(name: str) -> int | None:
    """Owner pid of a ``rotation-<pid>-<hex>`` window name, ``None`` if it is not one."""
    match = _ROTATION_RE.match(name)
    return int(match.group(1)) if match else None


def rotation_windows(root: str | os.PathLike) -> list[tuple[str, int, int | None]]:
    """``(path, allocated bytes, owner pid or None)`` of each ``rotation-*`` directory in `root`."""
    found = []
    try:
        entries = sorted(Path(root).iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return found
    for entry in entries:
        if entry.name.startswith(ROTATION_PREFIX) and (entry.is_dir() or entry.is_symlink()):
            found.append((str(entry), allocated_bytes(entry), parse_rotation(entry.name)))
    return found


def rotation_debris(root: str | os.PathLike) -> list[tuple[str, int]]:
    """Rotation windows in `root` whose owner process is dead (a live one is in use)."""
    return [(path, nbytes) for path, nbytes, pid in rotation_windows(root)
            if pid is not None and not pid_alive(pid)]


def remove_paths(paths: list[str]) -> None:
    """Remove debris entries: directories recursively, symlinks and files unlinked (never followed)."""
    for path in paths:
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path, ignore_errors=True)
        else:
            Path(path).unlink(missing_ok=True)


class DirectoryBackend(Backend):
    """Catalog of generations as directories; subclasses store the samples."""

    def __init__(self, root: str, **options: Any) -> None:
        super().__init__(root, **options)
        self.path = Path(root)

    # metadata -----------------------------------------------------------
    def read_meta(self) -> dict | None:
        try:
            with open(self.path / META_NAME) as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise CacheStoreError(f"{self.path / META_NAME} is unreadable ({exc}); "
                                  "the store metadata is damaged") from exc

    def write_meta(self, meta: dict) -> None:
        try:
            self.path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, "creating the store directory", self.path.parent) from exc
            raise
        write_json_atomic(self.path / META_NAME, meta)

    # catalog ------------------------------------------------------------
    def generations(self) -> list[GenerationInfo]:
        infos = []
        if not self.path.is_dir():
            return infos
        for entry in sorted(self.path.iterdir()):
            if entry.name.startswith(GEN_PREFIX) and entry.name[len(GEN_PREFIX):].isdigit():
                manifest = self._manifest(entry)
                if manifest is None:
                    continue
                infos.append(GenerationInfo(
                    id=int(manifest["generation"]), num_samples=int(manifest["num_samples"]),
                    nbytes=allocated_bytes(entry), committed=True, created=float(manifest["created"]),
                    path=str(entry), layout=manifest.get("layout"),
                    raw_bytes=int(manifest.get("raw_bytes", 0)), stored_bytes=int(manifest.get("stored_bytes", 0)),
                    extra=manifest.get("extra", {}),
                ))
            elif (parsed := parse_staging(entry.name)) is not None:
                try:
                    created = entry.lstat().st_mtime
                except FileNotFoundError:
                    continue  # committed (renamed) or removed since we listed the directory
                infos.append(GenerationInfo(
                    id=parsed[0], num_samples=0, nbytes=allocated_bytes(entry), committed=False,
                    created=created, path=str(entry), owner_pid=parsed[1],
                ))
        infos.sort(key=lambda g: (g.id, g.committed))
        return infos

    def _manifest(self, gen_dir: Path) -> dict | None:
        try:
            with open(gen_dir / MANIFEST_NAME) as f:
                return json.load(f)
        except (FileNotFoundError, ValueError):
            return None

    def begin(self, generation: int, budget: Budget, num_samples: int | None) -> StagingToken:
        if (self.path / gen_dirname(generation)).exists():
            raise CacheStoreError(f"generation {generation} of {self.path} is already committed; "
                                  "write a new generation id or prune this one first")
        staging = self.path / f"{STAGING_PREFIX}{generation:06d}-{os.getpid()}-{secrets.token_hex(4)}"
        try:
            staging.mkdir(parents=True)
        except OSError as exc:
            if is_out_of_space(exc):
                raise out_of_space(exc, f"creating the staging area of generation {generation}", self.path) from exc
            raise
        return StagingToken(str(staging), generation, budget, num_samples,
                            self.compression == "zstd", self.allow_pickle)

    def shard_writer(self, token: StagingToken, shard_id: str) -> ShardWriter:
        if not Path(token.path).is_dir():
            raise CacheStoreError(f"staging area {token.path} is gone (aborted or pruned)")
        return self._shard(token, shard_id)

    def commit(self, token: StagingToken, num_samples: int | None, extra: dict) -> GenerationInfo:
        staging = Path(token.path)
        final = self.path / gen_dirname(token.generation)
        if final.exists():
            raise CacheStoreError(f"generation {token.generation} of {self.path} is already committed")
        try:
            summary = self._finalize(staging, num_samples)
            for entry in staging.iterdir():
                if entry.is_file():
                    fd = os.open(entry, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
            manifest = {"generation": token.generation, "created": time.time(), "backend": self.name,
                        "compression": self.compression, "extra": extra, **summary}
            write_json_atomic(staging / MANIFEST_NAME, manifest)
        except OSError as exc:
            if exc.errno in (errno.ENOSPC, errno.EDQUOT):  # the index or manifest did not fit
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

    def discard(self, token: StagingToken) -> None:
        shutil.rmtree(token.path, ignore_errors=True)

    def open_generation(self, generation: int) -> GenerationData:
        gen_dir = self.path / gen_dirname(generation)
        manifest = self._manifest(gen_dir)
        if manifest is None:
            staging = any((p := parse_staging(e.name)) and p[0] == generation
                          for e in self.path.iterdir()) if self.path.is_dir() else False
            state = "is still being written (not committed)" if staging else "does not exist"
            raise GenerationNotFoundError(f"generation {generation} of {self.path} {state}")
        return self._open(gen_dir, manifest)

    def remove_generation(self, generation: int) -> int:
        gen_dir = self.path / gen_dirname(generation)
        freed = allocated_bytes(gen_dir)
        # Rename first so a concurrent reader never opens a half-deleted generation.
        doomed = self.path / f"{STAGING_PREFIX}{generation:06d}-0-{secrets.token_hex(4)}"
        try:
            os.rename(gen_dir, doomed)
        except FileNotFoundError:
            return 0
        shutil.rmtree(doomed, ignore_errors=True)
        return freed

    def debris(self, keep_pid: int | None = None) -> list[tuple[str, int]]:
        found = []
        if not self.path.is_dir():
            return found
        for entry in self.path.iterdir():
            parsed = parse_staging(entry.name)
            if parsed is not None and parsed[1] != keep_pid:
                found.append((str(entry), allocated_bytes(entry)))
            elif (tmp := _TMP_RE.match(entry.name)) and not pid_alive(int(tmp.group(1))):
                # a live pid may be between writing and renaming its temp file
                found.append((str(entry), allocated_bytes(entry)))
        found += rotation_debris(self.path)
        return sorted(found)

    def remove_debris(self, keep_pid: int | None = None) -> list[tuple[str, int]]:
        removed = self.debris(keep_pid)
        remove_paths([path for path, _ in removed])
        return removed


    # for subclasses -------------------------------------------------------
    @abstractmethod
    def _shard(self, token: StagingToken, shard_id: str) -> ShardWriter:
        """A shard writer for `token` (runs in any process)."""

    @abstractmethod
    def _finalize(self, staging: Path, num_samples: int | None) -> dict:
        """Merge shards, check every index is present once; return manifest fields
        (at least ``num_samples``; also ``layout``, ``raw_bytes``, ``stored_bytes``)."""

    @abstractmethod
    def _open(self, gen_dir: Path, manifest: dict) -> GenerationData:
        """Read access to a committed generation directory."""


def check_complete(indices: Any, num_samples: int | None, where: str) -> int:
    """Verify `indices` hold ``0..n-1`` exactly once; return n."""
    import numpy as np

    indices = np.asarray(indices, dtype=np.int64)
    n = int(indices.max()) + 1 if indices.size else 0
    if num_samples is not None:
        if n > num_samples:
            raise CacheStoreError(f"{where}: index {n - 1} written but the generation has {num_samples} samples")
        n = num_samples
    counts = np.bincount(indices, minlength=n) if indices.size else np.zeros(n, dtype=np.int64)
    missing = np.flatnonzero(counts == 0)
    dup = np.flatnonzero(counts > 1)
    if missing.size or dup.size:
        parts = []
        if missing.size:
            parts.append(f"{missing.size} indices never written (e.g. {missing[:5].tolist()})")
        if dup.size:
            parts.append(f"{dup.size} written more than once (e.g. {dup[:5].tolist()})")
        raise CacheStoreError(f"{where} cannot be committed: {'; '.join(parts)}; "
                              "a generation must hold every index 0..n-1 exactly once")
    return n
