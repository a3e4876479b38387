"""A generation installed before its bytes are known to be on the disk: a fetched one.

A commit fsyncs every file before the rename that publishes the generation
(:mod:`.directory`): the store's own writes are the only copy. A generation fetched
from a remote has a durable copy there, and waiting for the local disk made a fetch
as slow as the disk's writes, which on a machine with a fast network are the slower
of the two (see docs/ARCHITECTURE.md, "The remote tier"). So a fetch installs the
generation once its bytes are verified in the page cache, marked with the boot it
was installed in (:data:`UNSYNCED`, in the generation's directory, made and fsynced
before the rename); a thread then fsyncs its files and removes the mark.

A mark from another boot means the machine restarted, perhaps by a power cut, before
the files were known to be on the disk: they may hold blocks that never got there
(zeros). :func:`damage` then calls the generation damaged, so listing shows it
uncommitted, a prune removes it and the next fetch brings it again: it is never
served. A system that does not say which boot it is in (no
``/proc/sys/kernel/random/boot_id``) gets no mark: the fetch fsyncs first.
"""

from __future__ import annotations

import logging
import os
import stat
import threading
from pathlib import Path

from ..guard import safefs
from ..space.disk import is_out_of_space, out_of_space

log = logging.getLogger(__name__)

#: The mark of a generation installed before its files were fsynced (holds the boot's id).
UNSYNCED = ".unsynced"
_BOOT_ID = "/proc/sys/kernel/random/boot_id"


def boot_id() -> str | None:
    """This boot's id (Linux), ``None`` where the system does not say."""
    try:
        with open(_BOOT_ID, "rb") as f:
            return f.read(64).decode("ascii", "replace").strip() or None
    except OSError:
        return None


def mark(directory: Path) -> bool:
    """Mark the staging area `directory` as about to be installed unsynced; ``False`` (no mark) where
    no boot id can date it: the caller then syncs its files before installing (:func:`sync_files`)."""
    boot = boot_id()
    if boot is None:
        return False
    try:
        fd = safefs.create_new(directory / UNSYNCED)
        try:
            safefs.write_all(fd, boot.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        if is_out_of_space(exc):
            raise out_of_space(exc, "marking a fetched generation", directory) from exc
        raise
    return True


def damage(gen_dir: Path) -> str | None:
    """Why the generation in `gen_dir` cannot be trusted to be on the disk: marked in another boot."""
    try:
        marked = safefs.read_bytes(gen_dir / UNSYNCED)[:64].decode("ascii", "replace").strip()
    except FileNotFoundError:
        return None
    except OSError as exc:
        return f"{gen_dir / UNSYNCED} is unreadable ({exc})"
    if marked == boot_id():
        return None
    return (f"{gen_dir} was installed (fetched) before its files were on the disk, and the machine restarted "
            "since: they may have lost blocks; it is fetched again")


def sync_files(directory: Path) -> None:
    """fsync every regular file of `directory` (not following links), then the directory."""
    for entry in directory.iterdir():
        if entry.name != UNSYNCED and stat.S_ISREG(entry.lstat().st_mode):
            safefs.fsync_file(entry)
    safefs.fsync_dir(directory)


def settle(gen_dir: Path) -> None:
    """Sync the files of the installed generation `gen_dir`, then remove its mark (and sync that)."""
    sync_files(gen_dir)
    safefs.unlink_name(gen_dir / UNSYNCED)
    safefs.fsync_dir(gen_dir)


def settle_later(gen_dir: Path) -> threading.Thread:
    """:func:`settle` in a daemon thread. A process that exits first leaves the mark, which is harmless in this
    boot (the kernel writes the pages back); a generation pruned meanwhile is nothing to settle."""
    def run() -> None:
        try:
            settle(gen_dir)
        except FileNotFoundError:
            pass
        except OSError as exc:
            log.warning("could not sync the fetched generation in %s (%s): it stays marked unsynced", gen_dir, exc)
    thread = threading.Thread(target=run, name="cachestore-settle", daemon=True)
    thread.start()
    return thread
