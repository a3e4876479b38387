"""A store in a prefix other users can write (mode 0777, no sticky bit): what they do there ends
in a CacheStoreError naming the file, or in correct values; never a hang, a write outside, or
their values served as the job's.

The co-tenant is a child process running as another user (:mod:`tests.cotenant`); every case
has a timeout, so a hang (a FIFO opened for reading blocks) fails instead of stalling the run.
"""

from __future__ import annotations

import logging
import os
import pickle
from pathlib import Path

import pytest

from cachestore import CacheStoreError, CorruptSampleError, NotRegularFileError, SymlinkError, open_store
from cachestore.cli import main

from ..cotenant import OTHER, as_cotenant, owned_by_other, shared_prefix  # noqa: F401 (a fixture)
from .helpers import check_generation, fixed_sample, write_generation

N = 6
pytestmark = pytest.mark.timeout(60)


def _other_values(generation: int, index: int) -> dict:
    sample = fixed_sample(generation, index)
    return {**sample, "label": -1}


def _swap_in_own_generation(prefix: Path, backend: str) -> None:
    """The co-tenant writes a generation of its own (correct names, sizes and checksums, other values)
    and puts it in place of the job's newest, renamed aside."""
    theirs = open_store(prefix / ".theirs", backend)
    write_generation(theirs, 0, N, _other_values)
    theirs.close()
    os.rename(prefix / "gen-000000", prefix / "gen-000000.aside")
    os.rename(prefix / ".theirs" / "gen-000000", prefix / "gen-000000")


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_generation_swapped_in_by_another_user_is_never_served(shared_prefix, backend, capsys):
    store = open_store(shared_prefix, backend)
    write_generation(store, 0, N)
    as_cotenant(_swap_in_own_generation, shared_prefix, backend)
    assert (shared_prefix / "gen-000000").stat().st_uid == OTHER
    with pytest.raises(CorruptSampleError, match=f"gen-000000 belongs to user {OTHER}"):
        store.reader(0)
    assert main(["inspect", str(shared_prefix), "--verify"]) == 1
    assert f"belongs to user {OTHER}" in capsys.readouterr().out
    # The job writes its own generation in its place: its values again.
    write_generation(store, 0, N)
    check_generation(store.reader(0), 0, N)
    store.close()


def test_another_users_generation_is_served_where_the_user_named_them(shared_prefix, capsys):
    store = open_store(shared_prefix, "memmap")
    write_generation(store, 0, N)
    as_cotenant(_swap_in_own_generation, shared_prefix, "memmap")
    store.close()
    assert main(["inspect", str(shared_prefix), "--verify", "--trusted-uid", str(OTHER)]) == 0
    assert main(["prune", str(shared_prefix), "--dry-run", "--trusted-uid", str(OTHER)]) == 0
    assert "gen-000000" not in capsys.readouterr().out.split("would remove")[-1]
    trusting = open_store(shared_prefix, "memmap", trusted_uids=[OTHER], max_sample_bytes=1 << 20)
    check_generation(trusting.reader(0), 0, N, _other_values)
    again = pickle.loads(pickle.dumps(trusting))  # as a worker gets it
    assert again.spec == trusting.spec
    check_generation(pickle.loads(pickle.dumps(trusting.reader(0))), 0, N, _other_values)
    again.close()
    trusting.close()
    by_group = open_store(shared_prefix, "memmap", trusted_gids=[OTHER])
    check_generation(by_group.reader(0), 0, N, _other_values)
    by_group.close()


def test_another_users_store_metadata_is_refused(shared_prefix):
    open_store(shared_prefix, "memmap").close()
    owned_by_other(shared_prefix / "store.json")
    with pytest.raises(CacheStoreError, match=f"store.json belongs to user {OTHER}"):
        open_store(shared_prefix, "memmap")
    open_store(shared_prefix, "memmap", trusted_uids=[OTHER]).close()


def _fifo(path: Path) -> None:
    path.unlink(missing_ok=True)
    os.mkfifo(path, 0o666)


def test_a_fifo_store_json_is_an_error_not_a_hang(shared_prefix, capsys):
    open_store(shared_prefix, "memmap").close()
    as_cotenant(_fifo, shared_prefix / "store.json")
    with pytest.raises(NotRegularFileError, match="store.json .*not a regular file"):
        open_store(shared_prefix)
    assert main(["inspect", str(shared_prefix)]) != 0  # an error, no hang
    assert main(["prune", str(shared_prefix), "--dry-run"]) != 0
    assert str(shared_prefix) in capsys.readouterr().err


def _fifo_manifest(prefix: Path) -> None:
    _fifo(prefix / "gen-000000" / "manifest.json")


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_fifo_manifest_is_damage_not_a_hang(shared_prefix, backend, capsys):
    store = open_store(shared_prefix, backend)
    write_generation(store, 0, N)
    os.chmod(shared_prefix / "gen-000000", 0o777)  # a group-writable generation (umask 0)
    as_cotenant(_fifo_manifest, shared_prefix)
    with pytest.raises(CorruptSampleError, match="manifest.json"):
        store.reader(0)
    assert main(["inspect", str(shared_prefix), "--verify"]) == 1
    assert "manifest.json" in capsys.readouterr().out
    assert main(["prune", str(shared_prefix), "--keep", "1"]) == 0
    write_generation(store, 0, N)
    check_generation(store.reader(0), 0, N)
    store.close()


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_a_fifo_staging_record_is_not_a_hang(shared_prefix, backend, capsys):
    store = open_store(shared_prefix, backend)
    writer = store.writer(0, N)
    staging = Path(writer.token.path)
    writer.put(0, fixed_sample(0, 0))
    os.chmod(staging, 0o777)
    as_cotenant(_fifo, staging / "staging.json")
    assert main(["inspect", str(shared_prefix)]) == 0
    assert main(["prune", str(shared_prefix), "--dry-run"]) == 0
    capsys.readouterr()
    for i in range(1, N):
        writer.put(i, fixed_sample(0, i))
    writer.commit()
    check_generation(store.reader(0), 0, N)
    store.close()


def test_a_fifo_writer_lock_is_replaced(shared_prefix):
    store = open_store(shared_prefix, "memmap")
    as_cotenant(_fifo, shared_prefix / "writer.lock")
    write_generation(store, 0, N)  # the FIFO is no lock: dropped, and a lock file made
    check_generation(store.reader(0), 0, N)
    assert main(["inspect", str(shared_prefix)]) == 0
    store.close()


def _lmdb_links(staging: Path, outside: Path) -> None:
    """Swap the job's LMDB staging area for one whose files are links to a file outside the prefix."""
    os.rename(staging, staging.with_name(staging.name + ".aside"))
    staging.mkdir()
    staging.chmod(0o777)
    for name in ("data.mdb", "lock.mdb"):
        (staging / name).symlink_to(outside)


def test_lmdb_files_linked_outside_are_refused_not_written(shared_prefix, tmp_path):
    outside = Path("/tmp") / f"{shared_prefix.name}-victim"
    outside.write_bytes(b"the victim's file")
    outside.chmod(0o666)
    try:
        store = open_store(shared_prefix, "lmdb")
        writer = store.writer(0, N)
        staging = Path(writer.token.path)
        as_cotenant(_lmdb_links, staging, outside)
        with pytest.raises(CacheStoreError, match=r"(lock|data)\.mdb|staging area"):
            for i in range(N):
                writer.put(i, fixed_sample(0, i))
            writer.commit()
        writer.abort()
        assert outside.read_bytes() == b"the victim's file"
        store.close()
    finally:
        outside.unlink()


def _plant_staging(prefix: Path, fingerprint: dict) -> None:
    """The co-tenant writes a partial generation 0 for the job's fingerprint, with other values, and
    leaves it in the prefix as a killed writer of the job would."""
    theirs = open_store(prefix / ".theirs", "memmap", fingerprint=fingerprint)
    writer = theirs.writer(0, N, resume=True)
    for i in range(N - 1):
        writer.put(i, _other_values(0, i))
    writer.keep()
    theirs.close()
    for area in (prefix / ".theirs").iterdir():
        if "staging" in area.name:
            os.rename(area, prefix / area.name)


def test_another_users_staging_area_is_not_adopted(shared_prefix):
    fingerprint = {"dataset": "same"}
    store = open_store(shared_prefix, "memmap", fingerprint=fingerprint)
    as_cotenant(_plant_staging, shared_prefix, fingerprint)
    assert any(p.stat().st_uid == OTHER and "staging" in p.name for p in shared_prefix.iterdir())
    writer = store.writer(0, N, resume=True)
    assert len(writer.present()) == 0, "nothing of the co-tenant's area is taken as written"
    for i in range(N):
        writer.put(i, fixed_sample(0, i))
    writer.commit()
    check_generation(store.reader(0), 0, N)
    store.close()


def test_one_warning_for_a_prefix_others_can_write(shared_prefix, caplog, tmp_path):
    with caplog.at_level(logging.WARNING, logger="cachestore.guard.trust"):
        open_store(shared_prefix, "memmap").close()
        open_store(shared_prefix, "memmap").close()
    said = [r.getMessage() for r in caplog.records if str(shared_prefix) in r.getMessage()]
    assert len(said) == 1 and "sticky" in said[0]
    caplog.clear()
    sticky = Path(f"{shared_prefix}-sticky")
    sticky.mkdir(mode=0o777)
    sticky.chmod(0o1777)
    try:
        with caplog.at_level(logging.WARNING, logger="cachestore.guard.trust"):
            open_store(sticky / "store", "memmap").close()
        assert not caplog.records
    finally:
        import shutil
        shutil.rmtree(sticky)


def test_trusted_ids_are_numbers():
    with pytest.raises(TypeError, match="trusted_uids"):
        open_store("never-made", "memory", trusted_uids="alice")  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="trusted_gids"):
        open_store("never-made", "memory", trusted_gids=[-1])


@pytest.mark.parametrize("backend", ["memmap", "lmdb"])
def test_records_that_cannot_share_a_batch_are_an_error_naming_the_generation(store_path, backend):
    from collections import namedtuple

    import numpy as np

    from cachestore import BatchStackError

    first, second = namedtuple("P", "a b"), namedtuple("P", "a c")  # one name, other fields: as crafted
    store = open_store(store_path, backend)
    writer = store.writer(0, 3)
    writer.put(0, {"x": first(np.zeros(3), 1)})
    writer.put(1, {"x": second(np.zeros(3), 2)})
    writer.put(2, {"x": (1, 2, 3)})
    writer.commit()
    reader = store.reader(0)
    for pair in ([0, 2], [1, 2]):
        with pytest.raises(BatchStackError, match="samples of generation 0 in .* cannot be stacked"):
            reader.get_batch(pair)
    assert reader[1]["x"].c == 2  # each still reads alone
    store.close()
