"""Crash safety with real processes: a writer SIGKILLed mid-generation.

The child writes part of generation 1 over a committed generation 0, flushes,
tells the parent how far it got through a pipe, and is killed right there.
"""

from __future__ import annotations

import hashlib
import os
import signal

import pytest

from cachestore import GenerationNotFoundError, open_store

from .helpers import WAIT, check_generation, crash_writer, leftovers, recv, write_generation

N = 24


def digest(root: str) -> dict[str, str]:
    """sha256 of every file under `root`."""
    out = {}
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as f:
                out[os.path.relpath(path, root)] = hashlib.sha256(f.read()).hexdigest()
    return out


@pytest.fixture
def crashed(children, store_path, disk_backend):
    """A store whose writer of generation 1 was SIGKILLed: (store, pid of the dead writer, gen 0 digest)."""
    store = open_store(store_path, disk_backend)
    write_generation(store, 0, N)
    before = digest(os.path.join(store_path, "gen-000000"))
    store.close()
    proc, conn = children(crash_writer, store_path, disk_backend, 1, N, 10)
    message = recv(conn)
    assert message[:2] == ("written", 10)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(WAIT)
    assert proc.exitcode == -signal.SIGKILL
    store = open_store(store_path, disk_backend)
    yield store, message[2], before
    store.close()


def test_killed_writer_leaves_previous_generation_intact(crashed, store_path):
    store, _, before = crashed
    assert digest(os.path.join(store_path, "gen-000000")) == before  # byte for byte
    check_generation(store.reader(), 0, N)
    assert store.verify() == []


def test_staging_of_killed_writer_is_never_visible(crashed):
    store, pid, _ = crashed
    infos = store.generations()
    assert [(g.id, g.committed) for g in infos] == [(0, True), (1, False)]
    assert infos[1].owner_pid == pid and infos[1].nbytes > 0  # the flushed samples are on disk
    assert store.latest() == 0
    assert store.reader().generation == 0
    with pytest.raises(GenerationNotFoundError):
        store.reader(1)


def test_next_writer_removes_the_staging(crashed, store_path):
    store, pid, _ = crashed
    staging = [name for name in os.listdir(store_path) if name.startswith(".staging-")]
    assert len(staging) == 1 and f"-{pid}-" in staging[0]
    write_generation(store, 1, N)  # the dead writer's lock is no obstacle
    assert not os.path.exists(os.path.join(store_path, staging[0]))
    assert leftovers(store_path) == []
    check_generation(store.reader(1), 1, N)
    check_generation(store.reader(0), 0, N)


def test_prune_removes_the_staging_and_the_stale_lock(crashed, store_path):
    store, _, _ = crashed
    assert leftovers(store_path)  # staging area and writer.lock of the dead writer
    planned = store.prune(keep=1, dry_run=True)
    assert {r.kind for r in planned} == {"staging", "lock"}
    assert leftovers(store_path)
    removed = store.prune(keep=1)
    assert {r.kind for r in removed} == {"staging", "lock"}
    assert any(r.kind == "staging" and r.nbytes > 0 for r in removed)
    assert leftovers(store_path) == []
    assert sorted(os.listdir(store_path)) == ["gen-000000", "store.json"]
    check_generation(store.reader(), 0, N)
