"""Every error derives from CacheStoreError and from the builtin a caller would catch."""

from __future__ import annotations

import numpy as np
import pytest

import cachestore
from cachestore import (BatchStackError, BudgetExceededError, CacheStoreError, CorruptSampleError, FingerprintError,
                        FingerprintMismatchError, GenerationCommitted, GenerationNotFoundError, MalformedFileError,
                        NotAStoreError, NotRegularFileError, PickleRefusedError, StoreLockedError, SymlinkError,
                        UnsupportedSampleError, UntrustedOwnerError, open_store)

from .helpers import write_generation

HIERARCHY = {
    BudgetExceededError: OSError,
    StoreLockedError: BlockingIOError,
    CorruptSampleError: ValueError,
    UnsupportedSampleError: TypeError,
    FingerprintError: TypeError,
    FingerprintMismatchError: ValueError,
    GenerationNotFoundError: LookupError,
    GenerationCommitted: FileExistsError,
    NotAStoreError: FileNotFoundError,
    SymlinkError: OSError,
    MalformedFileError: ValueError,
    PickleRefusedError: PermissionError,
    NotRegularFileError: OSError,
    UntrustedOwnerError: PermissionError,
    BatchStackError: ValueError,
}


@pytest.mark.parametrize("error", list(HIERARCHY), ids=lambda e: e.__name__)
def test_error_derives_from_base_and_builtin(error):
    assert issubclass(error, CacheStoreError)
    assert issubclass(error, HIERARCHY[error])
    assert issubclass(CacheStoreError, Exception) and not issubclass(CacheStoreError, OSError)


def test_every_exported_error_is_covered():
    exported = {getattr(cachestore, name) for name in cachestore.__all__}
    errors = {obj for obj in exported if isinstance(obj, type) and issubclass(obj, BaseException)}
    assert errors == set(HIERARCHY) | {CacheStoreError}
    assert not hasattr(cachestore, "WorkerError")  # the loader's own (loader.errors): no import circle


def test_raised_errors_are_caught_by_their_builtin(tmp_path):
    store = open_store(tmp_path / "s", "memmap", fingerprint={"dataset": "a"})
    write_generation(store, 0, 2)
    with pytest.raises(LookupError):
        store.reader(7)
    with pytest.raises(IndexError):
        store.reader()[2]
    writer = store.writer(1, 2)
    with pytest.raises(TypeError):
        writer.put(0, object())
    with pytest.raises(OSError):  # StoreLockedError, from a second Store object on the same path
        open_store(tmp_path / "s").writer(1, 2)
    writer.abort()
    with pytest.raises(ValueError, match="produced by something else"):
        open_store(tmp_path / "s", fingerprint={"dataset": "b"})
    with pytest.raises(FileNotFoundError):
        open_store(tmp_path / "missing", readonly=True)
    budget = open_store(tmp_path / "b", "memmap", disk_budget=1000)
    with pytest.raises(OSError):
        with budget.writer(0, 100) as w:
            for i in range(100):
                w.put(i, np.zeros(1000))
