"""Where a rotation epoch keeps the samples it serves again: in RAM or in files on disk.

One sample per slot; :func:`loader.epochs.rotation.run_rotation` puts a
fresh sample into a slot, reads it back for its later serves and frees the
slot after the last. A disk window can be adopted by a resumed run
(``docs/ARCHITECTURE.md``, "Resuming").
"""

from __future__ import annotations

import json
import logging
import os
import re
import stat
from pathlib import Path
from typing import Protocol

import numpy as np

from cachestore.errors import BudgetExceededError, CacheStoreError, UnsupportedSampleError
from cachestore.format import codec, records
from cachestore.format.codec import TreeDef
from cachestore.guard import safefs
from cachestore.guard.trust import OWN, warn_if_shared
from cachestore.guard.untrusted import parse_json
from cachestore.space.disk import format_size, is_out_of_space, out_of_space, remove_paths
from cachestore.space.room import fits, memory_room
from cachestore.space.scratch import dead_windows, new_window_dir

from ..dataset import Sample

log = logging.getLogger(__name__)

#: A disk window's record of how far its epoch got (see DiskWindow.adopt).
POSITION = "position.json"
_SLOT_RE = re.compile(r"^slot-(\d+)\.rec$")


class RotationWindow(Protocol):
    """Where a rotation epoch keeps the samples it serves again: one sample per slot.

    :func:`run_rotation` stores a fresh sample with :meth:`put`, serves it
    again with :meth:`get` and frees the slot after its last serve.
    """

    slots: int

    def reset(self) -> None:
        """Empty every slot (a new epoch starts)."""

    def put(self, slot: int, sample: Sample) -> None:
        """Keep an own copy of `sample` in `slot`."""

    def get(self, slot: int) -> Sample:
        """The sample in `slot`, as the caller's own copy (a serve may be changed in place)."""

    def free(self, slot: int) -> None:
        """Forget the sample in `slot`."""

    def held(self) -> int:
        """Slots holding a sample now."""

    def mark(self, epoch: int, applied: int, clean: bool) -> None:
        """Record how far epoch `epoch` got: `applied` batches in, `clean` when none is half applied."""

    def resumes(self, epoch: int, applied: int) -> bool:
        """Whether the window already holds the state after `applied` batches of `epoch` (adopted)."""

    def close(self) -> None:
        """Release everything (files included)."""


class MemoryWindow:
    """The window in this process's RAM: one sample (own copy) per slot.

    Its first sample tells what the whole window will take; a window that would
    not fit in half of :func:`cachestore.space.room.memory_room` (a container's limit
    included) is refused then, rather than swapped or killed later.
    """

    def __init__(self, slots: int) -> None:
        self.slots = slots
        self._samples: list[tuple[TreeDef, list[np.ndarray]] | None] = [None] * slots
        self._checked = False

    def reset(self) -> None:
        self._samples = [None] * self.slots

    def put(self, slot: int, sample: Sample) -> None:
        treedef, leaves = codec.flatten(sample, allow_pickle=True)
        if not self._checked:
            self._check_room(sum(leaf.nbytes for leaf in leaves))
        self._samples[slot] = (treedef, [np.array(leaf) for leaf in leaves])

    def _check_room(self, sample_bytes: int) -> None:
        self._checked = True
        need = sample_bytes * self.slots
        if not fits(need):
            room = memory_room()
            raise BudgetExceededError(
                f"the memory rotation window of {self.slots} samples of {format_size(sample_bytes)} needs "
                f"{format_size(need)}, more than half of this process's memory room ({format_size(room)}, "
                f"a container's limit included): set rotation_setting['size'] to at most "
                f"{max(1, room // 2 // max(1, sample_bytes))}, or use rotation_setting['medium'] = 'disk'")

    def get(self, slot: int) -> Sample:
        held = self._samples[slot]
        if held is None:
            raise KeyError(f"rotation slot {slot} holds no sample")
        treedef, leaves = held
        return codec.unflatten(treedef, [leaf.copy() for leaf in leaves], allow_pickle=True)

    def free(self, slot: int) -> None:
        self._samples[slot] = None

    def held(self) -> int:
        return sum(s is not None for s in self._samples)

    def mark(self, epoch: int, applied: int, clean: bool) -> None:
        pass  # a memory window dies with its process: nothing to resume from

    def resumes(self, epoch: int, applied: int) -> bool:
        return False

    def close(self) -> None:
        self._samples = []


class DiskWindow:
    """The window as one record file per slot under ``<prefix>/rotation-<pid>-<hex>/``.

    At most one file per slot, so the bytes on disk stay within the window's
    samples. The directory is removed on close. One left by a crashed process
    is adopted by a run that resumes exactly where it stopped (``position.json``
    says how far its epoch got), and otherwise removed at the next loader's
    first rotation epoch, or by ``cachestore prune``.

    The prefix may be a folder other users write to (see :mod:`cachestore.guard.trust`): the
    directory is this user's alone (mode 0700) and every slot is reached through the fd
    it was made with, so a window renamed aside and replaced by someone else's is never
    read; slots are records of the codec, unpickled only with `allow_pickle` (the user's).
    """

    def __init__(self, prefix: str, slots: int, allow_pickle: bool = False) -> None:
        root = Path(prefix)
        self._made_root = not root.exists()
        root.mkdir(parents=True, exist_ok=True)
        warn_if_shared(root)
        self.root = root
        self.allow_pickle = allow_pickle
        # Swept at the first epoch, not now: a resumed run adopts one of them first (see adopt()).
        self._stale: list[str] | None = [path for path, _ in dead_windows(root)]
        self.path = new_window_dir(root)
        self._dir_fd = safefs.open_nofollow(self.path, os.O_RDONLY | os.O_DIRECTORY, what="a rotation window")
        self.slots = slots
        self._held = [False] * slots
        self._resume: tuple[int, int] | None = None  # (epoch, batches applied) of an adopted window

    def adopt(self, path: str, epoch: int, applied: int) -> bool:
        """Take over the window a killed run left at `path`, if it stopped after `applied` batches of `epoch`.

        Returns whether it was adopted: its slot files then serve the rest of
        that epoch, and no sample it holds is computed again. Only a window of
        this user (or root) is adopted: another user's is input, never served.
        """
        old = Path(path)
        if self._stale is None or str(old) not in self._stale or old.parent != self.root:
            return False
        try:
            old_fd = safefs.open_nofollow(old, os.O_RDONLY | os.O_DIRECTORY, what="a rotation window")
        except (OSError, CacheStoreError):
            return False
        try:
            if not OWN.trusts(os.fstat(old_fd)) or os.fstat(old_fd).st_mode & 0o022:
                return False  # another user's, or one others could have written into: not this run's samples
            position = _read_position(old_fd, old)
            if position != {"epoch": epoch, "applied": applied, "clean": True, "slots": self.slots}:
                return False  # it went on (or was cut mid-batch) after the state was taken: rebuild instead
            for name in os.listdir(old_fd):
                match = _SLOT_RE.match(name)
                st = os.lstat(name, dir_fd=old_fd)
                if match and int(match.group(1)) < self.slots and stat.S_ISREG(st.st_mode) and OWN.trusts(st):
                    os.rename(name, self._name(int(match.group(1))), src_dir_fd=old_fd, dst_dir_fd=self._dir_fd)
                    self._held[int(match.group(1))] = True
        except (OSError, ValueError, CacheStoreError):
            return False
        finally:
            os.close(old_fd)
        self._resume = (epoch, applied)
        log.info("adopted the rotation window of a stopped run at batch %d of epoch %d", applied, epoch)
        return True

    def resumes(self, epoch: int, applied: int) -> bool:
        """Whether this window already holds the state after `applied` batches of `epoch` (adopted)."""
        return self._resume == (epoch, applied)

    def reset(self) -> None:
        self._resume = None
        stale, self._stale = self._stale or [], None
        if stale:
            remove_paths([path for path in stale if os.path.lexists(path)])
            log.info("removed %d rotation window(s) left by dead processes under %s", len(stale), self.root)
        for slot in range(self.slots):
            if self._held[slot]:
                self.free(slot)

    def mark(self, epoch: int, applied: int, clean: bool) -> None:
        # Atomic (temp name, rename): a kill leaves the old position or the new one, never a torn one.
        tmp = f".{POSITION}.tmp"
        try:
            self._unlink(tmp)
            self._write(tmp, json.dumps({"epoch": epoch, "applied": applied, "clean": clean,
                                         "slots": self.slots}).encode())
            os.replace(tmp, POSITION, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except OSError:
            # No room for a few bytes: this window just cannot be resumed from; serving goes on.
            self._unlink(tmp)
            self._unlink(POSITION)

    def _name(self, slot: int) -> str:
        return f"slot-{slot}.rec"

    def _file(self, slot: int) -> Path:
        return self.path / self._name(slot)

    def _unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self._dir_fd)
        except FileNotFoundError:
            pass

    def _write(self, name: str, data: bytes) -> None:
        """`data` into a fresh file `name` of the window (whatever was there, a symlink too, is unlinked)."""
        self._unlink(name)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=self._dir_fd)
        try:
            safefs.write_all(fd, data)
        finally:
            os.close(fd)

    def put(self, slot: int, sample: Sample) -> None:
        # Written in place: a window never outlives a crash, so no temp file (and no extra bytes).
        try:
            leaves = codec.flatten(sample, allow_pickle=self.allow_pickle)
        except UnsupportedSampleError as exc:
            raise UnsupportedSampleError(f"{exc}: the disk rotation window stores samples as files, read back "
                                         "as records; pass rotation_setting['allow_pickle']=True to pickle "
                                         "them (loading a pickle runs code)") from None
        try:
            self._write(self._name(slot), records.encode_record(*leaves))
        except OSError as exc:
            if is_out_of_space(exc):
                self._unlink(self._name(slot))  # a partly written slot file holds blocks for nothing
                raise out_of_space(exc, f"writing rotation slot {slot}", self.path) from exc
            raise
        self._held[slot] = True

    def get(self, slot: int) -> Sample:
        fd = safefs.open_at(self._dir_fd, self._name(slot), os.O_RDONLY, self.path, "a rotation slot")
        try:
            OWN.check_fd(fd, self._file(slot), "the rotation slot")
            chunks = []
            while chunk := os.read(fd, 1 << 24):  # (one read stops short of 2 GiB)
                chunks.append(chunk)
            data = b"".join(chunks)
        finally:
            os.close(fd)
        treedef, leaves = records.decode_record(data, copy=True)
        return codec.unflatten(treedef, leaves, allow_pickle=self.allow_pickle)

    def free(self, slot: int) -> None:
        self._unlink(self._name(slot))
        self._held[slot] = False

    def held(self) -> int:
        return sum(self._held)

    def close(self) -> None:
        stale, self._stale = self._stale or [], None
        remove_paths([path for path in stale if os.path.lexists(path)])
        if self._dir_fd < 0:
            return
        try:
            for name in os.listdir(self._dir_fd):
                self._unlink(name)
            st = os.fstat(self._dir_fd)
            here = safefs.lstat_or_none(self.path)
            if here is not None and (here.st_dev, here.st_ino) == (st.st_dev, st.st_ino):
                os.rmdir(self.path)  # only our own directory: one put in its place is not ours to remove
        except OSError:
            pass
        finally:
            os.close(self._dir_fd)
            self._dir_fd = -1
        if self._made_root:
            try:
                self.root.rmdir()  # only when empty: we created it, nothing else is in it
            except OSError:
                pass


def _read_position(dir_fd: int, where: Path) -> object:
    """The ``position.json`` of the window open at `dir_fd`: bounded, a regular file of this user."""
    fd = safefs.open_at(dir_fd, POSITION, os.O_RDONLY, where, "a rotation window position")
    try:
        OWN.check_fd(fd, where / POSITION, "a rotation window position")
        return parse_json(os.pread(fd, 4097, 0), str(where / POSITION), 4096)
    finally:
        os.close(fd)
