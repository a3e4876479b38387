"""A stream's identity is taken once, at the loader's first iter(): what its own iteration changes in it
(a count of its passes, a resampled webdataset pipeline's state) is no other dataset, in the same
loader's next epoch, in a new process that loads the loader's state, or in a new loader on the object."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import numpy as np
import pytest

from loader import CachedLoader

from .identity_script import FilesCountingPasses, write_files, write_shards

pytestmark = [pytest.mark.timeout(240),
              # webdataset leaves its shards' files to the garbage collector
              pytest.mark.filterwarnings("ignore::ResourceWarning"),
              pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")]
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
N = 20


def leg(tmp, name, kind, setting, load=None, stop_after=None, epochs=3):
    """One leg of the run in a fresh process: (labels of each batch served, the state it took)."""
    out = tmp / f"{name}.json"
    cmd = [sys.executable, "-m", "tests.loader.streams.identity_script", str(out), "--kind", kind, "--root",
           str(tmp), "--setting", json.dumps(setting), "--epochs", str(epochs)]
    if load is not None:
        (tmp / f"{name}.state").write_bytes(pickle.dumps(load))
        cmd += ["--load", str(tmp / f"{name}.state")]
    if stop_after is not None:
        cmd += ["--stop-after", str(stop_after)]
    done = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    doc = json.loads(out.read_text())
    return doc["served"], pickle.loads(bytes.fromhex(doc["state"]))


def setting(kind: str, prefix, cached: bool) -> dict:
    s: dict = {"batch_size": 4, "seed": 3}
    if cached:  # cached epochs are shuffled
        s["shuffle"] = True
        s["cache_setting"] = {"prefix": str(prefix), "stream_samples": 12} if kind == "wds" else {"prefix": str(prefix)}
    return s


@pytest.mark.parametrize("kind,cached", [("passes", True), ("passes", False), ("wds", True)])
def test_a_state_taken_in_one_process_resumes_in_another(tmp_path, kind: str, cached: bool) -> None:
    if kind == "wds":
        pytest.importorskip("webdataset")
        write_shards(str(tmp_path), 2, 8)
    else:
        write_files(str(tmp_path), N)
    golden, _ = leg(tmp_path, "golden", kind, setting(kind, tmp_path / "golden", cached))
    per_epoch = len(golden) // 3
    # Stopped in the second epoch: this process iterated the stream once, its attributes moved on.
    stop = per_epoch + 2
    first, state = leg(tmp_path, "first", kind, setting(kind, tmp_path / "resumed", cached), stop_after=stop)
    second, _ = leg(tmp_path, "second", kind, setting(kind, tmp_path / "resumed", cached), load=state)
    served = first + second
    assert len(golden) == len(served) == 3 * per_epoch
    if kind == "wds":  # resampled shards draw other samples in another process: each epoch serves the store's
        epochs = [sorted(v for b in served[e * per_epoch:(e + 1) * per_epoch] for v in b) for e in range(3)]
        assert epochs[1] == epochs[2] == epochs[0]
    else:
        assert served == golden


def test_a_new_loader_on_the_object_an_earlier_loader_iterated(tmp_path) -> None:
    write_files(str(tmp_path), N)
    stream = FilesCountingPasses(str(tmp_path / "files"))
    kwargs = dict(batch_size=4, num_workers=0, seed=2, cache_setting={"prefix": str(tmp_path / "cache")})
    with CachedLoader(stream, **kwargs) as first:
        it = iter(first)
        next(it)
        state = first.state_dict()
        rest = [np.asarray(b["i"]).ravel().tolist() for b in it]
    assert stream.passes == 1
    with CachedLoader(stream, **kwargs) as second:  # the same object, as the first loader left it
        second.load_state_dict(state)
        assert [np.asarray(b["i"]).ravel().tolist() for b in second] == rest
    stream.directory = str(tmp_path / "elsewhere")  # changed by its user: another dataset
    with CachedLoader(stream, **kwargs) as third, pytest.raises(ValueError, match="dataset_params"):
        third.load_state_dict(state)
