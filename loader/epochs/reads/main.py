"""Read epochs gathered by the training process itself, batch by batch as the loop asks.

The path without a hand-off: no task, no slot, no thread. A batch is gathered
into new arrays: the allocator hands back the memory of the batch before last,
and private memory (huge pages) is faster to write than a reused shared-memory
slot (4 KiB pages). For small samples it is the cheapest path (the hand-off
from workers costs more than the gather; ``loader/epochs/reads/placement.py``).
"""

from __future__ import annotations

from typing import Iterator

from ...dataset import Batch
from ...errors import SampleError
from ..inline import dataset_error
from ..plan import EpochStats, ReadPlan
from .base import LocalReads


class MainReads(LocalReads):
    """Batches gathered by the training process with its reader (see the module docstring)."""

    name = "main"

    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        try:
            for positions in list(plan.batches):
                batch = self.producer.read(self.task(plan, positions), self.reader)
                stats.read += len(positions)
                stats.batches += 1
                stats.samples += len(positions)
                yield batch
        except SampleError as exc:  # a recomputed miss: the dataset's own exception, raised here
            raise dataset_error(exc, plan.epoch) from None
