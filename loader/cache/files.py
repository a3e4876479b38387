"""The data files a dataset names count by path, size and modification time.

The fingerprint hashes a dataset by value (:mod:`loader.cache.fingerprint`): it sees the names of
its files (an image folder's sample list, a stream's shard URLs), not what is in them, and users
regenerate their data files under the same names all the time. Reading every file would cost as
much as an epoch; ``os.stat`` costs a few microseconds. So every string the fingerprint meets that
could name a file (:func:`candidate`: anything path-shaped, a ``file:`` URL) is noted, and at the
end :func:`files_identity` stats each distinct one: those that are regular files (a link counts by
its target) count by ``(path, size, st_mtime_ns)``. A file rewritten in place, added to or removed
from what the dataset names is another fingerprint; directories do not count (a store written
inside the data folder changes its folder's time).

Cost: one ``stat`` per distinct path, without reading (the working directory is listed once
when many bare names are looked up in it, so strings that name nothing there cost no system call:
a text dataset's sentences), in one thread per core without the GIL where the compiled module is
built (``benchmarks.fingerprint_time`` measures a million). The digest is a sum of a hash
per file, so it needs no sort. Past :data:`MAX_FILES` distinct paths, the
first ones in sorted order are statted and one log line says that the rest count by name only.
"""

from __future__ import annotations

import logging
import os
import stat
from typing import Iterable

import xxhash

from cachestore.format.native import native_gather

log = logging.getLogger(__name__)

#: Distinct paths statted at most: about two seconds of system calls on a small machine.
MAX_FILES = 2_000_000
#: Threads that stat at most (the file system's lookups scale with cores; more than this gains little).
_THREADS = 8
#: Names in the working directory past which it is listed first (see :func:`files_identity`).
_LIST_PAST = 32
#: A file's size and time are mixed into its path's hash by odd 64-bit multipliers (any bit changed in
#: either changes the sum).
_SIZE_MIX, _TIME_MIX, _MASK = 0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, (1 << 64) - 1
#: Longer strings name no file (Linux's PATH_MAX).
_PATH_MAX = 4096
#: URL schemes that name no local file (webdataset's ``pipe:`` runs a command; nothing is run here).
_REMOTE = ("pipe:", "http://", "https://", "s3://", "gs://", "gcs://", "az://", "hf://")


def candidate(text: str) -> str | None:
    """The local path `text` may name (``file:`` URLs unwrapped), or ``None`` when it cannot name one."""
    if not text or len(text) > _PATH_MAX or "\0" in text or "\n" in text:
        return None
    if text.startswith("file:"):
        text = text[7:] if text.startswith("file://") else text[5:]
    elif text.startswith(_REMOTE):
        return None
    return text or None


def files_identity(paths: Iterable[str]) -> tuple[int, str] | None:
    """How many of `paths` are regular files, and a digest of their paths, sizes and modification
    times (``None`` when none is); see the module docstring.

    Parameters
    ----------
    paths
        Strings the dataset holds, repeats allowed (those that cannot name a file are skipped:
        :func:`candidate`); relative ones are taken from the working directory, as the dataset would
        open them.
    """
    unique = set(paths)
    # One string of them all is searched at memory speed: most datasets name no scheme and no bare
    # name, and a check per string was a third of this function for a million paths. (A NUL in a
    # string can only make these checks say "maybe", never skip a path.)
    joined = "\0".join(unique)
    if ":" in joined:
        # A plain path stays as it is (a string that names nothing fails its stat); those with a scheme
        # are unwrapped or dropped by candidate().
        schemed = [t for t in unique if ":" in t]
        unique.difference_update(schemed)
        unique.update(c for c in map(candidate, schemed) if c is not None)
    unique.discard("")  # the working directory
    absolute = joined.count("\0/") + joined.startswith("/")
    del joined
    if len(unique) > MAX_FILES:
        ordered = sorted(unique)
        log.info("fingerprint: the dataset names %d distinct paths; the first %d (in sorted order) count by "
                 "size and modification time, the other %d by name only (a rewritten file among them is not "
                 "noticed: change cache_setting['fingerprint'] when they change)", len(ordered), MAX_FILES,
                 len(ordered) - MAX_FILES)
        unique = set(ordered[:MAX_FILES])
    todo = list(unique)
    if len(todo) - absolute > _LIST_PAST and sum("/" not in t for t in todo) > _LIST_PAST:
        # Names in the working directory: one listing spares a failing stat for each string that names
        # nothing there (a text dataset's sentences, labels, the keys of a dict).
        present = set(os.listdir("."))
        todo = [t for t in todo if "/" in t or t in present]
    count, total = _stat_all(todo)
    return (count, f"{total & _MASK:016x}") if count else None


def _stat_all(paths: list[str]) -> tuple[int, int]:
    """:func:`_stat_part` of `paths`: in the compiled module's threads without the GIL where it is built
    (``cachestore/format/_gather.c``, ``stat_digest``: the system call takes microseconds, about what the
    interpreter spends around each ``os.stat``, and threads that hold the GIL ran slower than one);
    else in this thread."""
    native = native_gather()
    if native is None:
        return _stat_part(paths)
    return native.stat_digest(paths, _threads())


def _threads() -> int:
    """Threads to stat with: the cores this process may run on, at most :data:`_THREADS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    return max(1, min(cores, _THREADS))


def _stat_part(paths: list[str]) -> tuple[int, int]:
    """How many of `paths` are regular files, and the sum (mod 2**64) of a hash of each one's path mixed
    with its size and modification time: a sum does not depend on the order the paths come in (a
    set's order changes from run to run), and needs no sort of a million paths."""
    count = total = 0
    for path in paths:
        try:
            st = os.stat(path)
        except (OSError, ValueError):
            continue
        if stat.S_ISREG(st.st_mode):
            count += 1
            key = xxhash.xxh3_64_intdigest(os.fsencode(path))
            total += key ^ (st.st_size * _SIZE_MIX) ^ (st.st_mtime_ns * _TIME_MIX)
    return count, total & _MASK
