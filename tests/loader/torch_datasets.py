"""A dataset whose module imports torch, as most do: what a worker imports when it builds it shows."""

from __future__ import annotations

import os

import torch  # noqa: F401  the import whose cost a worker that only reads must not pay

from .datasets import ArangeDataset


class TorchArange(ArangeDataset):
    """:class:`ArangeDataset` that leaves a ``built-<pid>`` file in `counter_dir` each time it is built."""

    def __init__(self, n: int = 100, counter_dir: str | None = None) -> None:
        super().__init__(n, counter_dir=counter_dir)
        if counter_dir:
            open(os.path.join(counter_dir, f"built-{os.getpid()}"), "a").close()


class FailsInWorkers(ArangeDataset):
    """Builds in the process whose pid is `home` (the training process), and fails in every other."""

    def __init__(self, n: int = 10, home: int = 0) -> None:
        super().__init__(n)
        if os.getpid() != home:
            raise OSError("this machine's dataset files are not mounted in the worker")
