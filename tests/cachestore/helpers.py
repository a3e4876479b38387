"""Sample makers, comparisons and child-process targets shared by the store tests.

Child processes are started with a local ``spawn`` context and run functions
from this module, which they import by name (``tests.cachestore.helpers``);
so nothing here depends on pytest fixtures, and torch is imported only by the
samples that need it.

Every cross-process wait goes through :func:`recv` (or an ``Event.wait``)
with the :data:`WAIT` timeout: a child that hangs or dies fails the test
instead of hanging it.
"""

from __future__ import annotations

import multiprocessing
import os
import re
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from cachestore import CorruptSampleError, StoreLockedError, open_store, stack_samples

#: Seconds any wait on another process may take before the test fails.
WAIT = 30.0

SPAWN = multiprocessing.get_context("spawn")


# --------------------------------------------------------------------- samples


def fixed_sample(generation: int, index: int) -> dict:
    """A stackable sample (same structure and shapes for every index) naming its generation and index."""
    return {
        "image": np.full((4, 8), generation * 1000 + index, dtype=np.float32),
        "label": int(index),
        "pair": (np.int16(index % 7), float(generation)),
    }


def variable_sample(generation: int, index: int) -> dict:
    """A sample whose array shape depends on the index (not stackable across indices)."""
    return {"tokens": np.arange(index % 5 + 1, dtype=np.int64) + generation * 1000 + index,
            "weight": np.float32(index) / 2}


def pattern_sample(generation: int, index: int, nbytes: int = 4096) -> dict:
    """A sample whose bytes are a pattern found nowhere else in the store (to locate it in a file)."""
    base = (generation + 1) * 10**12 + (index + 1) * 10**6
    return {"data": np.arange(base, base + nbytes // 8, dtype=np.int64)}


def write_generation(store: Any, generation: int, n: int, make: Callable = fixed_sample) -> None:
    """Write and commit `n` samples of `make` as `generation`."""
    with store.writer(generation, n) as writer:
        for i in range(n):
            writer.put(i, make(generation, i))


class Opaque:
    """A type the codec does not know (stored only with ``allow_pickle``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __eq__(self, other: Any) -> bool:
        return type(other) is Opaque and other.value == self.value

    def __repr__(self) -> str:
        return f"Opaque({self.value!r})"


def touch(path: str) -> str:
    """Create the file `path`: what unpickling a :class:`Planted` runs."""
    Path(path).write_text("the writer's code ran in the reader")
    return path


class Planted:
    """An object whose unpickling runs code (writes the file `marker`): a store's writer planting
    it, with ``allow_pickle=True``, gets that code run in any reader that unpickles the sample."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        return (touch, (self.marker,))


def planted_sample(marker: str, index: int) -> dict:
    """A sample with a :class:`Planted` leaf (records layout: a pickled leaf is not stackable)."""
    return {"x": np.full(3, index, dtype=np.float32), "y": index, "planted": Planted(marker)}


def reseal(gen_dir: str | os.PathLike) -> None:
    """After editing files of a committed generation, record their new sizes and the manifest's new
    checksum, as someone who meant to would: only what the store checks beyond that can refuse it."""
    import json

    from cachestore.backends.manifest import manifest_checksum

    gen_dir = Path(gen_dir)
    manifest = json.loads((gen_dir / "manifest.json").read_text())
    if "files" in manifest:
        manifest["files"] = {name: (gen_dir / name).lstat().st_size for name in manifest["files"]}
    manifest.pop("checksum", None)
    manifest["checksum"] = manifest_checksum(manifest)
    (gen_dir / "manifest.json").write_text(json.dumps(manifest))


def as_older_store(gen_dir: str | os.PathLike) -> None:
    """Make a committed generation's manifest look written before manifests recorded file sizes,
    the schema and their own checksum (what an older cachestore's commit left)."""
    import json

    gen_dir = Path(gen_dir)
    manifest = json.loads((gen_dir / "manifest.json").read_text())
    for key in ("files", "checksum") if "lmdb_layout" in manifest else ("files", "checksum", "schema"):
        manifest.pop(key, None)  # (an LMDB layout has always recorded its schema)
    (gen_dir / "manifest.json").write_text(json.dumps(manifest))


# --------------------------------------------------------------------- comparisons


def assert_same(expected: Any, got: Any, where: str = "sample") -> None:
    """Recursive equality that also checks container types, dtypes and shapes."""
    import sys

    torch = sys.modules.get("torch")
    if isinstance(expected, dict):
        assert type(got) is dict, f"{where}: expected a dict, got {type(got).__name__}"
        assert list(got) == list(expected), f"{where}: keys {list(got)} != {list(expected)}"
        for key in expected:
            assert_same(expected[key], got[key], f"{where}[{key!r}]")
    elif type(expected) in (list, tuple):
        assert type(got) is type(expected), f"{where}: expected {type(expected).__name__}, got {type(got).__name__}"
        assert len(got) == len(expected), f"{where}: length {len(got)} != {len(expected)}"
        for k, (e, g) in enumerate(zip(expected, got)):
            assert_same(e, g, f"{where}[{k}]")
    elif torch is not None and isinstance(expected, torch.Tensor):
        assert isinstance(got, torch.Tensor), f"{where}: expected a tensor, got {type(got).__name__}"
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {tuple(got.shape)} != {tuple(expected.shape)}"
        assert torch.equal(got, expected.contiguous()), f"{where}: values differ"
    elif isinstance(expected, np.ndarray):
        assert isinstance(got, np.ndarray), f"{where}: expected an ndarray, got {type(got).__name__}"
        assert got.dtype == expected.dtype, f"{where}: dtype {got.dtype} != {expected.dtype}"
        assert got.shape == expected.shape, f"{where}: shape {got.shape} != {expected.shape}"
        assert np.array_equal(got, expected), f"{where}: values differ"
    elif isinstance(expected, np.generic):
        assert type(got) is type(expected), f"{where}: expected {type(expected).__name__}, got {type(got).__name__}"
        assert got == expected, f"{where}: {got!r} != {expected!r}"
    else:
        assert type(got) is type(expected), f"{where}: expected {type(expected).__name__}, got {type(got).__name__}"
        assert got == expected, f"{where}: {got!r} != {expected!r}"


def check_generation(reader: Any, generation: int, n: int, make: Callable = fixed_sample) -> None:
    """Assert `reader` holds exactly `n` samples of `make` for `generation` (one by one and as a batch)."""
    assert len(reader) == n
    for i in range(n):
        assert_same(make(generation, i), reader[i], f"generation {generation} sample {i}")
    order = list(range(n))[::-1]
    assert_same(stack_samples([make(generation, i) for i in order]), reader.get_batch(order),
                f"generation {generation} batch")


def store_files(root: str | os.PathLike) -> list[str]:
    """Every file and directory under `root`, relative, sorted."""
    root = Path(root)
    return sorted(str(p.relative_to(root)) for p in root.rglob("*"))


#: Names that must never survive a commit, abort or close.
LEFTOVER = re.compile(r"(^|/)(\.staging-|writer\.lock$|lock\.mdb$|\..*\.tmp$|stats-.*\.json$|keys-.*\.bin$)")


def leftovers(root: str | os.PathLike) -> list[str]:
    """Temp files, staging areas and lock files under `root`."""
    return [name for name in store_files(root) if LEFTOVER.search(name)]


# --------------------------------------------------------------------- processes


def spawn(target: Callable, *args: Any) -> tuple[Any, Any]:
    """Start ``target(*args, conn)`` in a spawned process; return ``(process, parent end of the pipe)``."""
    parent, child = SPAWN.Pipe()
    proc = SPAWN.Process(target=target, args=(*args, child), daemon=True)
    proc.start()
    child.close()
    return proc, parent


def recv(conn: Any, timeout: float = WAIT) -> Any:
    """The next message from a child, or a failure after `timeout` seconds."""
    if not conn.poll(timeout):
        raise AssertionError(f"no message from the child process within {timeout} s")
    try:
        return conn.recv()
    except EOFError:
        raise AssertionError("the child process died before sending its message") from None


def crash_writer(path: str, backend: str, generation: int, n: int, report_after: int, conn: Any) -> None:
    """Write `report_after` samples of `generation` (flushed), report, then wait to be SIGKILLed."""
    store = open_store(path, backend)
    writer = store.writer(generation, n)
    shard = writer.shard_spec().open("victim")
    for i in range(report_after):
        shard.put(i, fixed_sample(generation, i))
    shard.flush()
    conn.send(("written", report_after, os.getpid()))
    conn.poll(WAIT)  # the parent kills us here; if it does not, we exit and the test fails on it


def contend_writer(path: str, backend: str, conn: Any) -> None:
    """Try to write while the parent holds the lock, then hold the lock while the parent tries."""
    store = open_store(path, backend)
    start = time.monotonic()
    try:
        writer = store.writer(1, 4)
    except StoreLockedError as exc:
        conn.send(("refused", str(exc), time.monotonic() - start))
    else:
        writer.abort()
        conn.send(("not refused", "", time.monotonic() - start))
        return
    if not conn.poll(WAIT):
        return
    conn.recv()  # the parent released its writer
    writer = store.writer(1, 4)
    writer.put(0, fixed_sample(1, 0))
    conn.send(("holding", os.getpid()))
    if conn.poll(WAIT):
        conn.recv()
    writer.abort()
    conn.send(("released", os.getpid()))


def iterate_generation(path: str, backend: str, pickled_reader: Any, generation: int, n: int,
                       ready: Any, committed: Any, conn: Any) -> None:
    """Read `generation` over and over while the parent commits a newer one; report what was seen.

    Two readers: one pickled by the parent (reopens lazily here), one opened
    here through ``store.reader()`` while `generation` was the latest.
    """
    problems: list[str] = []
    store = open_store(path, backend, readonly=True)
    readers = [pickled_reader, store.reader()]

    def one_pass() -> None:
        for reader in readers:
            try:
                check_generation(reader, generation, n)
            except (AssertionError, CorruptSampleError, OSError, IndexError) as exc:
                problems.append(f"{type(exc).__name__}: {exc}")

    one_pass()
    ready.set()
    deadline = time.monotonic() + WAIT
    while not committed.is_set() and time.monotonic() < deadline:
        one_pass()  # iterating is the work under test, not a wait
    one_pass()  # at least one whole pass after the commit
    conn.send({"problems": problems, "generations": [r.generation for r in readers],
               "latest_after": store.latest(), "committed_seen": committed.is_set()})


def fill_shard(spec: Any, shard_id: str, indices: list[int], generation: int, conn: Any) -> None:
    """Write `indices` of `generation` through ``spec.open(shard_id)`` in this process."""
    shard = spec.open(shard_id)
    for i in indices:
        shard.put(i, fixed_sample(generation, i))
    shard.close()
    conn.send(("done", len(indices), os.getpid()))


def read_everything(path: str, backend: str, conn: Any) -> None:
    """Read every sample of the latest generation and ``verify()``; report errors as text.

    Run in a child so that a damaged file that crashes the reader (SIGBUS)
    shows up as a dead child instead of killing the test run.
    """
    report: dict[str, Any] = {"open": None, "samples": {}, "verify": []}
    store = open_store(path, backend, readonly=True)
    try:
        reader = store.reader(0)
        for i in range(len(reader)):
            try:
                reader[i]
            except CorruptSampleError as exc:
                report["samples"][i] = str(exc)
    except CorruptSampleError as exc:
        report["open"] = str(exc)
    report["verify"] = [str(exc) for exc in store.verify()]
    conn.send(report)


def read_truncated(path: str, victim: str, read: str, gather: str, conn: Any) -> None:
    """Open the newest generation of `path`, read from it, cut its file `victim` to a quarter under
    the open reader, then `read` again (``batch``, ``sample``, ``verify``, ``rows``); report
    ``(error type, message)`` or ``("returned", "")``. A SIGBUS kills this process instead."""
    from cachestore.format import native as native_module

    if gather == "python":
        native_module.NATIVE = None
    store = open_store(path, readonly=True)
    reader = store.reader()
    n = len(reader)
    reader.get_batch(list(range(n)))  # mapped, and paged in
    file = Path(store.reader().data.where) / victim if victim != "*.seg" else \
        next(Path(reader.data.where).glob("*.seg"))
    os.truncate(file, file.stat().st_size // 4)
    calls = {"batch": lambda: reader.get_batch(list(range(n))[::-1]), "sample": lambda: reader[n - 1],
             "verify": lambda: reader.verify(),
             "rows": lambda: reader.read_rows(np.arange(n - 4, n), [np.empty((4, *shape), dtype)
                                                                   for dtype, shape in reader.batch_layout()[1]])}
    try:
        result = calls[read]()
        if read == "verify":
            conn.send(("verify", "; ".join(str(e) for e in result)))
        else:
            conn.send(("returned", ""))
    except Exception as exc:  # reported to the parent
        conn.send((type(exc).__name__, str(exc)))
    conn.close()


def fault_unguarded(path: str, faulthandler_after: bool, conn: Any) -> None:
    """Read through the compiled gather once (its SIGBUS guard installed), cut the file, then touch
    the mapping outside any guard: the process must die of SIGBUS as it would without the guard
    (`faulthandler_after`: with Python's faulthandler enabled after the guard, which then chains
    to it and it back to the guard)."""
    import faulthandler

    from cachestore.format import native as native_module

    gather = native_module.NATIVE
    data = np.memmap(path, dtype=np.uint8, mode="r")
    rows = data.reshape(-1, 4096)
    sums = np.empty(len(rows), dtype=np.uint64)
    assert gather is not None and gather.row_checksums((rows,), (4096,), len(rows), sums)
    if faulthandler_after:
        faulthandler.enable()
    os.truncate(path, 4096)
    assert not gather.row_checksums((rows,), (4096,), len(rows), sums), "the guard reports the fault"
    conn.send("guarded fault reported")
    conn.send(int(rows[-1].sum()))  # unguarded: SIGBUS
