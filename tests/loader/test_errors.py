"""Every loader error lives in loader.errors and derives from CacheStoreError and a builtin."""

from __future__ import annotations

import pytest

import loader.errors
from cachestore import CacheStoreError
from loader.errors import (ClusterUnreachableError, MissingDependencyError, NotImportableError, NotPicklableError,
                           RankFailedError, SampleError, SettingFixedError, TooManyOpenFilesError, WorkerError,
                           WorkerTimeoutError)

HIERARCHY = {
    WorkerError: RuntimeError,
    ClusterUnreachableError: ConnectionError,
    WorkerTimeoutError: (TimeoutError, RuntimeError),  # RuntimeError: what torch's DataLoader raises on a timeout
    MissingDependencyError: ImportError,
    NotImportableError: ValueError,
    NotPicklableError: TypeError,
    SettingFixedError: (ValueError, AttributeError),  # torch's, and Python's for a read-only attribute
    SampleError: Exception,  # internal: the dataset's own exception is what reaches the user
    RankFailedError: RuntimeError,
    TooManyOpenFilesError: RuntimeError,  # torch's loader raises RuntimeError naming `ulimit -n`
}


@pytest.mark.parametrize("error", list(HIERARCHY), ids=lambda e: e.__name__)
def test_error_derives_from_base_and_builtin(error):
    assert issubclass(error, CacheStoreError)
    builtins = HIERARCHY[error]
    assert all(issubclass(error, b) for b in (builtins if isinstance(builtins, tuple) else (builtins,)))


def test_every_loader_error_is_in_errors_module():
    errors = {obj for name in loader.errors.__all__ if isinstance(obj := getattr(loader.errors, name), type)}
    assert errors == set(HIERARCHY)


def test_sample_error_tags_the_dataset_exception():
    cause = KeyError("label")
    wrapped = SampleError(7, cause)
    assert wrapped.index == 7 and wrapped.cause is cause and cause.sample_index == 7
