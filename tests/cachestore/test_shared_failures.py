"""Processes writing one generation together (cachestore.write.shared) when something fails on the way.

Each test runs one member in this process and makes one step fail: joining after the area was
made, making its shard, publishing, cleaning up after a failed publish. Whatever fails, the
member gives back its membership, its claims and the store's writer lock, and a complete area
is never lost to a failure that came before the commit changed it.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest

from cachestore import CacheStoreError, GenerationCommitted, PutResult, open_store
from cachestore.backends.staging import has_members, members_path
from cachestore.guard.claims import DONE_NAME, Claims, create_claim_files
from cachestore.space.disk import remove_paths

pytestmark = pytest.mark.timeout(60)
FP = {"dataset": "shared-failures"}
N = 6


def sample(i: int) -> dict:
    return {"x": np.full(16, i, dtype=np.float32), "y": i}


def committed_values(path: Path, n: int = N) -> list[int]:
    with open_store(path) as store, store.reader(0) as reader:
        return [int(reader[i]["y"]) for i in range(n)]


def shared_areas(path: Path) -> list[Path]:
    return [p for p in path.iterdir() if p.name.startswith(".shared-") and p.is_dir()]


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


@pytest.fixture
def path(tmp_path) -> Path:
    return tmp_path / "s"


def fail(exc: BaseException):
    def raising(*args, **kwargs):
        raise exc
    return raising


def test_a_damaged_generation_is_replaced_by_processes_writing_it_together(path):
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.writer(0, N)
        for i in range(N):
            writer.put(i, {"x": np.full(16, -1, dtype=np.float32), "y": -1})
        writer.commit()
        column = path / "gen-000000" / "col-0.bin"
        os.truncate(column, column.stat().st_size // 2)
        assert store.generations()[0].damaged
        shared = store.join(0, N)  # what the loader does for a damaged generation
        for i in range(N):
            assert shared.put(i, sample(i)) is PutResult.WRITTEN
        info = shared.commit()
        assert info is not None and info.committed and shared.state == "committed"
    assert committed_values(path) == list(range(N))
    assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]


def test_a_join_that_fails_once_in_leaves_and_gives_the_lock_back(path, monkeypatch):
    with open_store(path, "memmap", fingerprint=FP) as store:
        monkeypatch.setattr(store, "budget", fail(OSError(errno.EIO, "cannot measure the disk")))
        with pytest.raises(OSError, match="cannot measure"):
            store.join(0, N)
        monkeypatch.undo()
        (area,) = shared_areas(path)
        assert not has_members(area), "the failed member left the area"
        store.writer(1, N).abort()  # the writer lock went back with it


def test_a_shard_that_cannot_be_made_gives_its_claim_back(path, monkeypatch):
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, N)
        monkeypatch.setattr(store.backend, "shard_writer", fail(OSError(errno.ENOSPC, "no space")))
        with pytest.raises(OSError, match="no space"):
            writer.put(2, sample(2))
        monkeypatch.undo()
        other = Claims(writer.path, N)
        try:
            assert other.try_claim(2), "the claim went back: another member may compute the sample"
            other.release()
        finally:
            other.close()
        assert writer.put(2, sample(2))
        writer.keep()


@pytest.mark.parametrize("step", ["interrupt", "cannot-remove-damage"])
def test_a_publish_cut_short_before_the_commit_began_leaves_the_area_complete(path, monkeypatch, step):
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, N)
        for i in range(N):
            writer.put(i, sample(i))
        exc: BaseException
        if step == "interrupt":  # Ctrl-C while it reads store.json again
            exc = KeyboardInterrupt()
            monkeypatch.setattr(writer, "_current_fingerprint", fail(exc))
        else:  # a damaged generation 0 it may not remove
            exc = PermissionError(errno.EACCES, "damaged and read-only")
            # (raising=False: a store layer without the step fails the test below, not here)
            monkeypatch.setattr(store.backend, "clear_damaged", fail(exc), raising=False)
        with pytest.raises(type(exc)):
            writer.commit()
        monkeypatch.undo()
        assert writer.state == "left" and writer.path.is_dir() and not has_members(writer.path)
        writer.abort()  # after leaving: a no-op, the area is the next joiner's
        assert writer.path.is_dir()
        with pytest.raises(GenerationCommitted):
            store.join(0, N)  # finds it complete and publishes it
    assert committed_values(path) == list(range(N))
    assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]


def test_a_failed_commit_whose_clean_up_fails_too_still_leaves(path, monkeypatch):
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, N)
        for i in range(N):
            writer.put(i, sample(i))
        monkeypatch.setattr(store.backend, "commit", fail(CacheStoreError("commit failed")))
        monkeypatch.setattr(store.backend, "discard", fail(OSError(errno.EROFS, "read-only file system")))
        with pytest.raises(OSError, match="read-only"):
            writer.commit()
        monkeypatch.undo()
        assert writer.state == "aborted"
        assert not members_path(writer.path).exists(), "no members file left for an area nobody will commit"
        store.writer(1, N).abort()  # the writer lock went back


def test_a_partial_area_serves_the_copy_its_done_map_names(path):
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, N)
        assert writer.put(0, sample(0))
        # A member killed between flushing sample 1 and marking it done: its copy is in its shard
        # (sorted before the live member's), and the done map names no shard for it.
        dead = store.backend.shard_writer(writer.token, "aaa-dead")
        dead.put(1, {"dead": np.zeros(3, dtype=np.int64)})
        dead.flush()
        dead.close()
        assert writer.put(1, sample(1))  # computed again, as a member does after the claim went back
        staging = writer.shard_spec().open_staging()
        assert staging is not None
        try:
            assert int(staging.read(1)["y"]) == 1
        finally:
            staging.close()
        for i in range(2, N):
            writer.put(i, sample(i))
        assert writer.commit() is not None
    assert committed_values(path) == list(range(N))


def test_claims_of_an_area_without_its_done_map_leave_no_fd_open(tmp_path):
    create_claim_files(tmp_path, 4)
    (tmp_path / DONE_NAME).unlink()  # as a committing member does
    before = open_fds()
    with pytest.raises(FileNotFoundError):
        Claims(tmp_path, 4)
    assert open_fds() == before


def test_a_member_of_an_area_removed_under_it_does_not_publish_the_new_one(path):
    # A commit that failed half way (a full disk) removed the area and unlinked its members file while
    # another member was still in; a joiner made a new area since, and publishes it. The old member
    # holds the commit lock of the old file, which is no lock on the new area: had it published the new
    # area as well, one of the two commits would have found the generation committed already.
    with open_store(path, "memmap", fingerprint=FP) as store, open_store(path, "memmap", fingerprint=FP) as other:
        old = store.join(0, N)
        remove_paths([str(old.path)])  # what the failed commit leaves
        members_path(old.path).unlink()
        new = other.join(0, N)  # another process
        for i in range(N):
            new.put(i, sample(i))
        assert old.commit() is None and old.state == "left"
        assert shared_areas(path) == [new.path]
        info = new.commit()
        assert info is not None and info.committed
    assert committed_values(path) == list(range(N))
    assert sorted(os.listdir(path)) == ["gen-000000", "store.json"]


def test_a_complete_area_whose_publish_found_the_disk_full_is_dropped_by_its_last_member(path, monkeypatch):
    # The store's directory was removed and made again under two members; each member's publish has
    # to write store.json again and finds the disk full. abort() would leave the complete area to the
    # next joiner; drop(), for a caller that gives caching up, has the last member out remove it.
    from cachestore import BudgetExceededError

    with open_store(path, "memmap", fingerprint=FP) as store, open_store(path, "memmap", fingerprint=FP) as other:
        first, second = store.join(0, N), other.join(0, N)
        for i in range(N):
            (first if i % 2 else second).put(i, sample(i))
        full = BudgetExceededError("disk full while writing store.json")
        for writer in (first, second):
            monkeypatch.setattr(writer, "_current_fingerprint", fail(full))
        with pytest.raises(BudgetExceededError):
            first.commit()
        first.drop()
        assert shared_areas(path) == [first.path], "another member is still in"
        with pytest.raises(BudgetExceededError):
            second.commit()
        second.drop()
        assert shared_areas(path) == [] and first.state == second.state == "aborted"
    assert sorted(os.listdir(path)) == ["store.json"]


def test_an_area_written_again_after_its_generation_was_published_is_dropped_as_committed(path, monkeypatch):
    # A member published generation 0 and was killed before it unlinked the members file; the members
    # still in wrote the area again. The one that publishes it finds a sound generation 0 committed:
    # committed by another member (None, as commit() says), not an error, and nothing left behind.
    with open_store(path, "memmap", fingerprint=FP) as store:
        writer = store.join(0, N)
        for i in range(N):
            writer.put(i, sample(i))
        monkeypatch.setattr(store.backend, "clear_damaged", lambda generation: True)
        assert writer.commit() is None
        assert writer.state == "left"
        assert shared_areas(path) == [] and not members_path(writer.path).exists()


@pytest.mark.timeout(120)
def test_a_join_that_meets_a_commit_under_way_waits_for_it_rather_than_finding_nothing_done(path, monkeypatch):
    # The committer unlinks the done map before it renames the area: a process joining between the two
    # found no sample done, computed them all again and served those values beside the committed ones
    # (chaos seed 6193, under load). The interleaving is forced: the joiner reads the area's record (not
    # committing yet), then the committer runs up to the rename and holds there, then the joiner reads
    # the done map; the rename goes on once the joiner has looked whether the generation is committed.
    import threading

    from cachestore.write import shared

    at_rename, release, looked = threading.Event(), threading.Event(), threading.Event()
    store = open_store(path, "memmap", fingerprint=FP)
    member = store.join(0, N)
    for i in range(N):
        member.put(i, sample(i))
    real_commit = store.backend.commit

    def held_commit(*args, **kwargs):
        at_rename.set()
        assert release.wait(60)
        return real_commit(*args, **kwargs)

    monkeypatch.setattr(store.backend, "commit", held_commit)
    committer = threading.Thread(target=member.commit)
    joiner_thread: list[threading.Thread] = []
    real_record, real_committed = shared.staging_record, shared.SharedWriter._committed

    def record_then_commit(*args, **kwargs):
        found = real_record(*args, **kwargs)
        if threading.current_thread() in joiner_thread and not committer.is_alive() and not at_rename.is_set():
            committer.start()
            assert at_rename.wait(60)
        return found

    def committed(self):
        answer = real_committed(self)
        if threading.current_thread() in joiner_thread and at_rename.is_set():
            looked.set()
        return answer

    monkeypatch.setattr(shared, "staging_record", record_then_commit)
    monkeypatch.setattr(shared.SharedWriter, "_committed", committed)
    outcome: list[object] = []

    def join() -> None:
        other = open_store(path, "memmap", fingerprint=FP)
        try:
            writer = other.join(0, N)
            outcome.append(len(writer.present()))
            writer.abort()
        except GenerationCommitted:
            outcome.append("committed")
        finally:
            other.close()

    joiner = threading.Thread(target=join)
    joiner_thread.append(joiner)
    joiner.start()
    assert looked.wait(60), "the joiner never looked whether the generation is committed"
    release.set()
    joiner.join(60)
    committer.join(60)
    assert not joiner.is_alive() and not committer.is_alive()
    assert outcome == ["committed"], "the join found an area under commit and took its samples for not done"
    store.close()
    assert committed_values(path) == list(range(N))
