"""Exceptions raised by cachestore (the loader's own derive from the same base).

Every error derives from :class:`CacheStoreError`; each leaf also inherits the
builtin a caller would naturally catch (``OSError`` for disk trouble,
``TypeError`` for a sample we cannot encode, ...), so ``except OSError`` keeps
working in code that never heard of this package.
"""

from __future__ import annotations

import errno


class CacheStoreError(Exception):
    """Base class of every error raised by cachestore and the loader (:mod:`loader.errors`)."""


class BudgetExceededError(CacheStoreError, OSError):
    """A generation would not fit (or no longer fits) in the disk or RAM budget.

    ``fits_samples`` is how many samples of the size seen so far would fit in
    what is available, when the store could project it (else ``None``).
    """

    fits_samples: int | None = None


class SymlinkError(CacheStoreError, OSError):
    """A name the store owns is a symlink; the store never follows one."""


class NotRegularFileError(CacheStoreError, OSError):
    """A name the store owns is a FIFO, a socket or a device, never opened (a FIFO would block)."""


class BatchStackError(CacheStoreError, ValueError):
    """The samples a batch read asked for cannot be stacked into one batch: their structures differ
    (written so, or crafted records); each still reads alone."""


class UntrustedOwnerError(CacheStoreError, PermissionError):
    """A generation, staging area, rotation window or rank file belongs to a user this job does not
    trust: neither its own user nor one named in ``trusted_uids`` / ``trusted_gids``."""


class StoreLockedError(CacheStoreError, BlockingIOError):
    """Another live process holds the store's writer lock."""


class CorruptSampleError(CacheStoreError, ValueError):
    """A stored record failed its checksum or could not be decoded.

    ``generation`` and ``index`` name the bad sample when known (``index`` is
    ``None`` when a whole generation cannot be opened).
    """

    generation: int | None = None
    index: int | None = None


class MalformedFileError(CacheStoreError, ValueError):
    """A file of a store does not hold what the store writes there (a field of the wrong type or out
    of range, a name that is not the store's, a document too large or nested too deeply); the
    message names the file (see :mod:`cachestore.guard.untrusted`)."""


class PickleRefusedError(CacheStoreError, PermissionError):
    """A stored sample holds a pickled leaf, and the reading side did not pass ``allow_pickle=True``:
    unpickling runs code of whoever wrote the store. ``generation`` and ``index`` name the sample."""

    generation: int | None = None
    index: int | None = None


class UnsupportedSampleError(CacheStoreError, TypeError):
    """A sample contains a type the codec cannot store without pickle."""


class FingerprintError(CacheStoreError, TypeError):
    """Dataset parameters that cannot be fingerprinted by value (an explicit fingerprint is needed)."""


class FingerprintMismatchError(CacheStoreError, ValueError):
    """The store was produced by something else than what opens it now."""


class GenerationNotFoundError(CacheStoreError, LookupError):
    """The requested generation does not exist or is not committed."""


class NotAStoreError(CacheStoreError, FileNotFoundError):
    """A path that should hold a store does not."""


class GenerationCommitted(CacheStoreError, FileExistsError):
    """A process asked to write a generation that is committed already (the processes writing it together,
    or another writer, committed it meanwhile): read it instead (:meth:`cachestore.Store.join`,
    :meth:`cachestore.Store.writer`)."""


#: errno values that say the process (or the system) ran out of something, not that a file is bad.
_EXHAUSTED = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOMEM})


def exhausted(exc: BaseException) -> bool:
    """Whether `exc` is a process out of descriptors or memory: raised as it is, never taken for a
    damaged generation (which would be written again, and fail the same way)."""
    return isinstance(exc, OSError) and exc.errno in _EXHAUSTED
