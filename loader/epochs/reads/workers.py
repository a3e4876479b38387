"""Read epochs gathered by the workers, each batch into a shared-memory slot.

The workers gather in parallel with the training loop; each batch then costs
the training process a hand-off (a message, a slot mapped as arrays, the
reorder), which for large samples is worth it. A background refresh needs
the workers' idle time, so a read epoch during one is always read here (its
chunks are scheduled between the batch tasks, :mod:`loader.cache.refresh`).
"""

from __future__ import annotations

from typing import Callable, Iterator

from ...dataset import Batch
from ..plan import EpochStats, ReadPlan
from ..scheduler import PoolRun, run_pool
from ..work import ReadWork
from .base import ReadPath


class WorkerReads(ReadPath):
    """Batches of a read epoch gathered by the executor's workers, as the run `make_run` returns
    says (at most `depth` batches in flight), from the generation `work` names.

    The run, and with it the workers, starts only when batches are asked for: a read epoch that
    gathers in the training process starts no worker (``docs/ARCHITECTURE.md``, "Memory with many
    workers")."""

    name = "workers"

    def __init__(self, make_run: Callable[[], PoolRun], depth: int, work: ReadWork) -> None:
        self.make_run = make_run
        self.depth = depth
        self.work = work
        self.warmup = depth  # the batches queued ahead of the loop at the start

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        run = self.make_run()
        run.max_in_flight = self.depth
        return run_pool(plan, run, stats, self.work)
