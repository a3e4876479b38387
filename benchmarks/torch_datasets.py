"""A dataset whose module imports torch, as most training code's does (importable by module path).

Kept apart from :mod:`benchmarks.datasets` so the other scenarios' workers do not import torch.
"""

from __future__ import annotations

import torch  # noqa: F401  what a spawned worker imports with the dataset's module

from .datasets import ExpensiveDataset


class TorchModuleDataset(ExpensiveDataset):
    """:class:`~benchmarks.datasets.ExpensiveDataset` defined in a module that imports torch."""
