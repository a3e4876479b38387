"""What workers receive reaches them: by pickle, by value where pickle cannot name it; what cannot be
sent at all is refused up front, naming the attribute at fault."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest

from cachestore.errors import CacheStoreError, UnsupportedSampleError
from loader import CachedLoader
from loader.errors import NotImportableError

from ..datasets import ArangeDataset, TransformDataset
from ..faulty_datasets import ObjectArrayDataset

pytestmark = pytest.mark.timeout(90)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


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
    return subprocess.run(args, input=stdin, capture_output=True, text=True, env=env, timeout=80)


MAIN_CODE = """
import numpy as np

from loader import CachedLoader

class Squares:
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return np.int64(i * i)

if __name__ == "__main__":
    with CachedLoader(Squares, batch_size=3, nb_worker=2, shuffle=False, collate_fn=lambda s: [int(x) for x in s]) as l:
        print([b for b in l])
"""


@pytest.mark.parametrize("how", ["-c", "stdin", "file"])
def test_a_class_and_a_lambda_of_the_main_module_reach_spawned_workers(tmp_path, how):
    result = _run_main(MAIN_CODE, how, tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[[0, 1, 4], [9, 16, 25]]"


def test_a_class_defined_inside_a_function_and_a_local_collate_reach_the_workers(no_leaks):
    class LocalDataset(ArangeDataset):
        def __getitem__(self, index):
            return super().__getitem__(index)["y"] * 10

    def collate(samples):
        return sorted(samples)

    with CachedLoader(LocalDataset, {"n": 6}, batch_size=3, nb_worker=2, shuffle=False, collate_fn=collate) as l:
        assert [b for b in l] == [[0, 10, 20], [30, 40, 50]]


def test_a_dynamically_created_class_reaches_the_workers(no_leaks):
    made = type("Made", (ArangeDataset,), {"__module__": ArangeDataset.__module__})
    with CachedLoader(made, {"n": 4}, batch_size=2, nb_worker=2, shuffle=False) as l:
        assert [b["y"].tolist() for b in l] == [[0, 1], [2, 3]]


class WithLock(ArangeDataset):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.lock = threading.Lock()


def test_what_cannot_be_sent_is_refused_naming_the_attribute(no_leaks):
    # Checked as the workers start, at the first iter() (torch's workers get the dataset then too).
    with CachedLoader(WithLock(4), batch_size=2, nb_worker=2) as loader:
        with pytest.raises(NotImportableError, match=r"dataset\.lock cannot be sent") as info:
            iter(loader)
    assert isinstance(info.value, CacheStoreError) and isinstance(info.value, ValueError)
    assert "use_threading=True" in str(info.value) and "nb_worker=0" in str(info.value)
    with CachedLoader(TransformDataset, {"n": 4, "transform": threading.Lock()}, batch_size=2, nb_worker=2) as loader:
        with pytest.raises(NotImportableError, match=r"dataset_params\['transform'\] cannot be sent"):
            iter(loader)


@pytest.mark.parametrize("kwargs", [{"nb_worker": 0}, {"nb_worker": 2, "use_threading": True},
                                    {"nb_worker": 2, "start_method": "fork"}])
def test_nothing_is_sent_nothing_is_refused(no_leaks, kwargs):
    with CachedLoader(WithLock(4), batch_size=2, shuffle=False, **kwargs) as l:
        assert [b["y"].tolist() for b in l] == [[0, 1], [2, 3]]


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
