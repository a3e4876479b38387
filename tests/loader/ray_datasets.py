"""Datasets the Ray tests build in Ray actors (importable by module path on every node)."""

from __future__ import annotations

import os

from .datasets import ArangeDataset


def ray_node() -> str:
    """The Ray node this process runs on ("no-ray" outside Ray)."""
    import ray

    return ray.get_runtime_context().get_node_id() if ray.is_initialized() else "no-ray"


class NodeRecordingDataset(ArangeDataset):
    """Records ``index node-id pid`` for every ``__getitem__`` call, one file per process under `node_dir`."""

    def __init__(self, node_dir: str, **kwargs) -> None:
        super().__init__(**kwargs)
        self.node_dir = node_dir

    def __getitem__(self, index: int) -> dict:
        with open(os.path.join(self.node_dir, f"nodes-{os.getpid()}.txt"), "a") as f:
            f.write(f"{index} {ray_node()} {os.getpid()}\n")
        return super().__getitem__(index)


def read_nodes(node_dir: str) -> list[tuple[int, str, int]]:
    """Every recorded call as ``(index, node id, pid)``."""
    calls = []
    for name in sorted(os.listdir(node_dir)):
        if name.startswith("nodes-"):
            with open(os.path.join(node_dir, name)) as f:
                for line in f:
                    index, node, pid = line.split()
                    calls.append((int(index), node, int(pid)))
    return calls
