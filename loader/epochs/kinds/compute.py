"""The compute epoch: samples from the dataset, served as computed, nothing written.

Without a cache (and without rotation), or after caching gave up
(``on_budget_exceeded="stream"``). The place that computes samples
(:mod:`loader.epochs.places`) does all of it.
"""

from __future__ import annotations

from typing import Iterator

from ...dataset import Batch
from ..plan import EpochPlan, EpochStats
from ..work import ComputeWork
from .base import EpochKind


class ComputeEpoch(EpochKind[EpochPlan]):
    """An epoch computed from the dataset (see the module docstring)."""

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        yield from self.place.batches(self.plan, stats, ComputeWork())
