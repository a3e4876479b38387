"""Partial generations at the store level: keep, adopt, present, read back, prune.

A resuming writer (``Store.writer(g, n, resume=True)``) records its producer
in its staging area; one that crashes or calls ``keep()`` leaves a partial
generation that the next resuming writer of the same generation and producer
adopts. Anything else left behind is debris.
"""

from __future__ import annotations

import os
import signal
from pathlib import Path

import numpy as np
import pytest

from cachestore import open_store
from cachestore.cli import main

from .helpers import WAIT, assert_same, fixed_sample, leftovers, recv, spawn, variable_sample

N = 20
FINGERPRINT = {"dataset": "tests.Fixed", "n": N}


def crash_resuming_writer(path: str, backend: str, fingerprint: dict, n: int, indices: list, conn) -> None:
    """Write `indices` of generation 0 (flushed) as a resuming writer, report, wait to be SIGKILLed."""
    store = open_store(path, backend, fingerprint=fingerprint)
    writer = store.writer(0, n, resume=True)
    shard = writer.shard_spec().open("victim")
    for i in indices:
        shard.put(i, fixed_sample(0, i) if i % 2 else variable_sample(0, i))
    shard.flush()
    conn.send(("written", os.getpid()))
    conn.poll(WAIT)  # the parent kills us here


def crash(path: str, backend: str, indices: list, fingerprint: dict = FINGERPRINT, n: int = N) -> None:
    proc, conn = spawn(crash_resuming_writer, path, backend, fingerprint, n, indices)
    assert recv(conn)[0] == "written"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(WAIT)
    assert proc.exitcode == -signal.SIGKILL


def staging(path: str) -> list[Path]:
    return sorted(Path(path).glob(".staging-*"))


def sample(i: int) -> dict:
    return fixed_sample(0, i) if i % 2 else variable_sample(0, i)


def test_a_crashed_writer_is_adopted_and_completed(store_path, disk_backend):
    crash(store_path, disk_backend, list(range(0, N, 3)))
    store = open_store(store_path, disk_backend, fingerprint=FINGERPRINT)
    writer = store.writer(0, N, resume=True)
    assert writer.adopted and writer.present().tolist() == list(range(0, N, 3))
    reader = writer.shard_spec().open_staging()
    assert_same(sample(9), reader.read(9), "sample 9 read back from the staging area")
    assert_same(sample(6), reader.read(6), "sample 6 read back from the staging area")
    reader.close()
    for i in sorted(set(range(N)) - set(writer.present().tolist())):
        writer.put(i, sample(i))
    writer.commit()
    r = store.reader(0)
    for i in range(N):
        assert_same(sample(i), r[i], f"sample {i}")
    r.close()
    assert not store.verify() and not leftovers(store_path) and not staging(store_path)
    store.close()


@pytest.mark.parametrize("other", ["fingerprint", "num_samples", "no resume"])
def test_another_producer_does_not_adopt_it(store_path, disk_backend, other):
    crash(store_path, disk_backend, list(range(5)))
    (left,) = staging(store_path)
    fingerprint = {**FINGERPRINT, "n": 99} if other == "fingerprint" else FINGERPRINT
    store = open_store(store_path, disk_backend, fingerprint=fingerprint)  # nothing committed: it takes over
    writer = store.writer(0, N + 1 if other == "num_samples" else N, resume=other != "no resume")
    assert not writer.adopted and writer.present().size == 0
    assert not left.exists(), "the dead writer's staging of another producer is debris"
    writer.abort()
    store.close()


def test_a_corrupt_or_duplicated_record_is_dropped_at_adoption(store_path):
    crash(store_path, "memmap", [1, 3, 5, 7])
    (left,) = staging(store_path)
    # Sample 3's row in the column file is damaged; the index also lists sample 5 twice (a re-run).
    col = left / "col-0.bin"
    rowbytes = 4 * 8 * 4
    with open(col, "r+b") as f:
        f.seek(3 * rowbytes)
        f.write(b"\xff" * 8)
    idx = left / "victim.idx"
    rows = idx.read_bytes()
    idx.write_bytes(rows + rows[2 * 48:3 * 48])
    store = open_store(store_path, "memmap", fingerprint=FINGERPRINT)
    writer = store.writer(0, N, resume=True)
    assert writer.present().tolist() == [1, 5, 7]
    for i in sorted(set(range(N)) - {1, 5, 7}):
        writer.put(i, sample(i))
    writer.commit()
    assert not store.verify()
    np.testing.assert_array_equal(store.reader(0)[3]["image"], sample(3)["image"])
    store.close()


def test_keep_leaves_it_for_the_next_writer_and_prune_keeps_it(store_path, backend, capsys):
    store = open_store(store_path, backend, fingerprint=FINGERPRINT)
    writer = store.writer(0, N, resume=True)
    for i in range(8):
        writer.put(i, sample(i))
    writer.keep()
    assert writer.state == "kept" and store.lock_holder() is None
    assert [r.kind for r in store.prune(dry_run=True)] == []
    if backend != "memory":
        assert main(["prune", store_path, "--dry-run"]) == 0
        out = capsys.readouterr().out
        assert "would remove" not in out  # kept, and said so
        assert "kept" in out and "partial" in out and "--partial removes it" in out
    writer = store.writer(0, N, resume=True)
    assert writer.present().tolist() == list(range(8))
    writer.keep()
    removed = store.prune(partial=True)
    assert [r.kind for r in removed] == ["staging"]
    writer = store.writer(0, N, resume=True)
    assert not writer.adopted and writer.present().size == 0
    writer.abort()
    store.close()


def test_a_writer_of_another_generation_removes_it(store_path, disk_backend):
    crash(store_path, disk_backend, list(range(4)))
    store = open_store(store_path, disk_backend, fingerprint=FINGERPRINT)
    writer = store.writer(1, N, resume=True)
    assert not writer.adopted
    assert [p.name.split("-")[1] for p in staging(store_path)] == ["000001"]
    writer.abort()
    assert main(["prune", store_path]) == 0
    assert not staging(store_path)
    store.close()


def commit_killed_midway(path: str, backend: str, conn) -> None:
    """Write all of generation 0 as a resuming writer, then be SIGKILLed inside the commit, after
    it began changing the staging area (LMDB: its data already rewritten by column)."""
    store = open_store(path, backend, fingerprint=FINGERPRINT)
    writer = store.writer(0, N, resume=True)
    for i in range(N):
        writer.put(i, fixed_sample(0, i))
    finalize = type(store.backend)._finalize

    def finalize_then_die(self, staging, num_samples):
        finalize(self, staging, num_samples)
        conn.send(("finalized", os.getpid()))
        conn.poll(WAIT)  # the parent kills us here, before the manifest and the rename

    type(store.backend)._finalize = finalize_then_die
    writer.commit()


def test_a_writer_killed_inside_its_commit_leaves_debris_not_a_partial_generation(store_path, disk_backend):
    proc, conn = spawn(commit_killed_midway, store_path, disk_backend)
    assert recv(conn)[0] == "finalized"
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(WAIT)
    assert proc.exitcode == -signal.SIGKILL
    (left,) = staging(store_path)
    store = open_store(store_path, disk_backend, fingerprint=FINGERPRINT)
    writer = store.writer(0, N, resume=True)
    assert not writer.adopted and writer.present().size == 0
    assert not left.exists(), "a staging area whose commit began is debris"
    for i in range(N):
        writer.put(i, fixed_sample(0, i))
    writer.commit()
    r = store.reader(0)
    for i in range(N):
        assert_same(fixed_sample(0, i), r[i], f"sample {i}")
    r.close()
    assert not store.verify() and not leftovers(store_path) and not staging(store_path)
    store.close()
