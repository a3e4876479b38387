"""Read epochs gathered by the workers, each batch into a shared-memory slot.

The workers gather in parallel with the training loop; each batch then costs
the training process a hand-off (a message, a slot mapped as arrays, the
reorder), which for large samples is worth it. A background refresh needs
the workers' idle time, so a read epoch during one is always read here (its
chunks are scheduled between the batch tasks, :mod:`loader.cache.refresh`).
"""

from __future__ import annotations

from typing import Iterator

from ...dataset import Batch
from ..plan import EpochStats, ReadPlan
from ..scheduler import PoolRun, run_pool
from ..work import ReadWork
from .base import ReadPath


class WorkerReads(ReadPath):
    """Batches of a read epoch gathered by the executor's workers, as `run` says, from the generation
    `work` names."""

    name = "workers"

    def __init__(self, run: PoolRun, work: ReadWork) -> None:
        self.run = run
        self.work = work
        self.warmup = run.max_in_flight  # the batches queued ahead of the loop at the start

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        return run_pool(plan, self.run, stats, self.work)
