"""The ``cachestore`` command line: real stores, real crashed and live writer processes."""

from __future__ import annotations

import json
import multiprocessing as mp
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachestore import open_store
from cachestore.cli import main

CTX = mp.get_context("spawn")
TIMEOUT = 60  # seconds any wait on a child process may take before the test fails
FINGERPRINT = {"dataset": "mypkg.MyDataset", "kwargs": "9f2c", "length": 12}
PRODUCER = {"dataset": "mypkg.MyDataset", "params": {"root": "/data/train", "size": 64}}
N = 12


def sample(generation: int, index: int, variable: bool = False) -> dict:
    """A sample whose bytes contain a marker unique to (generation, index), to find it on disk."""
    repeat = 4 + (index % 3 if variable else 0)
    marker = f"<g{generation}-i{index:04d}>" * repeat
    return {"x": np.frombuffer(marker.encode(), dtype=np.uint8).copy(), "y": index}


def build(path: Path, generations: int = 2, backend: str = "memmap", variable: bool = False,
          epochs: bool = True) -> Path:
    store = open_store(path, backend, fingerprint=FINGERPRINT, producer=PRODUCER)
    for g in range(generations):
        with store.writer(g, num_samples=N) as writer:
            for i in range(N):
                writer.put(i, sample(g, i, variable))
            writer.commit(extra={"epochs": [2 * g, 2 * g + 1]} if epochs else {})
    store.close()
    return path


def committed(path: Path) -> list[int]:
    with open_store(path, readonly=True) as store:
        return [g.id for g in store.generations() if g.committed]


def run(capsys: pytest.CaptureFixture, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def inspect_json(capsys: pytest.CaptureFixture, path: Path, *extra: str) -> tuple[int, dict]:
    code, out, err = run(capsys, "inspect", path, "--json", *extra)
    return code, json.loads(out)


# child processes (spawn: they must be importable module-level functions) -----------------------

def _open_writer_and_wait(path: str, generation: int, complete: bool, ready, release) -> None:
    """Open a writer, write some (or all) samples, signal `ready`, then wait to be killed or released."""
    store = open_store(path)
    writer = store.writer(generation, num_samples=N)
    for i in range(N if complete else N // 2):
        writer.put(i, sample(generation, i))
    ready.set()
    if not release.wait(TIMEOUT):
        writer.abort()
        raise SystemExit(3)
    writer.commit(extra={"epochs": [2 * generation]})
    store.close()


def _exit_at_once() -> None:
    pass


def dead_pid() -> int:
    """The pid of a process that has exited (and been reaped)."""
    proc = CTX.Process(target=_exit_at_once)
    proc.start()
    proc.join(TIMEOUT)
    assert proc.exitcode == 0
    return proc.pid


def start_writer(path: Path, generation: int, complete: bool):
    ready, release = CTX.Event(), CTX.Event()
    proc = CTX.Process(target=_open_writer_and_wait, args=(str(path), generation, complete, ready, release))
    proc.start()
    if not ready.wait(TIMEOUT):
        proc.kill()
        proc.join(TIMEOUT)
        pytest.fail("the writer process did not start writing in time")
    return proc, release


def crash_writer(path: Path, generation: int) -> int:
    """A writer killed with SIGKILL mid-generation: leaves its staging area and a stale lock."""
    proc, _ = start_writer(path, generation, complete=False)
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(TIMEOUT)
    assert proc.exitcode == -signal.SIGKILL
    return proc.pid


def staging_dirs(path: Path) -> list[Path]:
    return sorted(path.glob(".staging-*"))


def snapshot(path: Path) -> dict:
    return {str(p.relative_to(path)): (p.lstat().st_size, p.lstat().st_mtime_ns) for p in path.rglob("*")}


# inspect -------------------------------------------------------------------------------------

def test_inspect_shows_store_generations_and_producer(tmp_path, capsys):
    store = build(tmp_path / "cache")
    code, out, err = run(capsys, "inspect", store)
    assert code == 0 and err == ""
    assert "memmap (format 2, compression none)" in out
    assert "dataset: mypkg.MyDataset" in out
    assert '"root": "/data/train"' in out
    assert "kwargs:  9f2c" in out  # the fingerprint, one key per line
    rows = [line.split() for line in out.splitlines() if "committed" in line]
    assert [(r[0], r[1], r[2], r[3]) for r in rows] == [("0", "committed", "0-1", str(N)),
                                                       ("1", "committed", "2-3", str(N))]
    assert all(r[6] == "1.00x" for r in rows)  # uncompressed: raw bytes == stored bytes
    assert "rotation windows: none" in out and "stale lock" not in out and "writer       none" in out


def test_inspect_table_is_aligned(tmp_path, capsys):
    store = build(tmp_path / "cache", generations=3)
    code, out, _ = run(capsys, "inspect", store)
    lines = out.splitlines()
    header = next(i for i, line in enumerate(lines) if line.strip().startswith("GEN"))
    table = lines[header:header + 4]
    # right-aligned numbers: every row's SAMPLES and SIZE cells end where the header's do
    for column in ("SAMPLES", "SIZE"):
        end = table[0].index(column) + len(column)
        assert all(row[end - 1] != " " and (len(row) == end or row[end] == " ") for row in table)


def test_inspect_json_is_one_machine_readable_document(tmp_path, capsys):
    store = build(tmp_path / "cache")
    code, doc = inspect_json(capsys, store)
    assert code == 0
    assert doc["path"] == str(store) and doc["rotation_windows"] == []
    (info,) = doc["stores"]
    assert (info["backend"], info["format"], info["compression"]) == ("memmap", 2, None)
    assert info["fingerprint"] == FINGERPRINT and info["producer"] == PRODUCER
    assert info["writer_pid"] is None and info["stale_lock"] is None and info["debris"] == []
    assert [(g["id"], g["state"], g["epochs"], g["num_samples"]) for g in info["generations"]] == [
        (0, "committed", [0, 1], N), (1, "committed", [2, 3], N)]
    assert all(g["bytes"] > 0 and g["compression_ratio"] == 1.0 and g["created"] > 0 for g in info["generations"])
    assert info["corrupt"] is None  # not verified


def test_inspect_without_epochs_shows_a_dash(tmp_path, capsys):
    store = build(tmp_path / "cache", generations=1, epochs=False)
    code, out, _ = run(capsys, "inspect", store)
    row = next(line.split() for line in out.splitlines() if "committed" in line)
    assert row[:4] == ["0", "committed", "-", str(N)]
    assert inspect_json(capsys, store)[1]["stores"][0]["generations"][0]["epochs"] is None


@pytest.mark.parametrize("extra, shown, served", [
    ({"epochs": [5], "update_frequency": 5}, "5-9", [5, 9]),  # what the loader records
    ({"epochs": [7], "update_frequency": 5}, "5-9", [5, 9]),  # written by a resumed epoch
    ({"epochs": [0], "update_frequency": 1}, "0", [0, 0]),
    ({"epochs": [3], "update_frequency": None}, "3-", [3, None]),  # never refreshed: every later epoch
    ({"epochs": [10], "background": True, "update_frequency": 5}, "10-14", [10, 14]),
    ({"epochs": [4, 5, 6]}, "4-6", [4, 6]),  # recorded in full by hand
])
def test_inspect_shows_the_epochs_a_generation_serves(tmp_path, capsys, extra, shown, served):
    store = open_store(tmp_path / "cache", "memmap")
    with store.writer(0, num_samples=2) as writer:
        for i in range(2):
            writer.put(i, sample(0, i))
        writer.commit(extra=extra)
    store.close()
    code, out, _ = run(capsys, "inspect", tmp_path / "cache")
    row = next(line.split() for line in out.splitlines() if "committed" in line)
    assert code == 0 and row[:3] == ["0", "committed", shown]
    (gen,) = inspect_json(capsys, tmp_path / "cache")[1]["stores"][0]["generations"]
    assert gen["serves_epochs"] == served and gen["epochs"] == extra["epochs"]


def test_inspect_writes_nothing(tmp_path, capsys):
    store = build(tmp_path / "cache")
    crash_writer(store, 2)  # a stale lock and a staging area: inspect must leave both alone
    before = snapshot(store)
    assert run(capsys, "inspect", store, "--verify")[0] == 0
    assert inspect_json(capsys, store)[0] == 0
    assert snapshot(store) == before


def test_inspect_lmdb_store_reads_backend_from_store_json(tmp_path, capsys):
    store = build(tmp_path / "cache", backend="lmdb")
    code, doc = inspect_json(capsys, store, "--verify")
    assert code == 0
    assert doc["stores"][0]["backend"] == "lmdb" and doc["stores"][0]["corrupt"] == []
    assert [g["num_samples"] for g in doc["stores"][0]["generations"]] == [N, N]


# verify --------------------------------------------------------------------------------------

@pytest.mark.parametrize("backend, variable", [("memmap", False), ("memmap", True), ("lmdb", False)],
                         ids=["memmap-fixed", "memmap-records", "lmdb"])
def test_verify_names_each_corrupt_sample(tmp_path, capsys, backend, variable):
    store = build(tmp_path / "cache", backend=backend, variable=variable)
    code, out, err = run(capsys, "inspect", store, "--verify")
    assert code == 0 and f"verify: ok, {2 * N} samples in 2 generations checked" in out

    for generation, index in [(1, 7), (1, 2)]:
        marker = f"<g{generation}-i{index:04d}>".encode()
        flipped = 0
        for file in (store / f"gen-{generation:06d}").iterdir():
            data = bytearray(file.read_bytes())
            at = data.find(marker)
            while at >= 0:  # every copy: LMDB may keep an old page holding the same bytes
                data[at + 1] ^= 0xFF
                flipped += 1
                at = data.find(marker, at + 1)
            file.write_bytes(bytes(data))
        assert flipped, f"marker of sample {index} not found on disk"

    code, out, err = run(capsys, "inspect", store, "--verify")
    assert code == 1
    assert "verify: 2 corrupt samples" in out
    assert "generation 1, sample 2: checksum mismatch" in out and "generation 1, sample 7: checksum mismatch" in out
    assert "generation 0, sample" not in out
    assert "2 corrupt samples" in err

    code, doc = inspect_json(capsys, store, "--verify")
    assert code == 1
    assert sorted((b["generation"], b["index"]) for b in doc["stores"][0]["corrupt"]) == [(1, 2), (1, 7)]


def test_verify_reports_a_generation_that_cannot_be_opened(tmp_path, capsys):
    store = build(tmp_path / "cache")
    (store / "gen-000000" / "index.npy").write_bytes(b"garbage")
    code, out, err = run(capsys, "inspect", store, "--verify")
    assert code == 1
    assert "generation 0, whole generation:" in out and "1 damaged generation in" in err


# not a store, usage --------------------------------------------------------------------------

@pytest.mark.parametrize("command", ["inspect", "prune"])
def test_not_a_store_exits_2_and_creates_nothing(tmp_path, capsys, command):
    empty = tmp_path / "empty"
    (empty / "sub").mkdir(parents=True)  # a subdirectory that is not a store either
    (empty / "notes.txt").write_text("mine")
    for path in (empty, tmp_path / "missing", empty / "notes.txt"):
        code, out, err = run(capsys, command, path)
        assert code == 2 and out == ""
        assert str(path) in err and ("not a cachestore store" in err or "does not exist" in err)
    assert sorted(p.name for p in empty.rglob("*")) == ["notes.txt", "sub"]
    assert not (tmp_path / "missing").exists()


@pytest.mark.parametrize("argv", [[], ["inspect"], ["frobnicate", "x"], ["prune", "x", "--keep", "-1"],
                                  ["prune", "x", "--keep", "two"], ["prune", "x", "--max-bytes", "12 parsecs"]])
def test_usage_errors_exit_2(capsys, argv):
    code, out, err = run(capsys, *argv)
    assert code == 2 and out == "" and "usage: cachestore" in err


def test_help_exits_0(capsys):
    code, out, _ = run(capsys, "--help")
    assert code == 0 and "inspect" in out and "prune" in out


def test_python_dash_m_cachestore(tmp_path):
    store = build(tmp_path / "cache", generations=1)
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    done = subprocess.run([sys.executable, "-m", "cachestore", "inspect", str(store), "--json"],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["stores"][0]["generations"][0]["num_samples"] == N
    done = subprocess.run([sys.executable, "-m", "cachestore", "inspect", str(tmp_path)],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 0  # tmp_path is a parent: its subdirectory "cache" is a store
    done = subprocess.run([sys.executable, "-m", "cachestore", "inspect", str(store / "gen-000000")],
                          capture_output=True, text=True, timeout=TIMEOUT, env=env)
    assert done.returncode == 2 and "not a cachestore store" in done.stderr


# crash debris --------------------------------------------------------------------------------

def test_crashed_writer_shows_in_inspect_and_prune_removes_its_debris(tmp_path, capsys):
    store = build(tmp_path / "cache")
    pid = crash_writer(store, 2)
    (staging,) = staging_dirs(store)
    assert (store / "writer.lock").exists()

    code, out, _ = run(capsys, "inspect", store)
    assert code == 0
    row = next(line for line in out.splitlines() if "staging" in line and line.split()[0] == "2")
    assert f"pid {pid} (dead)" in row
    assert f"writer.lock, left by pid {pid} (dead), not held" in out
    code, doc = inspect_json(capsys, store)
    info = doc["stores"][0]
    (gen2,) = [g for g in info["generations"] if g["state"] == "staging"]
    assert (gen2["id"], gen2["owner_pid"], gen2["owner_alive"], gen2["num_samples"]) == (2, pid, False, None)
    assert info["stale_lock"]["pid"] == pid and info["writer_pid"] is None
    assert [d["path"] for d in info["debris"]] == [str(staging)]

    before = snapshot(store)
    code, out, err = run(capsys, "prune", store, "--dry-run")
    assert code == 0 and err == ""
    assert snapshot(store) == before
    assert out.count("would remove") == 3  # the staging area, generation 0, the stale lock
    assert staging.name in out and "gen-000000" in out and "writer.lock" in out
    assert "would free" in out and "dry run: nothing was removed" in out

    code, out, err = run(capsys, "prune", store)
    assert code == 0 and err == ""
    assert out.count("removed ") == 3 and "freed " in out
    assert not staging.exists() and not (store / "writer.lock").exists()
    assert committed(store) == [1]

    # the store is whole: its last generation still verifies and a new writer starts cleanly
    assert run(capsys, "inspect", store, "--verify")[0] == 0
    build_more = open_store(store)
    with build_more.writer(2, num_samples=1) as writer:
        writer.put(0, sample(2, 0))
    assert committed(store) == [1, 2]
    assert run(capsys, "prune", store, "--dry-run")[1].count("would remove") == 1


def test_prune_leaves_a_live_writer_alone_and_says_so(tmp_path, capsys):
    store = build(tmp_path / "cache")
    proc, release = start_writer(store, 2, complete=True)
    try:
        (staging,) = staging_dirs(store)
        code, out, _ = run(capsys, "inspect", store)
        assert code == 0 and f"pid {proc.pid} is writing" in out and f"pid {proc.pid} (writing)" in out
        assert "stale lock" not in out

        code, out, err = run(capsys, "prune", store, "--keep", "0")
        assert code == 0 and err == ""
        assert f"live writer pid {proc.pid} holds it" in out and staging.name in out
        kept = next(line for line in out.splitlines() if staging.name in line)
        assert kept.split()[0] == "kept"
        assert staging.exists() and (store / "writer.lock").exists()
        assert committed(store) == []  # committed generations are nobody's: --keep 0 removed them
    finally:
        release.set()
        proc.join(TIMEOUT)
    assert proc.exitcode == 0  # the writer committed what prune left alone
    assert committed(store) == [2]
    with open_store(store, readonly=True) as reopened:
        assert reopened.reader(2)[N - 1]["y"] == N - 1


# what prune removes --------------------------------------------------------------------------

def test_prune_keep_and_max_bytes(tmp_path, capsys):
    store = build(tmp_path / "cache", generations=4)
    code, out, _ = run(capsys, "prune", store, "--keep", "3")
    assert code == 0 and "gen-000000" in out and committed(store) == [1, 2, 3]

    with open_store(store, readonly=True) as s:
        size = max(g.nbytes for g in s.generations())
    code, out, _ = run(capsys, "prune", store, "--keep", "3", "--max-bytes", str(2 * size + size // 2))
    assert code == 0 and committed(store) == [2, 3]
    assert "gen-000001" in out

    assert run(capsys, "prune", store, "--max-bytes", "1GiB")[1].count("removed") == 1  # keep 1 applies too
    assert committed(store) == [3]
    code, out, _ = run(capsys, "prune", store)
    assert code == 0 and "nothing to remove" in out and "freed 0 B" in out
    assert run(capsys, "prune", store, "--keep", "0")[0] == 0 and committed(store) == []
    assert (store / "store.json").exists()  # the store itself stays, empty


def test_prune_never_touches_what_the_store_does_not_own(tmp_path, capsys):
    store = build(tmp_path / "cache")
    outside = tmp_path / "outside"
    (outside / "deep").mkdir(parents=True)
    (outside / "precious.bin").write_bytes(b"x" * 10000)
    (outside / "deep" / "more.bin").write_bytes(b"y" * 100)
    gone = dead_pid()
    # store-shaped names pointing outside: unlinked at most, never followed
    (store / ".staging-000001-99999-abcd").symlink_to(outside, target_is_directory=True)
    (store / f"rotation-{gone}-abcd").symlink_to(outside, target_is_directory=True)
    (store / ".staging-000003-99999-dead").symlink_to(tmp_path / "nowhere")  # dangling
    (store / "gen-000001" / "extra-link").symlink_to(outside / "precious.bin")
    # foreign files, including ones that look a bit like ours
    (store / "notes.txt").write_text("mine")
    (store / ".notes.tmp").write_text("mine too")
    (store / "rotation-notes").mkdir()
    (store / "rotation-notes" / "keep.txt").write_text("mine as well")
    (store / "gen-notes").mkdir()
    # a temp file of a dead process is debris; a live process's may be about to be renamed
    (store / f".store.json.{gone}.0badf00d.tmp").write_text("{")
    (store / f".store.json.{os.getpid()}.0badf00d.tmp").write_text("{")

    assert run(capsys, "inspect", store)[0] == 0  # links and odd names do not break inspect
    code, out, err = run(capsys, "prune", store, "--keep", "0")
    assert code == 0, err

    assert (outside / "precious.bin").read_bytes() == b"x" * 10000
    assert (outside / "deep" / "more.bin").read_bytes() == b"y" * 100
    assert (store / "notes.txt").read_text() == "mine"
    assert (store / ".notes.tmp").exists() and (store / "rotation-notes" / "keep.txt").exists()
    assert (store / "gen-notes").is_dir()
    assert (store / f".store.json.{os.getpid()}.0badf00d.tmp").exists()
    left = sorted(p.name for p in store.iterdir())
    assert left == sorted([".notes.tmp", f".store.json.{os.getpid()}.0badf00d.tmp", "gen-notes", "notes.txt",
                           "rotation-notes", "store.json"])


def test_rotation_windows_listed_and_dead_ones_pruned(tmp_path, capsys):
    store = build(tmp_path / "cache", generations=1)
    gone = dead_pid()
    dead = store / f"rotation-{gone}-9f8e7d6c"
    live = store / f"rotation-{os.getpid()}-0a1b2c3d"
    unknown = store / "rotation-window"
    for window in (dead, live, unknown):
        window.mkdir()
        (window / "slots.bin").write_bytes(b"\0" * 8192)

    code, out, _ = run(capsys, "inspect", store)
    assert code == 0
    assert f"pid {gone} (dead)" in next(line for line in out.splitlines() if dead.name in line)
    assert f"pid {os.getpid()} (alive)" in next(line for line in out.splitlines() if live.name in line)
    assert "unknown" in next(line for line in out.splitlines() if unknown.name in line)
    windows = {Path(w["path"]).name: w for w in inspect_json(capsys, store)[1]["stores"][0]["rotation_windows"]}
    assert windows[dead.name]["owner_alive"] is False and windows[dead.name]["bytes"] >= 8192
    assert windows[live.name]["owner_alive"] is True and windows[unknown.name]["owner_pid"] is None

    code, out, _ = run(capsys, "prune", store)
    assert code == 0
    assert "rotation" in next(line for line in out.splitlines() if dead.name in line)
    assert f"pid {os.getpid()} is alive" in next(line for line in out.splitlines() if live.name in line)
    assert not dead.exists() and live.exists() and unknown.exists()


# a prefix with one store per consumer ---------------------------------------------------------

def test_parent_of_consumer_stores(tmp_path, capsys):
    prefix = tmp_path / "prefix"
    stores = [build(prefix / f"consumer-{i}-of-2", generations=2 + i) for i in range(2)]
    gone = dead_pid()
    (prefix / f"rotation-{gone}-abcdef12").mkdir()
    (prefix / "notes.txt").write_text("mine")

    code, out, _ = run(capsys, "inspect", prefix)
    assert code == 0 and f"{prefix}: 2 stores" in out
    assert out.index(str(stores[0])) < out.index(str(stores[1]))
    assert f"rotation-{gone}-abcdef12" in out
    code, doc = inspect_json(capsys, prefix, "--verify")
    assert code == 0 and [s["path"] for s in doc["stores"]] == [str(s) for s in stores]
    assert [len(s["generations"]) for s in doc["stores"]] == [2, 3]
    assert [Path(w["path"]).name for w in doc["rotation_windows"]] == [f"rotation-{gone}-abcdef12"]

    (stores[1] / "gen-000002" / "index.npy").write_bytes(b"garbage")
    assert run(capsys, "inspect", prefix, "--verify")[0] == 1

    code, out, _ = run(capsys, "prune", prefix)
    assert code == 0
    # the damaged generation 2 goes too: the newest sound one is kept
    assert [committed(s) for s in stores] == [[1], [1]]
    assert not (stores[1] / "gen-000002").exists()
    assert not (prefix / f"rotation-{gone}-abcdef12").exists() and (prefix / "notes.txt").exists()


def test_a_damaged_store_is_a_problem_not_a_crash(tmp_path, capsys):
    prefix = tmp_path / "prefix"
    good = build(prefix / "consumer-0-of-2", generations=1)
    bad = build(prefix / "consumer-1-of-2", generations=1)
    (bad / "store.json").write_text("{not json")
    code, out, err = run(capsys, "inspect", prefix)
    assert code == 1 and str(good) in out and f"cannot read store {bad}" in err
    code, out, err = run(capsys, "prune", prefix, "--keep", "0")
    assert code == 1 and f"cannot prune store {bad}" in err
    assert committed(good) == []


def test_inspect_and_prune_show_a_shared_area_and_its_writers(tmp_path, capsys):
    store = build(tmp_path / "cache", generations=1)
    writing = open_store(store, "memmap", fingerprint=FINGERPRINT, producer=PRODUCER)
    writer = writing.join(1, N)  # this process is a member of generation 1's shared area
    try:
        writer.put(0, sample(1, 0))
        code, doc = inspect_json(capsys, store)
        (area,) = [g for g in doc["stores"][0]["generations"] if g["id"] == 1]
        assert code == 0 and (area["state"], area["shared"], area["members"]) == ("staging", True, True)
        assert "shared (writers in)" in run(capsys, "inspect", store)[1]

        code, out, err = run(capsys, "prune", store, "--keep", "0")
        assert code == 0 and err == "" and "processes writing it together hold it" in out
        assert os.path.isdir(area["path"])
        writer.keep()  # every member left before it was complete: a partial generation
        assert "shared (partial)" in run(capsys, "inspect", store)[1]
    finally:
        writer.abort()
        writing.close()


def test_inspect_names_processes_writing_together_without_a_pid(tmp_path, capsys):
    path = tmp_path / "cache"
    with open_store(path, "memmap", fingerprint=FINGERPRINT) as store:
        shared = store.join(0, N)
        shared.put(0, sample(0, 0))
        code, doc = inspect_json(capsys, path)
        (info,) = doc["stores"]
        assert code == 0 and info["writer_pid"] is None and info["shared_writers"] is True
        code, out, _ = run(capsys, "inspect", path)
        assert "processes writing together" in out and "a live process" not in out
        shared.keep()
        (info,) = inspect_json(capsys, path)[1]["stores"]
        assert info["writer_pid"] is None and info["shared_writers"] is False
