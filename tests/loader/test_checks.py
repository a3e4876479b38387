"""Classes that spawned workers cannot import are refused up front, with what to do."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from cachestore.errors import CacheStoreError, UnsupportedSampleError
from loader import CachedLoader
from loader.checks import check_importable_by_workers
from loader.errors import NotImportableError

from .datasets import ArangeDataset
from .faulty_datasets import ObjectArrayDataset

pytestmark = pytest.mark.timeout(60)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _run_main(code: str, how: str, tmp_path) -> subprocess.CompletedProcess:
    """Run `code` as the main module: ``python -c``, a script on stdin, or a script file."""
    env = {**os.environ, "PYTHONPATH": ROOT}
    if how == "-c":
        args, stdin = [sys.executable, "-c", code], None
    elif how == "stdin":
        args, stdin = [sys.executable, "-"], code
    else:
        script = tmp_path / "train.py"
        script.write_text(code)
        args, stdin = [sys.executable, str(script)], None
    return subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, timeout=30)


MAIN_CODE = textwrap.dedent("""
    from loader.checks import check_importable_by_workers
    from loader.errors import NotImportableError

    class Squares:
        def __len__(self):
            return 4
        def __getitem__(self, i):
            return i * i

    if __name__ == "__main__":
        try:
            check_importable_by_workers(Squares, nb_worker=2)
        except NotImportableError as exc:
            print("REFUSED:", exc)
        else:
            print("ACCEPTED")
""")


@pytest.mark.parametrize("how", ["-c", "stdin"])
def test_class_in_main_without_a_file_is_refused(tmp_path, how):
    result = _run_main(MAIN_CODE, how, tmp_path)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert out.startswith("REFUSED:"), out
    assert "without a file" in out and "python -c" in out and "stdin" in out
    assert "importable module" in out and "nb_worker=0" in out
    assert "__name__" not in out, "the code already is under the main guard: that hint would mislead"


def test_class_in_a_main_script_file_is_accepted(tmp_path):
    result = _run_main(MAIN_CODE, "file", tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "ACCEPTED"


def test_class_defined_inside_a_function_is_refused():
    class LocalDataset(ArangeDataset):
        pass

    with pytest.raises(NotImportableError, match="defined inside a function") as info:
        check_importable_by_workers(LocalDataset, nb_worker=2)
    message = str(info.value)
    assert "LocalDataset" in message and "importable module" in message and "nb_worker=0" in message
    assert isinstance(info.value, CacheStoreError) and isinstance(info.value, ValueError)


def test_local_collate_fn_is_refused():
    def collate(samples):
        return samples

    with pytest.raises(NotImportableError, match="collate function .*inside a function"):
        check_importable_by_workers(ArangeDataset, nb_worker=2, collate_fn=collate)


def test_dynamically_created_class_is_refused():
    made = type("Made", (ArangeDataset,), {"__module__": ArangeDataset.__module__})
    with pytest.raises(NotImportableError, match="cannot be found under that name"):
        check_importable_by_workers(made, nb_worker=1)


@pytest.mark.parametrize("kwargs", [{"nb_worker": 0}, {"nb_worker": 2, "use_threading": True},
                                    {"nb_worker": 2, "start_method": "fork"}])
def test_nothing_to_import_nothing_checked(kwargs):
    class LocalDataset(ArangeDataset):
        pass

    check_importable_by_workers(LocalDataset, **kwargs)


def test_importable_classes_and_callables_pass():
    import functools

    import numpy as np

    check_importable_by_workers(ArangeDataset, nb_worker=2, collate_fn=np.stack)
    check_importable_by_workers(ArangeDataset, nb_worker=2, collate_fn=functools.partial(np.stack, axis=0))
    check_importable_by_workers(ArangeDataset, nb_worker=2, collate_fn=ArangeDataset(4).__getitem__)


@pytest.mark.parametrize("nb_worker", [0, 2])
def test_object_dtype_sample_says_what_to_do(no_leaks, nb_worker):
    with CachedLoader(ObjectArrayDataset, {"n": 8}, batch_size=4, nb_worker=nb_worker,
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": 2}) as loader:
        with pytest.raises(UnsupportedSampleError) as info:
            list(loader)
    message = str(info.value)
    assert "numpy.ndarray" not in message
    assert "dtype object" in message and "object-dtype arrays" in message
    assert "numeric dtype" in message and "allow_pickle" in message
