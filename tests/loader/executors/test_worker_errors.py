"""A dataset's exception reaches the training loop as itself, with or without workers."""

from __future__ import annotations

import pickle
import traceback

import pytest

from loader.errors import WorkerError
from loader import CachedLoader
from loader.executors import messages as m

from ..faulty_datasets import HeldLockError, LabelError, LabelErrorWithDefault, RaisingDataset

pytestmark = pytest.mark.timeout(90)


def _raise_from(nb_worker: int, kind: str, prefix=None) -> BaseException:
    setting = {"prefix": str(prefix), "update_frequency": 2} if prefix is not None else None
    with CachedLoader(RaisingDataset, {"n": 20, "fail_at": 7, "kind": kind}, batch_size=4, nb_worker=nb_worker,
                      shuffle=False, cache_setting=setting) as loader:
        with pytest.raises(BaseException) as info:
            for _ in loader:
                pass
    return info.value


def _printed(exc: BaseException) -> str:
    return "".join(traceback.format_exception(exc))


@pytest.mark.parametrize("nb_worker", [0, 2])
@pytest.mark.parametrize("cache", [False, True])
def test_exception_with_other_constructor_arguments_keeps_its_type(no_leaks, nb_worker, cache):
    exc = _raise_from(nb_worker, "label", no_leaks / "c" if cache else None)
    assert type(exc) is LabelError
    assert str(exc) == "bad label 7 at /data/labels/7.txt"
    assert exc.args == ("bad label 7 at /data/labels/7.txt",)
    assert (exc.index, exc.path) == (7, "/data/labels/7.txt")
    assert exc.sample_index == 7
    printed = _printed(exc)
    assert "sample 7" in printed
    if nb_worker:
        assert "Worker traceback" in printed and "in _fail" in printed and "raise LabelError" in printed
        assert "_fail" in exc.worker_traceback


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_constructor_with_defaults_is_not_called_again(no_leaks, nb_worker):
    exc = _raise_from(nb_worker, "label-default")
    assert type(exc) is LabelErrorWithDefault
    assert str(exc) == "bad label 7 at /data/x" and exc.path == "/data/x"


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_unpicklable_attribute_is_dropped_not_the_exception(no_leaks, nb_worker):
    exc = _raise_from(nb_worker, "lock")
    assert type(exc) is HeldLockError and exc.code == 42 and str(exc) == "sample 7 holds a lock"


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_message_and_traceback_print_as_lines(no_leaks, nb_worker):
    exc = _raise_from(nb_worker, "key")
    assert type(exc) is KeyError and exc.args == ("sample 7 is broken",)
    printed = _printed(exc)
    # KeyError prints its message as a repr: a traceback inside the message came out as one
    # line with literal "\n" in it. As notes, it prints line by line.
    assert "\\n" not in printed
    if nb_worker:
        lines = [line.strip() for line in printed.splitlines()]
        assert any(line.startswith('File "') and "faulty_datasets.py" in line for line in lines)
        assert 'raise KeyError(f"sample {index} is broken")' in lines


def test_class_that_cannot_be_imported_becomes_worker_error(no_leaks):
    exc = _raise_from(2, "local")
    assert type(exc) is WorkerError
    assert "LocalError" in str(exc) and "local failure at 7" in str(exc) and "cannot be imported" in str(exc)
    assert "Worker traceback" in _printed(exc) and exc.sample_index == 7


def test_task_failed_rebuilds_without_calling_the_constructor():
    try:
        raise LabelError(3, "p")
    except LabelError as err:
        failed = m.TaskFailed.from_exception(err, epoch=1, seq=0, part=0, worker_id=2, index=3, kind="dataset")
    failed = pickle.loads(pickle.dumps(failed))  # as it crosses the pipe
    exc = failed.exception(pid=1234, epoch=1)
    assert type(exc) is LabelError and (exc.index, exc.path, exc.worker_pid, exc.worker_id) == (3, "p", 1234, 2)
    assert any("loader worker 2 (pid 1234) while computing sample 3 of epoch 1" in n for n in exc.__notes__)
