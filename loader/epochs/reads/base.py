"""A read path: one way the batches of a read epoch come out of a committed generation.

One module per path, each a :class:`ReadPath`:

* :mod:`.main`: gathered by the training process as the loop asks (``"main"``);
* :mod:`.threads`: gathered by threads of the training process, ahead of the loop (``"threads"``);
* :mod:`.workers`: gathered by the workers into shared-memory slots (``"workers"``);
* :mod:`.streamed`: read with explicit I/O ahead of the loop, for a generation larger than
  memory (``"stream"``).

Which one an epoch takes is decided in one place,
:meth:`loader.epochs.reads.paths.ReadPaths.choose`; where several may read the
store, :mod:`.placement` times them and keeps the cheapest. Every path serves
the same batches: a corrupt record makes its batch a miss, computed from the
dataset (in the training process, or by the worker that met it).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Iterator

import numpy as np

from cachestore import CorruptSampleError, Reader

from ...dataset import Batch
from ...errors import SampleError
from ...executors import messages as m
from ...executors.producer import BatchProducer
from ..inline import dataset_error
from ..plan import EpochStats, ReadPlan


class ReadPath(ABC):
    """One way to read the batches of a read epoch (see the module docstring)."""

    #: What ``EpochStats.extra["gather"]`` says of an epoch read this way.
    name: ClassVar[str]
    #: Batches its queue takes to fill: not counted when the placement times it.
    warmup: int = 0

    @abstractmethod
    def batches(self, plan: ReadPlan, stats: EpochStats) -> Iterator[Batch]:
        """The batches of read epoch `plan`, in order, counted into `stats`."""


class LocalReads(ReadPath):
    """A read path of the training process itself (its own gather, its threads, its I/O threads):
    `reader` is its reader of the generation `source` names, `producer` computes a batch whose
    record is corrupt."""

    def __init__(self, producer: BatchProducer, reader: Reader, source: m.ReadSource) -> None:
        self.producer = producer
        self.reader = reader
        self.source = source

    def task(self, plan: ReadPlan, positions: np.ndarray) -> m.Task:
        """The task that reads `positions` of read epoch `plan`."""
        return m.Task(seq=0, part=0, epoch=plan.epoch, indices=plan.indices[positions], positions=positions,
                      reader=self.source, transform_seed=plan.transform_seed)

    def recompute(self, plan: ReadPlan, positions: np.ndarray, exc: CorruptSampleError) -> Batch:
        """A corrupt record: the batch from the dataset, in this process (it says so in the log)."""
        try:
            return self.producer.recompute(self.task(plan, positions), exc)
        except SampleError as err:  # the dataset's (or read_transform's) own exception
            raise dataset_error(err, plan.epoch) from None
