"""Exceptions of the loader; like the store's, they derive from :class:`cachestore.CacheStoreError`.

Each leaf also inherits the builtin a caller would naturally catch
(``RuntimeError``, ``TimeoutError``, ``ImportError``, ``ValueError``), so
code that never heard of this package still catches them.
"""

from __future__ import annotations

from cachestore.errors import CacheStoreError


class WorkerError(CacheStoreError, RuntimeError):
    """A loader worker died repeatedly, could not be started, or failed outside the dataset."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """No batch arrived within the loader's ``timeout``.

    ``indices`` are the dataset indices the stuck worker was computing, ``pid``
    its process id and ``stack`` its Python stack when the timeout expired.
    """

    indices: list[int] | None = None
    pid: int | None = None
    stack: str | None = None


class RanksTimeoutError(CacheStoreError, TimeoutError):
    """The ranks of a job, comparing their datasets when their loaders are built, did not all arrive."""


class RankFailedError(CacheStoreError, RuntimeError):
    """Another rank of the node failed (or is gone) while the node's ranks wrote their streams into one
    generation; the message carries its error."""


class ClusterUnreachableError(WorkerError, ConnectionError):
    """The Ray cluster ``executor_options['address']`` names does not answer."""


class MissingDependencyError(CacheStoreError, ImportError):
    """An optional extra the settings ask for is not installed (the message says what to install)."""


class NotImportableError(CacheStoreError, ValueError):
    """Something the workers need cannot be sent to them (the message names it and the ways out)."""


class SettingFixedError(CacheStoreError, ValueError, AttributeError):
    """A setting of a built loader was assigned (torch raises ``ValueError`` for its own; Python's
    ``AttributeError`` for a read-only attribute)."""


class NotPicklableError(CacheStoreError, TypeError):
    """A loader was pickled (or deep-copied): it holds processes, shared memory and an open store."""


class TooManyOpenFilesError(CacheStoreError, RuntimeError):
    """The process ran out of file descriptors for the shared memory that carries batches (torch's
    loader raises ``RuntimeError`` for the same; its message names ``ulimit -n`` as torch's does)."""


def too_many_open_files(slots: int) -> TooManyOpenFilesError:
    """The error for a descriptor refused with `slots` slots open (``EMFILE``)."""
    return TooManyOpenFilesError(
        f"Too many open files: no file descriptor left for another shared-memory slot ({slots} open, two "
        "descriptors each here and in each worker, beside every other file of the process). Raise the limit "
        "with `ulimit -n` in the shell (or resource.setrlimit(resource.RLIMIT_NOFILE, ...)). torch's "
        "torch.multiprocessing.set_sharing_strategy('file_system') does not apply: batches past a budget of "
        "ulimit -n / 8 slots are already copied out of shared memory, so this comes from the other files open")


class SampleError(CacheStoreError):
    """Wraps an exception from ``dataset[index]`` (or ``read_transform``) with the index, on its way to
    the training process.

    Never reaches the user: the training process re-raises the user's own
    exception (:attr:`cause`), which gets ``sample_index`` too, with or
    without workers. `stage` says which of the user's functions raised it.
    """

    def __init__(self, index: int, cause: BaseException, stage: str = "dataset") -> None:
        super().__init__(index)
        self.index = index
        self.cause = cause
        self.stage = stage
        tag_sample_index(cause, index)

    @property
    def doing(self) -> str:
        """What was happening, in words (for the notes of the re-raised exception)."""
        if self.stage == "read_transform":
            return f"while applying read_transform to sample {self.index}"
        return f"while computing sample {self.index}"


class FailedBatch:
    """In place of a batch whose samples the dataset (or ``read_transform``) failed to produce: the epoch's
    iterator raises `error` for it and, asked again, goes on with the next batch, as torch's does."""

    __slots__ = ("error",)

    def __init__(self, error: BaseException) -> None:
        self.error = error


def tag_sample_index(exc: BaseException, index: int) -> None:
    """Give the dataset's exception the index it was raised for (``exc.sample_index``)."""
    try:
        exc.sample_index = index  # type: ignore[attr-defined]
    except (AttributeError, TypeError):
        pass  # __slots__ without it: the index is still in the message's notes


__all__ = ["ClusterUnreachableError", "MissingDependencyError", "NotImportableError", "NotPicklableError",
           "RankFailedError", "SampleError", "SettingFixedError", "TooManyOpenFilesError", "WorkerError", "WorkerTimeoutError",
           "tag_sample_index"]


def add_note(exc: BaseException, note: str) -> None:
    """``exc.add_note(note)`` (:pep:`678`) where Python has it (3.11); on 3.10 the note is kept in
    ``__notes__`` all the same, and an exception that refuses attributes goes without it."""
    try:
        exc.add_note(note)
    except AttributeError:
        try:
            exc.__notes__ = [*getattr(exc, "__notes__", []), note]  # type: ignore[attr-defined]
        except (AttributeError, TypeError):
            pass
    except TypeError:
        pass
