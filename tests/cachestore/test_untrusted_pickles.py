"""Reading a store never runs its writer's code: a pickled leaf loads only where the reader allows it.

A store written with ``allow_pickle=True`` holds a sample whose unpickling writes a file (what
``os.system`` would do for someone less polite). Every way of reading it without
``allow_pickle`` refuses the sample, naming generation, index and the option, and no file
appears; ``verify`` and ``inspect --verify`` check the pickled leaf's checksum without loading
it. The same store read with ``allow_pickle=True`` does write the file: the plant is real.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from cachestore import PickleRefusedError, open_store
from cachestore.cli import main

from .helpers import planted_sample

N = 6


@pytest.fixture
def planted(tmp_path, disk_backend):
    """``(store path, marker)``: a committed generation 0 of planted samples; the marker not there."""
    marker = str(tmp_path / "marker")
    path = str(tmp_path / "store")
    with open_store(path, disk_backend, allow_pickle=True) as store:
        with store.writer(0, N) as writer:
            for i in range(N):
                writer.put(i, planted_sample(marker, i))
    assert not os.path.exists(marker), "writing pickles the object; nothing of it runs"
    return path, marker


def test_a_reader_without_allow_pickle_refuses_the_sample(planted):
    path, marker = planted
    with open_store(path, readonly=True) as store:
        reader = store.reader()
        for read in (lambda: reader[2], lambda: reader.get(2, copy=False), lambda: reader.get_batch([1, 2]),
                     lambda: pickle.loads(pickle.dumps(reader))[2]):
            with pytest.raises(PickleRefusedError) as info:
                read()
            assert info.value.generation == 0 and info.value.index in (1, 2)
            assert "generation 0" in str(info.value) and "allow_pickle=True" in str(info.value)
        assert isinstance(info.value, PermissionError)
        assert store.verify() == [] and reader.verify() == [], "the checksums are sound"
        reader.close()
    assert not os.path.exists(marker)


def test_inspect_verify_and_prune_never_load_it(planted, capsys):
    path, marker = planted
    assert main(["inspect", path]) == 0
    assert main(["inspect", path, "--verify"]) == 0
    assert f"verify: ok, {N} samples in 1 generation checked" in capsys.readouterr().out
    assert main(["prune", path, "--keep", "1"]) == 0
    assert main(["prune", path, "--keep", "0", "--dry-run"]) == 0
    assert not os.path.exists(marker)


def test_verify_checks_a_pickled_leaf_by_its_checksum(planted, disk_backend):
    path, marker = planted
    if disk_backend == "memmap":
        (seg,) = (Path(path) / "gen-000000").glob("*.seg")
        data = bytearray(seg.read_bytes())
        data[-20] ^= 0xFF  # inside the last sample's pickled bytes
        seg.write_bytes(bytes(data))
        with open_store(path, readonly=True) as store:
            (bad,) = store.verify()
        assert (bad.generation, bad.index) == (0, N - 1) and "checksum" in str(bad)
    with open_store(path, readonly=True, allow_pickle=True) as store:
        store.verify()  # with the reader's permission too: verifying loads nothing
    assert not os.path.exists(marker)


def test_the_plant_is_real_a_reader_that_allows_pickle_runs_it(planted):
    path, marker = planted
    with open_store(path, readonly=True, allow_pickle=True) as store:
        with store.reader() as reader:
            sample = reader[3]
    assert sample["y"] == 3 and os.path.exists(marker), "allow_pickle=True loads the leaf: the plant ran"


def test_a_resuming_writer_reads_back_a_partial_generation_only_as_allowed(tmp_path):
    marker = str(tmp_path / "marker")
    path = str(tmp_path / "store")
    fingerprint = {"dataset": "planted"}
    with open_store(path, "memmap", allow_pickle=True, fingerprint=fingerprint) as store:
        writer = store.writer(0, N, resume=True)
        for i in range(3):
            writer.put(i, planted_sample(marker, i))
        writer.keep()
    with open_store(path, "memmap", fingerprint=fingerprint) as store:
        writer = store.writer(0, N, resume=True)
        assert writer.present().tolist() == [0, 1, 2]
        staging = writer.shard_spec().open_staging()
        with pytest.raises(PickleRefusedError, match="sample 1 in the staging area .* allow_pickle=True"):
            staging.read(1)
        staging.close()
        writer.abort()
    assert not os.path.exists(marker)
