"""Messages between the training process and its workers: small frozen dataclasses.

Everything bulky (batch bytes) travels through shared-memory slots; these
only say where it is.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

import numpy as np

from .errors import WorkerError
from .settings import BudgetPolicy, EpochMode


#: Where a task failed: in the dataset, building the worker's dataset, over the budget, in the store.
FailureKind = Literal["dataset", "init", "budget", "store"]

#: Epoch number carried by background-refresh tasks (never a real epoch).
BACKGROUND_EPOCH = -2


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to build its dataset and run tasks."""

    worker_id: int
    shard_id: str  # unique per worker incarnation: names its shard in each generation
    dataset_class: type
    dataset_params: dict
    collate_fn: Callable | None
    gpu_index: int | None
    allow_pickle: bool


@dataclass(frozen=True)
class Task:
    """Produce one batch (or one minibatch `part` of it) into `slot`.

    ``mode``: ``COMPUTE`` calls the dataset; ``GENERATE`` also writes each
    sample into the generation named by `shard` (or sends it back as a record,
    `send_records`); ``READ`` gathers the samples from the committed
    generation `reader` (``(StoreSpec, generation)``).
    """

    seq: int
    part: int
    epoch: int
    indices: np.ndarray
    mode: EpochMode
    slot: int = -1
    slot_name: str = ""
    slot_size: int = 0
    shard: Any = None
    on_budget: BudgetPolicy = BudgetPolicy.ERROR
    send_records: bool = False
    reader: tuple | None = None
    positions: np.ndarray | None = None  # store index of each sample, when it differs from the dataset index
    collate: bool = True  # False: the batch is the list of samples (rotation stores them one by one)


@dataclass(frozen=True)
class FlushShard:
    """Close the current shard writer (its data is then complete on disk)."""


@dataclass(frozen=True)
class Stop:
    """Exit the worker loop."""


@dataclass(frozen=True)
class Ready:
    worker_id: int
    pid: int
    stack_fd: int = -1  # fd (in the worker) of the file its Python stack is dumped into on SIGUSR1


@dataclass(frozen=True)
class ShardFlushed:
    worker_id: int
    error: str | None = None


@dataclass(frozen=True)
class BatchDone:
    epoch: int
    seq: int
    part: int
    worker_id: int
    meta: dict | None  # slot layout; None when `batch` is carried inline
    batch: Any = None
    shard_id: str = ""  # the worker incarnation's shard, which `written` counts into
    written: int = 0
    records: list | None = None
    budget_error: str | None = None
    budget_fits: int | None = None


@dataclass(frozen=True)
class TaskFailed:
    """An exception in a worker, carried to the training process to be re-raised there."""

    epoch: int
    seq: int
    part: int
    worker_id: int
    index: int | None
    exc_type: bytes | None  # the pickled class, when it pickles
    type_name: str
    message: str
    traceback: str
    kind: FailureKind = "dataset"
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_exception(cls, exc: BaseException, *, epoch: int, seq: int, part: int, worker_id: int,
                       index: int | None, kind: str) -> "TaskFailed":
        try:
            pickled: bytes | None = pickle.dumps(type(exc))
        except Exception:
            pickled = None
        return cls(epoch=epoch, seq=seq, part=part, worker_id=worker_id, index=index, exc_type=pickled,
                   type_name=f"{type(exc).__module__}.{type(exc).__qualname__}", message=str(exc),
                   traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), kind=kind)

    def exception(self, pid: int | None = None, epoch: int | None = None) -> BaseException:
        """The exception to raise in the training process: original type, worker traceback in the message."""
        exc_type: Any = None
        if self.exc_type is not None:
            try:
                exc_type = pickle.loads(self.exc_type)
            except Exception:
                exc_type = None
        if self.kind in ("budget", "store") and exc_type is not None:
            try:
                exc = exc_type(self.message)
                for name, value in self.extra.items():
                    setattr(exc, name, value)
                return exc
            except Exception:
                pass
        where = f"loader worker {self.worker_id}" + (f" (pid {pid})" if pid else "")
        if self.kind == "init":
            what = "while building its dataset"
        else:
            what = f"while computing sample {self.index}" if self.index is not None else "while producing a batch"
            if epoch is not None:
                what += f" of epoch {epoch}"
        text = (f"{self.type_name.rsplit('.', 1)[-1]}: {self.message}\n\n"
                f"Raised in {where} {what}. Worker traceback:\n{self.traceback}")
        if exc_type is not None and isinstance(exc_type, type) and issubclass(exc_type, BaseException):
            try:
                exc = exc_type(text)
                if isinstance(exc, BaseException):
                    return exc
            except Exception:
                pass
        return WorkerError(f"{self.type_name}: {text}")
