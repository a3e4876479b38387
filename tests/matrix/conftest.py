"""The matrix's fixtures: the remote tests' SeaweedFS server, and a Ray cluster for the cells that need one."""

from __future__ import annotations

import os
import sys
from typing import Iterator

import pytest

from tests.remote.conftest import remote_url, s3_env, weed  # noqa: F401 (fixtures)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """One pytest process runs the matrix under pytest-xdist: one server, one Ray cluster."""
    for item in items:
        if "tests/matrix" in str(item.path):
            item.add_marker(pytest.mark.xdist_group("matrix"))


@pytest.fixture(scope="package")
def ray_address() -> Iterator[str]:
    """A one-node Ray cluster on 127.0.0.1 (stopped with ``cluster.shutdown()``)."""
    os.environ.update({"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"})
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # Actors import the matrix's datasets by module path; Ray's worker processes inherit this.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        # On a loaded machine a worker process may take longer than Ray's default to register, and the
        # raylet then kills it and starts another, which can keep an actor from starting within start_timeout.
        mp.setenv("RAY_worker_register_timeout_seconds", "600")
        cluster = Cluster(initialize_head=True, head_node_args={
            "node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20, "include_dashboard": False,
            "num_cpus": 8})  # logical: two ranks, their actors, the last phase's ending
        try:
            yield str(cluster.address)
        finally:
            cluster.shutdown()
    assert "ray" in sys.modules
