"""Putting samples into a generation being written: the claim protocol, in one place.

Whoever computes samples for a generation (a loader's worker, the training
process, the owner of a :class:`~cachestore.write.shared.SharedWriter`) puts each one
through a :class:`SampleSink` opened on the generation's
:class:`~cachestore.ShardSpec`, and hands it a way to compute the sample rather
than the sample: in a shared staging area a sample is claimed *before* it is
computed (:mod:`cachestore.guard.claims`), so that it is computed once, whoever needs
it first. :meth:`SampleSink.put` answers with a :class:`PutResult`:

``WRITTEN``
    computed here and written into this producer's shard; durable, and marked
    done for the other processes, at the next :meth:`SampleSink.flush`.
``PRESENT``
    in the generation already (an interrupted attempt wrote it, another process
    did, or the generation was committed meanwhile): :meth:`SampleSink.read`
    reads it back.
``WAIT``
    another process computes it now. Flush first (this producer then holds no
    claim, so two waiters can never wait on each other), then
    :meth:`SampleSink.wait` waits for it: ``PRESENT`` once written, ``WRITTEN``
    when its holder died before writing it and it was computed here.
``UNWRITTEN``
    computed here and not written: writing stopped (the budget, with
    `stop_when_full`; or a shared area that went away or broke under this
    process). :attr:`SampleSink.budget_error` says why when it was the budget.

Every failure inside the sink gives this producer's claims back before it
propagates: a sample it could not write goes to the other processes.
"""

from __future__ import annotations

import enum
import fcntl
import logging
import os
import secrets
from typing import Callable, NamedTuple, Protocol

from ..backends.base import ShardWriter, StagingToken
from ..backends.reading import StagingData
from ..backends.spec import StoreSpec
from ..backends.staging import members_path
from ..errors import BudgetExceededError, CacheStoreError, CorruptSampleError
from ..format.codec import Sample
from ..guard import safefs
from ..guard.claims import Claims, byte_lock, byte_unlock
from ..read.reader import Reader
from ..space.disk import is_out_of_space, out_of_space

log = logging.getLogger(__name__)


class PutResult(enum.Enum):
    """What became of a sample put into a generation (see the module docstring)."""

    WRITTEN = "written"
    PRESENT = "present"
    WAIT = "wait"
    UNWRITTEN = "unwritten"


class Put(NamedTuple):
    """A :class:`PutResult`, and the sample when it was computed here (``WRITTEN``, ``UNWRITTEN``)."""

    result: PutResult
    sample: Sample | None = None


class ShardTicket(Protocol):
    """What a sink writes through: a generation's ticket (:class:`cachestore.ShardSpec`, whose
    :meth:`~cachestore.ShardSpec.sink` opens a sink on itself)."""

    spec: StoreSpec
    token: StagingToken

    def open(self, shard_id: str) -> ShardWriter:
        """A shard writer for this process."""

    def open_staging(self) -> StagingData | None:
        """Read access to the samples already written (``None`` where the backend cannot give it)."""


class SampleSink:
    """One producer's way into a generation being written: its shard, and its claims where processes
    write the generation together (see the module docstring).

    Parameters
    ----------
    spec
        The generation's ticket.
    shard_id
        This producer's shard. In a shared area the shard gets a name of its own
        (other processes number their workers the same way).
    stop_when_full
        On a budget overrun or a full disk, stop writing and keep answering
        ``UNWRITTEN`` (``True``), or raise :class:`BudgetExceededError` (``False``).
    """

    def __init__(self, spec: ShardTicket, shard_id: str, stop_when_full: bool = False) -> None:
        self.spec = spec
        self.token: StagingToken = spec.token
        self.stop_when_full = stop_when_full
        self.name = f"{shard_id}-p{os.getpid()}-{secrets.token_hex(3)}" if self.token.shared else shard_id
        #: Why writing stopped, when the budget stopped it.
        self.budget_error: str | None = None
        self.closed = False
        self._opened = False
        self._writing = True
        self._committed = False  # the shared area was committed by another process: read the generation
        self._shard: ShardWriter | None = None
        self._claims: Claims | None = None
        self._staging: StagingData | None = None
        self._staging_open = False
        self._reader: Reader | None = None
        self._area: tuple[int, int] | None = None  # (device, inode) of the shared area it opened

    # putting ---------------------------------------------------------------
    def put(self, pos: int, compute: Callable[[], Sample]) -> Put:
        """Put sample `pos`, calling `compute` only when it is this producer's to write."""
        self._open()
        claims = self._claims
        if self._committed:
            return Put(PutResult.PRESENT)
        if not self._writing:
            return self._unwritten(pos, compute)
        if claims is not None and not claims.try_claim(pos):
            return Put(PutResult.PRESENT if claims.done(pos) else PutResult.WAIT)
        return self._write(pos, compute)

    def wait(self, pos: int, compute: Callable[[], Sample]) -> Put:
        """Sample `pos`, which :meth:`put` answered ``WAIT``, once its holder is done (call :meth:`flush`
        first): ``PRESENT``, or ``WRITTEN`` (and flushed) when its holder died before writing it."""
        self._open()
        claims = self._claims
        if self._committed:
            return Put(PutResult.PRESENT)
        if not self._writing or claims is None:
            return self._unwritten(pos, compute)
        if not claims.wait_claim(pos):
            return Put(PutResult.PRESENT)
        put = self._write(pos, compute)
        self.flush()
        return put

    def _unwritten(self, pos: int, compute: Callable[[], Sample]) -> Put:
        if self._claims is not None and self._claims.done(pos):
            return Put(PutResult.PRESENT)  # reading it back costs less than computing it
        return Put(PutResult.UNWRITTEN, compute())

    def _write(self, pos: int, compute: Callable[[], Sample]) -> Put:
        """Compute and write `pos` (claimed, where claims are taken)."""
        try:
            sample = compute()
        except BaseException:
            self.release()  # the dataset failed: the sample goes to the others
            raise
        assert self._shard is not None
        try:
            self._shard.put(pos, sample)
        except BudgetExceededError as exc:
            self._stop(exc)
            return Put(PutResult.UNWRITTEN, sample)
        except OSError as exc:
            if self._replaced():  # a shared area removed under this producer: served, not written
                return Put(PutResult.UNWRITTEN, sample)
            self.release()
            raise self._write_failed(exc) from exc
        except BaseException:
            self.release()
            raise
        return Put(PutResult.WRITTEN, sample)

    def flush(self) -> None:
        """Make what was written durable, then mark it done and give its claims back (in that order: a
        process woken by the unlock finds the sample written)."""
        if self._shard is None or not self._writing:
            return
        try:
            self._shard.flush()
            if self._claims is not None and self._claims.held and not self._replaced():
                self._claims.finish(list(self._claims.held), self.name)
        except BudgetExceededError as exc:  # a buffering backend (lmdb) meets the full disk here
            self._stop(exc)
        except OSError as exc:
            if not self._replaced():
                self.release()
                raise self._write_failed(exc) from exc
        except BaseException:
            self.release()
            raise

    def _replaced(self) -> bool:
        """Whether the shared area this sink opened was removed under it (a commit that failed half way;
        other processes may have made a new one since): it then writes nothing more, and its shard's
        files (removed) give their blocks back."""
        if self._area is None:
            return False
        try:
            st = os.stat(self.token.path)
            if (st.st_dev, st.st_ino) == self._area:
                return False
        except FileNotFoundError:
            pass
        log.warning("the shared staging area %s was removed while this process wrote it; its samples are "
                    "computed without being written from now on", self.token.path)
        self._writing = False
        self.release()
        self._drop_shard()
        return True

    def release(self) -> None:
        """Give back every claim held for a sample not written (someone else computes it)."""
        if self._claims is not None:
            self._claims.release()

    # reading back ------------------------------------------------------------
    def read(self, pos: int) -> Sample | None:
        """Sample `pos` as the generation holds it (its own copy), ``None`` when it cannot be read here:
        the caller computes it then."""
        self._open()
        if self._committed:
            return self._generation_sample(pos)
        if not self._staging_open:
            self._staging_open = True
            self._staging = self.spec.open_staging()
        if self._staging is None:
            return None  # a backend that cannot read its staging area here
        try:
            return self._staging.read(pos)
        except (CacheStoreError, OSError) as exc:
            if self.token.shared and self._committed_meanwhile():
                return self._generation_sample(pos)
            if self.token.shared and not os.path.lexists(self.token.path):
                return None  # removed (a commit that failed half way): computed
            # Adoption checked every record: this is damage since (or the area being removed under
            # us). Serve a computed sample; the stored one stays (it must not be written twice).
            log.warning("%s; computing it from the dataset instead", exc)
            return None

    def _committed_meanwhile(self) -> bool:
        """Whether the shared area is gone because another process writing it together committed it (its
        files moved into the generation). A member publishing it now is waited for: it holds the commit
        lock (see :mod:`cachestore.write.shared`), and the area lacks its claim files meanwhile."""
        try:
            fd = safefs.open_nofollow(members_path(self.token.path), os.O_RDONLY)
        except FileNotFoundError:
            pass
        else:
            try:
                byte_lock(fd, 0, fcntl.F_RDLCK, wait=True)
                byte_unlock(fd, 0)
            finally:
                os.close(fd)
        return not os.path.lexists(self.token.path) and self._generation() is not None

    def _generation(self) -> Reader | None:
        """The committed generation this area became, ``None`` when there is none."""
        if self._reader is None:
            try:
                self._reader = Reader.open(self.spec.spec, self.token.generation)
            except CacheStoreError:
                return None
        return self._reader

    def _generation_sample(self, pos: int) -> Sample | None:
        reader = self._generation()
        assert reader is not None
        try:
            return reader.get(pos, copy=True)
        except CorruptSampleError as exc:
            # A corrupt record is a miss, as in any read of the generation: the caller computes it.
            log.warning("%s; computing it from the dataset instead", exc)
            return None

    # opening and closing -------------------------------------------------------
    def _open(self) -> None:
        """Open the shard (and the claims of a shared area) at the first use. A shared area found
        committed is read from; one gone or broken is computed into without writing."""
        if self.closed:
            raise CacheStoreError(f"this sample sink of {self.token.path} is closed")
        if self._opened:
            return
        self._opened = True
        try:
            if self.token.shared:
                st = os.stat(self.token.path)
                self._area = (st.st_dev, st.st_ino)
            self._shard = self.spec.open(self.name)
            if self.token.shared and self.token.num_samples is not None:
                self._claims = Claims(self.token.path, self.token.num_samples)
        except (CacheStoreError, OSError) as exc:
            self._drop_shard()
            self._close_files()
            if self.token.shared and self._committed_meanwhile():
                self._committed = True
                return
            if isinstance(exc, BudgetExceededError) or is_out_of_space(exc):
                assert isinstance(exc, OSError)
                self._stop(exc if isinstance(exc, BudgetExceededError)
                           else out_of_space(exc, "opening a shard", self.token.path))
                return
            if not self.token.shared or not isinstance(exc, (CacheStoreError, FileNotFoundError)):
                raise
            # The shared area is gone or broken (its files removed, a member killed inside its commit):
            # samples are served all the same, computed and not written; the generation is written again
            # when an epoch needs it (docs/ARCHITECTURE.md, "Writing together").
            log.warning("the shared staging area %s went away or broke while it was written (%s: %s); computing "
                        "samples without writing them", self.token.path, type(exc).__name__, exc)
            self._writing = False

    def _stop(self, exc: BudgetExceededError) -> None:
        """The generation does not fit: give the claims back, write nothing more; raise unless
        `stop_when_full`."""
        self.budget_error = str(exc)
        self._writing = False
        self.release()
        self._drop_shard()  # a shard that met the budget closed itself already
        if not self.stop_when_full:
            self.close()
            raise exc

    def _drop_shard(self) -> None:
        """Close the shard, writing nothing more: what it could not flush is not part of the generation."""
        shard, self._shard = self._shard, None
        if shard is not None:
            try:
                shard.close()
            except (CacheStoreError, OSError):
                pass  # the error that stopped writing is the one to report

    def _write_failed(self, exc: OSError) -> CacheStoreError:
        """A store error (not the dataset's) for a write that failed: the generation's files went away."""
        return CacheStoreError(f"writing into {self.token.path} failed ({type(exc).__name__}: {exc}); was the "
                               "cache directory removed while it was written?")

    def _close_files(self) -> None:
        claims, self._claims = self._claims, None
        staging, self._staging = self._staging, None
        reader, self._reader = self._reader, None
        for item in (claims, staging, reader):
            if item is not None:
                item.close()

    def close(self) -> None:
        """Close the shard (a final flush: its error propagates), give the claims back (idempotent)."""
        if self.closed:
            return
        self.closed = True
        shard, self._shard = self._shard, None
        try:
            self._close_files()
        finally:
            if shard is not None:
                shard.close()
