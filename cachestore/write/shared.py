"""One generation written by several processes together: the ranks of a node, concurrent jobs.

Every process that writes generation ``g`` of a store with the same producer
(fingerprint, sample count, compression) *joins* one shared staging area,
``.shared-<g>-<fingerprint hash>/``, instead of making its own:

* Each process writes its own shards into it (as a loader's workers always
  did), and claims every sample before computing it (:mod:`cachestore.guard.claims`):
  a sample is computed once, whoever needs it first; a process that needs a
  sample another one is computing waits for it, then reads it back.
* Membership is a shared ``flock`` on ``<area>.members``, held from joining to
  leaving (commit, keep, abort, or death: the kernel drops it). The kernel
  also drops a dead member's claims, so what it left unfinished goes to the
  others.
* The first member to leave with every sample done commits, under the commit
  lock (an open-file-description lock on the members file's first byte: one
  committer, and a dead one's lock goes with it). Nothing is written into a
  complete area, so the members still in (ranks that went on to their next
  epoch) need not leave first: what they read back from the area they read
  from the committed generation once it is renamed. A joiner that finds the
  area gone opens the committed generation (:class:`GenerationCommitted`).
* An area whose members all left before it was complete is the partial
  generation: the next process to join it computes only what is missing.

Created whole or not at all: the area is made under a temp name, with its
files, and renamed into place; two processes creating it at once see one win.
The store's writer lock is taken *shared* by every member (:class:`SharedWriterLock`),
so no exclusive writer, and no prune that removes debris, runs beside them.
"""

from __future__ import annotations

import errno
import fcntl
import os
import secrets
import weakref
from pathlib import Path
from typing import Callable

import numpy as np
import numpy.typing as npt

from ..backends.base import Backend, GenerationInfo, ProducerRecord, StagingToken
from ..backends.spec import StoreSpec
from ..backends.staging import (SHARED_TMP_PREFIX, STAGING_META, mark_committing, members_path, shared_dirname,
                                staging_record)
from ..errors import BudgetExceededError, CacheStoreError, FingerprintMismatchError, GenerationCommitted
from ..format.codec import Sample
from ..guard import safefs
from ..guard.claims import CLAIMS_NAME, DONE_NAME, byte_lock, byte_unlock, create_claim_files, done_map
from ..guard.locking import WriterLease
from ..space.disk import allocated_bytes, is_out_of_space, out_of_space, remove_paths
from .sink import PutResult, SampleSink
from .writer import BudgetSource, ShardSpec

#: Tries to join before giving up (each one saw the area committed, or removed, under it).
_JOIN_TRIES = 50


def _create(root: Path, name: str, generation: int, num_samples: int, record: ProducerRecord) -> None:
    """Make the shared area `name` whole (record, claim files) or not at all."""
    tmp = root / f"{SHARED_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
    tmp.mkdir()
    try:
        safefs.write_json_atomic(tmp / STAGING_META, {**record, "generation": generation, "shared": True})
        create_claim_files(tmp, num_samples)
        try:
            os.rename(tmp, root / name)
        except OSError as exc:
            if exc.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another process made it first: join theirs.
    finally:
        if tmp.exists():
            remove_paths([str(tmp)])


class SharedWriter:
    """This process's membership of a shared staging area (see the module docstring).

    A :class:`~cachestore.write.writer.Writer`, as :class:`~cachestore.GenerationWriter`
    is (``put``, ``present``, ``shard_spec``, ``commit``, ``keep``, ``abort``), with
    three differences: :meth:`put` claims the sample first and may find it written
    by another member (``PRESENT``);
    :meth:`commit` returns ``None`` when the generation is not complete (the
    members still writing, or the next joiner, finish it) or another member
    commits it, and nothing a member wrote is ever dropped by another
    (:meth:`discard_shard_tail` is a no-op: the done map says which copy of a
    sample counts).

    Raises
    ------
    GenerationCommitted
        The generation is committed already: joining found it so, or found the
        area complete and published it (or waited for the member publishing it).
    """

    shared = True

    def __init__(self, spec: StoreSpec, backend: Backend, generation: int, num_samples: int,
                 lease: WriterLease, budget: BudgetSource, record: ProducerRecord,
                 current_fingerprint: Callable[[], object]) -> None:
        self.spec = spec
        self.backend = backend
        self.generation = generation
        self.num_samples = num_samples
        self.record = record
        self._current_fingerprint = current_fingerprint
        self._lease = lease
        root = Path(spec.path)
        self.path = root / shared_dirname(generation, record.get("fingerprint"))
        try:
            self._fd = self._join(root)
        except BaseException as exc:
            lease.release()
            if is_out_of_space(exc) and not isinstance(exc, BudgetExceededError):
                raise out_of_space(exc, f"joining the writers of generation {generation}", root) from exc
            raise
        # From here on the membership and the lease go back whatever happens (the finalizer is
        # idempotent): a failure below (the area removed under us, a budget that cannot be measured)
        # must not leave this process a member, nor the store locked, until it exits.
        self._finalizer = weakref.finalize(self, _leave, self._fd, lease)
        self.state = "open"
        self._sink: SampleSink | None = None
        try:
            self.token = StagingToken(str(self.path), generation, budget(reclaim=allocated_bytes(self.path)),
                                      num_samples, backend.compression == "zstd", backend.allow_pickle, shared=True)
            present = len(self.present())
            self.adopted = bool(present)
            if present == num_samples:
                # Complete, its writers gone or about to go (ranks that went on to their next epoch): publish
                # it now, or wait for the member publishing it, rather than read it back sample by sample.
                _commit_lock(self._fd, wait=True)
                if self._holds_area() and self._publishable():
                    self._publish({"committed_by": "a process that joined it complete"})
                else:
                    self._end("left")
                raise GenerationCommitted(f"generation {self.generation} of {root} is committed")
        except BaseException:
            if self.state == "open":
                self._end("left")
            raise

    # joining ---------------------------------------------------------------
    def _committed(self) -> bool:
        return any(g.id == self.generation and g.committed for g in self.backend.generations())

    def _join(self, root: Path) -> int:
        lock_path = members_path(self.path)
        for _ in range(_JOIN_TRIES):
            if self._committed():
                raise GenerationCommitted(f"generation {self.generation} of {root} was committed meanwhile")
            fd = safefs.open_nofollow(lock_path, os.O_RDWR | os.O_CREAT)
            try:
                fcntl.flock(fd, fcntl.LOCK_SH)  # waits while the last member out removes the area (abort)
                if os.fstat(fd).st_ino != os.lstat(lock_path).st_ino:
                    raise FileNotFoundError  # committed (and its lock file unlinked) while we waited
                if self._committed():
                    # Committed between the first look and opening the lock file, which this process
                    # may have made again after the committer unlinked it: no area will use it.
                    _unlink_unheld(fd, lock_path)
                    raise FileNotFoundError
                if not os.path.lexists(self.path):
                    _create(root, self.path.name, self.generation, self.num_samples, self.record)
                found = staging_record(self.path, self.backend.trust)
                if found is None or found.get("committing"):
                    self._drop_broken(fd)  # or wait for the live committer
                    raise FileNotFoundError
                if found.get("num_samples") != self.num_samples or found.get("compression") != self.record.get(
                        "compression"):
                    raise CacheStoreError(
                        f"{self.path} is written by processes with {found.get('num_samples')} samples and "
                        f"compression {found.get('compression')!r}, this one has {self.num_samples} and "
                        f"{self.record.get('compression')!r}: the same fingerprint must describe the same samples")
                return fd
            except FileNotFoundError:
                os.close(fd)
                continue
            except BaseException:
                try:
                    if not os.path.lexists(self.path):
                        # The area could not be made (a full disk): the lock file this process may have made
                        # for it goes too, unless another process holds it.
                        _unlink_unheld(fd, lock_path)
                finally:
                    os.close(fd)
                raise
        raise CacheStoreError(f"could not join the writers of generation {self.generation} of {root}: the "
                              "area kept being committed or removed under this process")

    def _drop_broken(self, fd: int) -> None:
        """An area being committed, or whose commit was cut short (its logs no longer describe its
        samples): wait for a live committer; remove what a dead one left (the next try makes a new area)."""
        if not _commit_lock(fd, wait=False):
            _commit_lock(fd, wait=True)  # a live committer: when it is done, the area is gone
        elif os.path.lexists(self.path) and ((found := staging_record(self.path, self.backend.trust)) is None
                                             or found.get("committing")):
            remove_paths([str(self.path)])
        _commit_unlock(fd)

    # writing ---------------------------------------------------------------
    def shard_spec(self) -> ShardSpec:
        """A picklable spec other processes (the loader's workers) use to write into this area."""
        self._check_open()
        return ShardSpec(self.spec, self.token, self.backend)

    def put(self, index: int, sample: Sample) -> PutResult:
        """Write `sample` at `index` unless another member has (or is writing) it: ``WRITTEN`` (and
        flushed: the others see it done), ``PRESENT`` (written by another member, waited for), or
        ``UNWRITTEN`` (the area went away or broke under this member: see :mod:`cachestore.write.sink`)."""
        self._check_open()
        if self._sink is None or self._sink.closed:
            self._sink = SampleSink(self.shard_spec(), "owner")
        put = self._sink.put(index, lambda: sample)
        if put.result is PutResult.WAIT:
            self._sink.flush()  # holds nothing then: a wait never waits on a waiter
            put = self._sink.wait(index, lambda: sample)
        elif put.result is PutResult.WRITTEN:
            self._sink.flush()
        return put.result

    def present(self) -> npt.NDArray[np.int64]:
        """Sorted indices every member together has written so far (all of them once it is committed)."""
        try:
            return np.flatnonzero(done_map(self.path, self.num_samples)).astype(np.int64)
        except FileNotFoundError:  # committed by another member, being committed, or removed
            if not (committed := self._committed()) and self.state == "open":
                self._wait_for_committer()  # it unlinks the done map before the rename: nothing would look done
                committed = self._committed()
            return np.arange(self.num_samples, dtype=np.int64) if committed else np.zeros(0, dtype=np.int64)

    def _wait_for_committer(self) -> None:
        """Wait for the member holding the commit lock (on a description of its own: this writer's may hold it)."""
        try:
            fd = os.open(f"/proc/self/fd/{self._fd}", os.O_RDWR)
        except OSError:
            return
        try:
            _commit_lock(fd, wait=True)
        finally:
            os.close(fd)

    def complete(self) -> bool:
        """Whether every sample is in (written by some member, or committed)."""
        return len(self.present()) == self.num_samples

    def discard_shard_tail(self, shard_id: str, keep: int) -> None:
        """Nothing: what a dead worker wrote and marked done is part of the generation (others may have
        served it already); what it did not mark done is not, whatever its shard holds."""

    # leaving ---------------------------------------------------------------
    def _check_open(self) -> None:
        if self.state != "open":
            raise CacheStoreError(f"this writer of generation {self.generation} is {self.state}")

    def _close_own(self) -> None:
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.close()

    def commit(self, extra: dict[str, object] | None = None) -> GenerationInfo | None:
        """Leave; when every sample is in, publish the generation (unless another member does now).

        Returns the committed generation, or ``None`` when it is incomplete (left to the members still
        writing, or a partial generation), or committed by another member.
        """
        self._check_open()
        self._close_own()
        if not os.path.lexists(self.path):  # committed by another member, or removed
            if self._alone():
                safefs.unlink_name(members_path(self.path))
            self._end("left")
            return None
        if (not self.complete() or not _commit_lock(self._fd, wait=False) or not self._holds_area()
                or not self._publishable()):
            self._end("left")
            return None
        return self._publish(dict(extra or {}))

    def _holds_area(self) -> bool:
        """Whether the members file this process holds is still the area's. A commit that failed half way
        removes the area and unlinks the file while other members still hold it; a joiner then makes a
        new area and a new file. The commit lock of the old file is no lock on the new area: taken by a
        member of the old one, two processes would publish the new area at once."""
        try:
            return os.fstat(self._fd).st_ino == os.lstat(members_path(self.path)).st_ino
        except FileNotFoundError:
            return False

    def _publishable(self) -> bool:
        """Whether the area (its commit lock held) is still there to publish: not committed by the member
        that held the lock before, nor left half committed by one that died."""
        found = staging_record(self.path, self.backend.trust) if os.path.lexists(self.path) else None
        return found is not None and not found.get("committing")

    def _publish(self, extra: dict[str, object]) -> GenerationInfo | None:
        """Commit the area (its commit lock held, every sample in).

        A failure before the commit changes the area (an interrupt, a damaged generation that cannot
        be removed) leaves it complete for the members still in, or the next joiner, to publish; one
        after it began, or an area of another producer, removes the area. ``None`` where a sound
        generation is committed already (by a member that died before it unlinked the members file):
        the area, redundant, is removed.
        """
        changing = False
        try:
            if self._current_fingerprint() != self.record.get("fingerprint"):
                changing = True  # written for the old producer: nobody will commit it
                raise FingerprintMismatchError(
                    f"{self.spec.path} now belongs to another producer: generation {self.generation}, written "
                    "for the old one, is not committed")
            # A damaged gen-N is replaced, as a writer that does not share replaces it (only the holder
            # of the commit lock may: members run beside each other until here).
            if self.backend.clear_damaged(self.generation):
                # A sound one is there already (a member published it and died before it unlinked the
                # members file, and the members still in wrote the area again): committed by another
                # member, this area is redundant.
                changing = True
                self._remove()
                self._end("left")
                return None
            # Marked first: a commit killed from here on leaves an area the next joiner removes.
            changing = True
            mark_committing(self.path)
            self._keep_canonical()
            for name in (CLAIMS_NAME, DONE_NAME):
                safefs.unlink_name(self.path / name)
            info = self.backend.commit(self.token, self.num_samples, extra)
            safefs.unlink_name(members_path(self.path))  # joiners waiting on it find the generation committed
        except BaseException:
            if not changing:
                # The area as it was, complete: leaving drops the commit lock with the members file's
                # description, and whoever takes the lock next (a member still in, a joiner) publishes it.
                self._end("left")
                raise
            try:
                self.backend.discard(self.token)  # a commit cut short: its logs no longer describe the samples
            finally:
                try:
                    # The lock file of no area: members still in find it replaced (or gone), joiners make a
                    # new one (an area left because it could not be removed is debris without members).
                    safefs.unlink_name(members_path(self.path))
                finally:
                    self._end("aborted")
            raise
        self._end("committed")
        return info

    def _alone(self) -> bool:
        """Give the shared lock back and take it exclusively: only the last member out gets it."""
        fcntl.flock(self._fd, fcntl.LOCK_UN)
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return False
        return self._holds_area()

    def _keep_canonical(self) -> None:
        """Drop every logged copy of a sample but the one the done map names (see :mod:`cachestore.guard.claims`)."""
        tags = done_map(self.path, self.num_samples)
        self.backend.keep_logged(self.token, tags)

    def keep(self) -> None:
        """Leave what was written for the other members, or the next process to join (idempotent)."""
        if self.state == "open":
            self._close_own()
            self._end("kept")

    def abort(self) -> None:
        """Leave; the last member out removes the area, one this writer kept a moment ago included
        (idempotent)."""
        if self.state == "kept":
            self._remove_if_alone()
            self.state = "aborted"
        if self.state != "open":
            return
        try:
            self._close_own()
        except Exception:  # what it could not flush must not mask the cause
            pass
        if self._alone():
            self._remove()
        self._end("aborted")

    def drop(self) -> None:
        """Give the generation up: leave, and remove the area unless another process is a member now,
        an area this writer kept or left (complete, a publish that failed before it changed anything)
        a moment ago included. Unlike :meth:`abort`, which leaves a complete area to the next joiner:
        for a caller that gives caching up (a disk too full to publish it), nothing may stay behind."""
        if self.state in ("kept", "left"):
            self._remove_if_alone()
            self.state = "aborted"
        self.abort()

    def _remove(self) -> None:
        self.backend.discard(self.token)
        safefs.unlink_name(members_path(self.path))

    def _remove_if_alone(self) -> None:
        """Remove the area this writer left, unless another process is a member now."""
        try:
            fd = safefs.open_nofollow(members_path(self.path), os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            self._remove()
        except BlockingIOError:
            pass
        finally:
            os.close(fd)

    def _end(self, state: str) -> None:
        self.state = state
        self._finalizer()


def _commit_lock(fd: int, wait: bool) -> bool:
    """Take the commit lock of the area whose members file `fd` is open on: a write lock on its first
    byte, held by one open file description (flock's shared locks on the same file are apart)."""
    return byte_lock(fd, 0, fcntl.F_WRLCK, wait)


def _commit_unlock(fd: int) -> None:
    """Give the commit lock back."""
    byte_unlock(fd, 0)


def _unlink_unheld(fd: int, path: Path) -> None:
    """Unlink the lock file `path` (open on `fd`, held shared by this process) unless another process holds it."""
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        return
    try:
        if os.fstat(fd).st_ino == os.lstat(path).st_ino:
            safefs.unlink_name(path)
    except FileNotFoundError:
        pass


def _leave(fd: int, lease: WriterLease) -> None:
    """Give the membership and the lease back (closing the lock file drops the flock)."""
    try:
        os.close(fd)
    except OSError:
        pass
    finally:
        lease.release()
