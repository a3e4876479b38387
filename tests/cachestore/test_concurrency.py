"""Several processes on one store: readers during a commit, a second writer, shard writers."""

from __future__ import annotations

import errno
import fcntl
import multiprocessing
import os
import time

import numpy as np
import pytest

from cachestore import StoreLockedError, open_store
from cachestore.guard.locking import SharedWriterLock, WriterLock

from .helpers import (WAIT, check_generation, contend_writer, fill_shard, fixed_sample, iterate_generation, leftovers,
                      recv, write_generation)

N = 48


def test_readers_see_only_their_generation_while_a_writer_commits(children, events, disk_store, store_path,
                                                                   disk_backend):
    write_generation(disk_store, 0, N)
    ready, committed = [events() for _ in range(2)], events()
    procs = [children(iterate_generation, store_path, disk_backend, disk_store.reader(0), 0, N, ready[k], committed)
             for k in range(2)]
    for event in ready:
        assert event.wait(WAIT), "a reader process did not start"
    write_generation(disk_store, 1, N)  # while both children iterate generation 0
    committed.set()
    for _, conn in procs:
        report = recv(conn)
        assert report["problems"] == []
        assert report["generations"] == [0, 0]
        assert report["latest_after"] == 1  # they saw the commit happen, and kept reading 0
        assert report["committed_seen"]
    check_generation(disk_store.reader(), 1, N)
    check_generation(disk_store.reader(0), 0, N)


def test_second_writer_process_is_refused_naming_the_holder(children, disk_store, store_path, disk_backend):
    write_generation(disk_store, 0, 8)
    writer = disk_store.writer(1, 4)
    writer.put(0, fixed_sample(1, 0))
    proc, conn = children(contend_writer, store_path, disk_backend)
    outcome, message, seconds = recv(conn)
    assert outcome == "refused", message
    assert f"process {os.getpid()}" in message
    assert seconds < 5  # refused at once, not after waiting for the lock
    writer.abort()
    conn.send("released")
    outcome, pid = recv(conn)
    assert outcome == "holding" and pid == proc.pid
    start = time.monotonic()
    with pytest.raises(StoreLockedError, match=f"process {proc.pid}"):
        disk_store.writer(1, 4)
    assert time.monotonic() - start < 5
    conn.send("release")
    assert recv(conn) == ("released", proc.pid)
    proc.join(WAIT)
    assert proc.exitcode == 0
    # No damage from the contention: generation 0 intact, nothing left over, writing works.
    assert disk_store.verify() == []
    check_generation(disk_store.reader(), 0, 8)
    assert leftovers(store_path) == []
    write_generation(disk_store, 1, 4)


@pytest.mark.parametrize("compression", [None, "zstd"])
def test_writer_processes_fill_one_generation(children, make_store, store_path, disk_backend, compression):
    store = make_store(disk_backend, compression=compression)
    workers = 3
    with store.writer(0, N) as writer:
        spec = writer.shard_spec()
        procs = [children(fill_shard, spec, f"worker-{k}", list(range(k, N - 6, workers)), 0) for k in range(workers)]
        for i in range(N - 6, N):  # the owner writes some samples itself
            writer.put(i, fixed_sample(0, i))
        pids = set()
        for proc, conn in procs:
            outcome, count, pid = recv(conn)
            assert outcome == "done" and count > 0
            pids.add(pid)
            proc.join(WAIT)
            assert proc.exitcode == 0
        assert len(pids | {os.getpid()}) == workers + 1
    infos = store.generations()
    assert [(g.id, g.committed, g.num_samples) for g in infos] == [(0, True, N)]
    check_generation(store.reader(), 0, N)
    assert store.verify() == []
    assert leftovers(store_path) == []


def read_in_forked_child(reader, conn) -> None:
    try:
        check_generation(reader, 0, 8)
        conn.send("ok")
    except BaseException as exc:  # report anything: the parent asserts on the text
        conn.send(f"{type(exc).__name__}: {exc}")


def test_reader_opened_before_a_fork_works_in_the_child(disk_store):
    # torch's DataLoader forks its workers on Linux with the reader already used in the parent.
    write_generation(disk_store, 0, 8)
    reader = disk_store.reader()
    check_generation(reader, 0, 8)
    fork = multiprocessing.get_context("fork")
    parent, child = fork.Pipe()
    proc = fork.Process(target=read_in_forked_child, args=(reader, child), daemon=True)
    proc.start()
    try:
        assert recv(parent) == "ok"
    finally:
        proc.join(WAIT)
        if proc.is_alive():
            proc.kill()
    check_generation(reader, 0, 8)  # and the parent's handles are unharmed


@pytest.mark.parametrize("lock_class", [WriterLock, SharedWriterLock])
def test_a_lock_that_fails_after_opening_its_file_leaves_no_fd_open(tmp_path, monkeypatch, lock_class):
    def no_locks(fd: int, operation: int) -> None:
        raise OSError(errno.ENOLCK, "no locks available")  # as an NFS mount without a lock daemon says

    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(fcntl, "flock", no_locks)
    with pytest.raises(OSError, match="no locks"):
        lock_class(tmp_path).acquire()
    monkeypatch.undo()
    assert set(os.listdir("/proc/self/fd")) == before
    lock = lock_class(tmp_path)
    lock.acquire()  # nothing left held
    assert lock.held
    lock.release()
    assert not lock.held


@pytest.mark.timeout(60)
def test_a_writer_waits_for_a_prune_and_still_refuses_a_writer(tmp_path):
    # A prune holds the writer lock for a moment (and says so in it); a writer that meets it waits,
    # one that meets another writer fails at once.
    import threading

    store = open_store(tmp_path / "s", "memmap")
    prune = WriterLock(store.path, brief=True)
    prune.acquire()
    released = threading.Timer(0.3, prune.release)
    released.start()
    try:
        with store.writer(0, num_samples=1) as writer:  # waits for the prune instead of failing
            assert not prune.held
            writer.put(0, {"x": np.zeros(2)})
            writer.commit()
    finally:
        released.join()
    other = WriterLock(store.path)
    other.acquire()
    try:
        with pytest.raises(StoreLockedError, match="being written"):
            store.writer(1, num_samples=1)
    finally:
        other.release()
        store.close()


def test_a_writer_whose_lock_file_was_removed_leaves_the_next_writers_lock_alone(tmp_path):
    # rm -rf of the store under a writer, then another writer takes a new lock file at the path: the
    # first one's release must not unlink it, or a third writer would run beside the second.
    root = tmp_path / "s"
    root.mkdir()
    first = WriterLock(root)
    first.acquire()
    (root / "writer.lock").unlink()  # what rm -rf does to it
    second = WriterLock(root)
    second.acquire()
    first.release()
    try:
        with pytest.raises(StoreLockedError, match="being written"):
            WriterLock(root).acquire()
    finally:
        second.release()
    assert not (root / "writer.lock").exists()
