"""Fixtures of the store tests: one parametrised backend fixture, a store factory, child processes.

Every backend runs the same tests; a backend adds only its name to
``BACKENDS`` (and ``DISK_BACKENDS`` when it keeps its data in files that
other processes can open).
"""

from __future__ import annotations

import os

import pytest

from cachestore import open_store
from cachestore.format import native as native_module

from .helpers import SPAWN, WAIT, spawn

BACKENDS = ["memmap", "lmdb", "memory"]
DISK_BACKENDS = ["memmap", "lmdb"]


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=DISK_BACKENDS)
def disk_backend(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture
def store_path(tmp_path) -> str:
    return str(tmp_path / "store")


@pytest.fixture
def make_store(store_path: str):
    """``make_store(backend, **options)``: a store at `store_path`, closed at teardown."""
    opened = []

    def make(backend: str, **options):
        store = open_store(store_path, backend, **options)
        opened.append(store)
        return store

    yield make
    for store in opened:
        store.close()


@pytest.fixture
def store(make_store, backend: str):
    return make_store(backend)


@pytest.fixture
def disk_store(make_store, disk_backend: str):
    return make_store(disk_backend)


@pytest.fixture
def children():
    """``children(target, *args) -> (process, conn)``; stragglers are killed at teardown."""
    started = []

    def start(target, *args):
        proc, conn = spawn(target, *args)
        started.append((proc, conn))
        return proc, conn

    yield start
    for proc, conn in started:
        if proc.is_alive():
            proc.kill()
        proc.join(WAIT)
        conn.close()


@pytest.fixture
def events():
    """``events()`` -> a fresh spawn-context Event (shareable with children)."""
    return SPAWN.Event


@pytest.fixture
def native():
    """The compiled gather module; a failure where it was not built, a skip under ``CACHESTORE_NATIVE=0``."""
    if os.environ.get("CACHESTORE_NATIVE") == "0":
        pytest.skip("CACHESTORE_NATIVE=0 turns the compiled gather off")
    if native_module.NATIVE is None:
        pytest.fail("cachestore.format._gather is not built: `pip install -e .` builds it with the machine's C "
                    "compiler (reads fall back to the pure-Python gather without it)")
    return native_module.NATIVE


@pytest.fixture(params=["compiled", "python"])
def gather(request, monkeypatch) -> str:
    """Run the test with the compiled verified gather, then with the pure-Python one."""
    if request.param == "python":
        monkeypatch.setattr(native_module, "NATIVE", None)
    else:
        request.getfixturevalue("native")
    return request.param
