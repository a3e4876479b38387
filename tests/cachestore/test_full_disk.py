"""A file system that is (or becomes) full: BudgetExceededError, nothing locked, nothing left.

On a real tmpfs of a few MiB. The store must turn every out-of-space path
into :class:`BudgetExceededError`, release its writer lock, remove the staging
area, and accept a writer once there is room again.
"""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from cachestore import BudgetExceededError, open_store

from ..fullfs import fill, free, mounted_tmpfs, open_fds_to
from .helpers import WAIT, check_generation, leftovers, recv, write_generation

pytestmark = pytest.mark.timeout(60)


def sample(generation: int, index: int) -> dict:
    return {"x": np.full(4096, generation * 1000 + index, dtype=np.float32), "y": index}  # 16 KiB


@pytest.fixture
def small_fs(tmp_path):
    with mounted_tmpfs(tmp_path / "fs", "4m") as mount_point:
        yield mount_point


def _assert_room_again(store, path) -> None:
    """Once the filler is gone, a writer takes the lock and commits."""
    write_generation(store, 5, 20, sample)
    check_generation(store.reader(5), 5, 20, sample)
    assert leftovers(path) == []


def test_new_store_on_a_full_disk(small_fs, disk_backend):
    fill(small_fs)
    path = small_fs / "store"
    with pytest.raises(BudgetExceededError, match="disk full while writing store.json") as info:
        open_store(path, disk_backend)
    assert info.value.errno == errno.ENOSPC and isinstance(info.value, OSError)
    assert leftovers(path) == []
    free(small_fs)
    with open_store(path, disk_backend) as store:
        _assert_room_again(store, path)


def test_full_disk_when_taking_the_writer_lock(small_fs, disk_backend):
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        fill(small_fs)
        # No room for the pid in writer.lock: the lock is taken all the same; the generation
        # fails at its first write (or, with a size given, at its projection: 0 B available).
        with pytest.raises(BudgetExceededError, match="disk full|but only 0 B is available|over the 0 B available"):
            with store.writer(0, 20) as writer:
                for i in range(20):
                    writer.put(i, sample(0, i))
        # The lock's fd is closed (a leaked one held the flock: StoreLockedError for every later writer).
        assert open_fds_to(path / "writer.lock") == []
        assert sorted(os.listdir(path)) == ["store.json"]
        free(small_fs)
        _assert_room_again(store, path)


def test_no_inode_left_for_the_writer_lock(small_fs, disk_backend):
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        fill(small_fs, inodes=True)
        with pytest.raises(BudgetExceededError, match="disk full while creating the writer lock"):
            store.writer(0, 20)
        assert sorted(os.listdir(path)) == ["store.json"]
        free(small_fs)
        _assert_room_again(store, path)


def test_prune_frees_a_full_disk(small_fs, disk_backend):
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        write_generation(store, 0, 60, sample)  # about 1 MiB
        write_generation(store, 1, 60, sample)
        fill(small_fs)
        removed = store.prune(keep=1)  # takes the writer lock, which has no room for its pid
        assert [r.generation for r in removed if r.kind == "generation"] == [0]
        assert open_fds_to(path / "writer.lock") == []
        write_generation(store, 2, 40, sample)  # in the space the prune freed
        check_generation(store.reader(2), 2, 40, sample)
        assert leftovers(path) == []


def test_disk_fills_after_the_writer_opened(small_fs, disk_backend):
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        write_generation(store, 0, 10, sample)
        writer = store.writer(1, 100)
        fill(small_fs)
        with pytest.raises(BudgetExceededError, match="disk full|no room"):
            for i in range(100):
                writer.put(i, sample(1, i))
            writer.commit()
        assert writer.state == "aborted"
        assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]
        check_generation(store.reader(0), 0, 10, sample)
        free(small_fs)
        _assert_room_again(store, path)


def _write_on_full_disk(path: str, backend: str, mount_point: str, conn) -> None:
    """In a child: open a writer, fill the disk, write; report what was raised."""
    store = open_store(path, backend)
    writer = store.writer(0, 50)
    fill(mount_point)
    try:
        for i in range(50):
            writer.put(i, sample(0, i))
        writer.commit()
        conn.send(("committed", ""))
    except Exception as exc:
        conn.send((type(exc).__name__, str(exc)))
    conn.send(sorted(os.listdir(path)))


def test_full_disk_is_an_error_not_a_sigbus(small_fs, disk_backend, children):
    # LMDB maps its lock file writable: on a full tmpfs, its first write through the map was a
    # SIGBUS that killed the process. Run in a child, so a crash fails the test instead of pytest.
    path = small_fs / "store"
    proc, conn = children(_write_on_full_disk, str(path), disk_backend, str(small_fs))
    kind, message = recv(conn)
    assert (kind, proc.exitcode) == ("BudgetExceededError", None), message
    assert recv(conn) == ["store.json"]
    proc.join(WAIT)
    assert proc.exitcode == 0
    free(small_fs)
    with open_store(path, disk_backend) as store:
        _assert_room_again(store, path)


def _write_together_on_full_disk(path: str, mount_point: str, conn) -> None:
    """In a child: join a generation of one-byte samples, write one, fill the disk, write on; report."""
    n = 4096  # the done map's first page holds 1024 samples, the column's first page all of them
    store = open_store(path, "memmap", fingerprint={"data": "full"})
    writer = store.join(0, n)
    results = [writer.put(0, {"b": np.full(1, 0, np.uint8)}).value]
    fill(mount_point)
    try:
        # Row 2000 lies in the column's first page, which has its block: the write succeeds, and marking the
        # sample done goes to the done map's second page (a SIGBUS when it went through a mapping).
        for i in range(2000, n):
            results.append(writer.put(i, {"b": np.full(1, i % 256, np.uint8)}).value)
        conn.send(("all written", results))
    except Exception as exc:
        conn.send((type(exc).__name__, results))
    writer.abort()
    conn.send(sorted(os.listdir(path)))


def test_writing_together_onto_a_full_disk_is_an_error_not_a_sigbus(small_fs, children):
    path = small_fs / "store"
    proc, conn = children(_write_together_on_full_disk, str(path), str(small_fs))
    try:
        kind, results = recv(conn)
    except AssertionError:
        proc.join(WAIT)
        raise AssertionError(f"the writer died with exit code {proc.exitcode} (-7: a SIGBUS)") from None
    assert kind == "BudgetExceededError", (kind, proc.exitcode)
    assert results[:2] == ["written", "written"]  # the second one was marked done on the full disk
    assert recv(conn) == ["store.json"]  # the last member out removed the area
    proc.join(WAIT)
    assert proc.exitcode == 0
    free(small_fs)
    with open_store(path, "memmap", fingerprint={"data": "full"}) as store:
        writer = store.join(0, 4)
        for i in range(4):
            writer.put(i, {"b": np.full(1, i, np.uint8)})
        assert writer.commit() is not None


def test_shard_of_an_aborted_generation_closes_quietly(small_fs, disk_backend):
    # As the loader without workers does it: a shard from the writer's spec in this process.
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        writer = store.writer(0, 50)
        shard = writer.shard_spec().open("main")
        fill(small_fs)
        with pytest.raises(BudgetExceededError):
            for i in range(50):
                shard.put(i, sample(0, i))
            shard.flush()
        writer.abort()
        free(small_fs)
        shard.close()  # its staging area is gone: nothing to write, nothing to raise
        writer = store.writer(0, 20)  # the next generation, in this same process
        shard = writer.shard_spec().open("main")
        for i in range(20):
            shard.put(i, sample(0, i))
        shard.close()
        writer.commit()
        check_generation(store.reader(0), 0, 20, sample)
        assert leftovers(path) == []


def test_failed_shard_releases_the_space_at_once(small_fs, disk_backend):
    path = small_fs / "store"
    with open_store(path, disk_backend) as store:
        writer = store.writer(0)  # no projection: the disk itself fills up
        shard = writer.shard_spec().open("main")
        with pytest.raises(BudgetExceededError):
            for i in range(300):  # 4.8 MiB into 4 MiB
                shard.put(i, sample(0, i))
            shard.flush()
        writer.abort()
        # `shard` is not closed by anyone, yet its files are: their blocks are free again
        # (an open fd keeps a deleted file's blocks allocated, and the disk full).
        assert [link for link in _fd_links() if link.startswith(str(path))] == []
        write_generation(store, 1, 150, sample)  # 2.4 MiB: needs the space back


def _fd_links() -> list[str]:
    links = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            links.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass
    return links


def test_a_mixed_generation_has_no_holes_in_its_columns(small_fs):
    # Rows of samples kept in segments are holes in the column files, which readers map: on a full tmpfs,
    # a read of a hole through a mapping is a SIGBUS. The commit reserves their blocks.
    path = small_fs / "store"
    with open_store(path, "memmap") as store:
        writer = store.writer(0, 8)
        for i in range(8):
            # Odd samples have another structure: they go to the shard's segment, their column rows stay empty.
            writer.put(i, {"x": np.full(1024, i, np.float32)} if i % 2 == 0 else {"x": np.full(1024, i, np.float32),
                                                                                   "odd": np.int64(i)})
        info = writer.commit()
        assert info.layout == "mixed"
        column = path / "gen-000000" / "col-0.bin"
        assert column.stat().st_blocks * 512 >= 8 * 4096


def _commit_lmdb_on_full_disk(path: str, mount_point: str, conn) -> None:
    """In a child: write a generation of small fixed samples, fill the disk, commit; report."""
    with open_store(path, "lmdb") as store:
        writer = store.writer(0, 16)
        shard = writer.shard_spec().open("w0")  # as a worker writes: flushed and closed before the commit
        for i in range(16):
            shard.put(i, {"x": np.full(4, i, np.float32)})
        shard.close()
        fill(mount_point)
        try:
            info = writer.commit()
            conn.send(("committed", info.extra.get("lmdb_layout")))
        except Exception as exc:
            conn.send((type(exc).__name__, str(exc)))


def test_an_lmdb_commit_on_a_full_disk_is_an_error_not_a_sigbus(small_fs, children):
    # The commit rewrites fixed samples by column into a new LMDB environment; LMDB writes its lock file
    # through a mapping, and the first page it touched on the full tmpfs was a SIGBUS.
    proc, conn = children(_commit_lmdb_on_full_disk, str(small_fs / "store"), str(small_fs))
    try:
        kind, _ = recv(conn)
    except AssertionError:
        proc.join(WAIT)
        raise AssertionError(f"the writer died with exit code {proc.exitcode} (-7: a SIGBUS)") from None
    assert kind in ("committed", "BudgetExceededError")
    proc.join(WAIT)
    assert proc.exitcode == 0


def test_adopting_a_partial_generation_on_a_full_disk_is_a_budget_error(small_fs, disk_backend):
    # Adoption rewrites the shards' logs under new names: on a full disk that is the budget's call (the
    # loader's policy), never a bare OSError; what was kept is still there to adopt once there is room.
    path = small_fs / "store"
    with open_store(path, disk_backend, fingerprint={"data": "partial"}) as store:
        writer = store.writer(0, 20, resume=True)
        shard = writer.shard_spec().open("w0")
        for i in range(8):
            shard.put(i, sample(0, i))
        shard.close()
        writer.keep()
        fill(small_fs)  # not the inodes: the writer lock is made again
        with pytest.raises(BudgetExceededError, match="disk full while adopting"):
            store.writer(0, 20, resume=True)
        free(small_fs)
        writer = store.writer(0, 20, resume=True)
        assert writer.adopted
        for i in range(20):
            if i not in writer.present():
                writer.put(i, sample(0, i))
        writer.commit()
        check_generation(store.reader(0), 0, 20, sample)


def test_joining_on_a_disk_without_an_inode_left_is_a_budget_error(small_fs):
    # Another process writes the store together (the writer lock is there); making the shared area of
    # another generation needs inodes the disk no longer has.
    path = small_fs / "store"
    with open_store(path, "memmap", fingerprint={"data": 1}) as first, \
            open_store(path, "memmap", fingerprint={"data": 1}) as second:
        member = first.join(0, 20)
        fill(small_fs, inodes=True)
        with pytest.raises(BudgetExceededError, match="disk full"):
            second.join(1, 20)
        free(small_fs)
        member.abort()
        joined = second.join(1, 20)
        joined.abort()
    assert sorted(os.listdir(path)) == ["store.json"]


def test_a_shared_area_that_cannot_be_made_leaves_no_lock_file(small_fs):
    path = small_fs / "store"
    with open_store(path, "memmap", fingerprint={"data": 1}) as store:
        fill(small_fs)
        with pytest.raises(BudgetExceededError, match="disk full"):
            store.join(0, 2000)  # no room for its record, nor for its done map
        assert sorted(os.listdir(path)) == ["store.json"]


def _mark_in_a_sparse_done_map(directory: str, mount_point: str, conn) -> None:
    """In a child: claim files made sparse (as an older version made them), a full disk, a mark; report."""
    from cachestore.guard.claims import CLAIMS_NAME, DONE_NAME, Claims
    for name, size in ((CLAIMS_NAME, 4096), (DONE_NAME, 4 * 4096)):
        with open(os.path.join(directory, name), "wb") as f:
            f.truncate(size)
    claims = Claims(directory, 4096)
    fill(mount_point)
    try:
        assert claims.try_claim(3000)
        claims.finish([3000], "w0")
        conn.send(("marked", claims._done is None))
    except Exception as exc:
        conn.send((type(exc).__name__, claims._done is None))


def test_a_done_map_with_holes_is_never_mapped(small_fs, children):
    # A shared area an older version made has a sparse done map: marking a sample there on a full disk
    # must be an error (BudgetExceededError), never a store through a mapping of a hole (a SIGBUS).
    area = small_fs / "area"
    area.mkdir()
    proc, conn = children(_mark_in_a_sparse_done_map, str(area), str(small_fs))
    try:
        kind, unmapped = recv(conn)
    except AssertionError:
        proc.join(WAIT)
        raise AssertionError(f"the writer died with exit code {proc.exitcode} (-7: a SIGBUS)") from None
    assert (kind, unmapped) == ("BudgetExceededError", True)
    proc.join(WAIT)
    assert proc.exitcode == 0
