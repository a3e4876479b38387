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

Cost: one ``stat`` per distinct path that exists, without reading. Paths are grouped by
directory, each directory is opened once (listed too, when many names are looked up in it, so
strings that name nothing there cost no system call: a text dataset's sentences) and its files
are statted relative to it, spread over threads, which the system calls release the interpreter
for (``benchmarks.fingerprint_time`` measures a million). Past :data:`MAX_FILES` distinct paths, the
first ones in sorted order are statted and one log line says that the rest count by name only.
"""

from __future__ import annotations

import array
import hashlib
import logging
import os
import stat
from concurrent.futures import ThreadPoolExecutor
from typing import Iterable

log = logging.getLogger(__name__)

#: Distinct paths statted at most: about two seconds of system calls on a small machine.
MAX_FILES = 2_000_000
#: Paths per directory group handed to a thread, and the count below which one thread stats them all.
_PER_THREAD = 20_000
#: Names looked up in one directory past which it is listed first (see ``_stat_group``).
_LIST_PAST = 32
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
    strings = set(paths)
    # Most paths are plain ones: kept as they are without a call each (candidate() says the same of them).
    unique = {t for t in strings if ":" not in t and "\n" not in t and "\0" not in t and 0 < len(t) <= _PATH_MAX}
    unique.update(c for c in map(candidate, (t for t in strings if ":" in t)) if c is not None)
    if len(unique) > MAX_FILES:
        ordered = sorted(unique)
        log.info("fingerprint: the dataset names %d distinct paths; the first %d (in sorted order) count by "
                 "size and modification time, the other %d by name only (a rewritten file among them is not "
                 "noticed: change cache_setting['fingerprint'] when they change)", len(ordered), MAX_FILES,
                 len(ordered) - MAX_FILES)
        unique = set(ordered[:MAX_FILES])
    by_dir: dict[str, list[str]] = {}
    for path in unique:
        folder, _, name = path.rpartition("/")
        if name:
            by_dir.setdefault(folder or ("/" if path.startswith("/") else ""), []).append(name)
    groups = _groups(by_dir)
    if len(groups) > 1:
        with ThreadPoolExecutor(max_workers=min(len(groups), max(2, os.cpu_count() or 1))) as pool:
            parts = list(pool.map(_stat_group, groups))
    else:
        parts = [_stat_group(g) for g in groups]
    hasher = hashlib.sha256()
    count = 0
    for n, chunks in parts:  # in the groups' order: sorted by directory, then name
        count += n
        for chunk in chunks:
            hasher.update(chunk)
    return (count, hasher.hexdigest()[:16]) if count else None


def _groups(by_dir: dict[str, list[str]]) -> list[list[tuple[str, list[str]]]]:
    """Directories in sorted order, cut into groups of about :data:`_PER_THREAD` paths."""
    groups: list[list[tuple[str, list[str]]]] = [[]]
    size = 0
    for folder in sorted(by_dir):
        if size >= _PER_THREAD:
            groups.append([])
            size = 0
        names = sorted(by_dir[folder])
        groups[-1].append((folder, names))
        size += len(names)
    return groups


def _stat_group(group: list[tuple[str, list[str]]]) -> tuple[int, list[bytes]]:
    """How many of `group`'s paths are regular files, and what the digest takes of the group: per
    directory with any, its name, the names of its regular files and their sizes and times."""
    count = 0
    chunks: list[bytes] = []
    for folder, names in group:
        try:
            fd = os.open(folder or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        except (OSError, ValueError):
            continue  # no such directory (the strings were not paths): nothing in it counts
        found: list[str] = []
        numbers = array.array("q")
        try:
            if len(names) > _LIST_PAST:
                # One listing (cheap) spares a failing stat for each string that names nothing here:
                # a text dataset's sentences, labels, the keys of a dict.
                present = set(os.listdir(fd))
                names = [name for name in names if name in present]
            for name in names:
                try:
                    st = os.stat(name, dir_fd=fd)
                except (OSError, ValueError):
                    continue
                if stat.S_ISREG(st.st_mode):
                    found.append(name)
                    numbers.append(st.st_size)
                    numbers.append(st.st_mtime_ns)
        finally:
            os.close(fd)
        if found:
            count += len(found)
            text = folder + "\0" + "\0".join(found) + "\n"
            chunks += (text.encode("utf-8", "surrogateescape"), numbers.tobytes())
    return count, chunks
