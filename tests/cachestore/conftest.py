"""Fixtures of the store tests: one parametrised backend fixture, a store factory, child processes.

Every backend runs the same tests; a backend adds only its name to
``BACKENDS`` (and ``DISK_BACKENDS`` when it keeps its data in files that
other processes can open).
"""

from __future__ import annotations

import pytest

from cachestore import open_store

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
