"""Messages between the training process and its workers: small frozen dataclasses.

Everything bulky (batch bytes) travels through shared-memory slots; these
only say where it is. :data:`Command` is what the training process sends,
:data:`Message` what comes back.
"""

from __future__ import annotations

import pickle
import traceback
from dataclasses import dataclass, field
from typing import Any, Literal, TypeAlias, Union

import numpy as np

from cachestore import ShardSpec, StoreSpec
from cachestore.format.codec import LeafSpec, TreeDef

from ..dataset import Batch, CollateFn, DatasetSource, ReadTransform, WorkerInitFn

__all__ = ["BACKGROUND_EPOCH", "Batch", "BatchDone", "Command", "FailureKind", "FlushShard", "Message", "ReadSource",
           "Ready", "Record", "RetireSlots", "ShardFlushed", "SlotBatch", "Stop", "StreamBegin", "StreamEnd",
           "StreamItems", "StreamNext", "Task", "TaskFailed", "WorkerConfig", "WritePart"]
from ..errors import WorkerError, add_note
from ..settings import BudgetPolicy, EpochMode
from .transport import Portable


#: Where a task failed: in the dataset, in read_transform, building the worker's dataset, over the
#: budget, in the store.
FailureKind = Literal["dataset", "read_transform", "init", "budget", "store"]

#: Epoch number carried by background-refresh tasks (never a real epoch).
BACKGROUND_EPOCH = -2


@dataclass(frozen=True)
class WorkerConfig:
    """What a worker needs to build its dataset and run tasks."""

    worker_id: int
    shard_id: str  # unique per worker incarnation: names its shard in each generation
    dataset: Portable[DatasetSource]  # see loader.executors.transport: by value where pickle cannot name it
    collate_fn: Portable[CollateFn] | None
    gpu_index: int | None
    allow_pickle: bool
    worker_init_fn: Portable[WorkerInitFn] | None = None
    read_transform: Portable[ReadTransform] | None = None
    seed: int | None = None  # a worker process's global generators are seeded from (seed, worker_id)
    num_workers: int = 1  # the executor's workers (torch's WorkerInfo.num_workers)
    #: torchrun's variables of the training process (RANK, ...): a worker that does not inherit its
    #: environment (a Ray actor) sets them, so that a stream finds its rank as in a worker process.
    env: tuple[tuple[str, str], ...] = ()


#: A committed generation to read: the store's address, the generation id, and when it was committed
#: (``None``: not known; a generation removed and written again under the same id is another one).
ReadSource: TypeAlias = tuple[StoreSpec, int, "float | None"]
#: A sample encoded for the training process to write: ``(position, record bytes)``.
Record: TypeAlias = tuple[int, bytes]


@dataclass(frozen=True)
class SlotBatch:
    """Where a batch lies in its shared-memory slot, and how to rebuild it there.

    ``stacked``: `treedef` is one sample's and every leaf is stacked along a
    first axis (a gather from the store), as :func:`cachestore.format.codec.unflatten_batch`
    rebuilds it; otherwise `treedef` is the batch's own.
    """

    treedef: TreeDef
    specs: list[LeafSpec]
    offsets: list[int]
    total: int  # bytes used
    name: str  # the slot's name (it may have grown in place: see `size`)
    size: int  # the slot's size now
    stacked: bool = False


@dataclass(frozen=True)
class WritePart:
    """Where a generate task writes its samples, and which of them the generation holds already."""

    shard: ShardSpec | None  # the generation's shards; None: send each sample back as a record instead
    on_budget: BudgetPolicy = BudgetPolicy.ERROR
    present: np.ndarray | None = None  # per sample, already in the generation: read it back, never rewrite


@dataclass(frozen=True)
class Task:
    """Produce one batch (or one minibatch `part` of it) into `slot`.

    What it does follows from its parts (:attr:`mode`): with `write` it
    computes each sample and writes it into the generation (``GENERATE``);
    with `reader` it gathers the samples from that committed generation
    (``READ``); with neither it only calls the dataset (``COMPUTE``).
    """

    seq: int
    part: int
    epoch: int
    indices: np.ndarray
    positions: np.ndarray | None = None  # store index of each sample, when it differs from the dataset index
    slot: int = -1
    slot_name: str = ""
    slot_size: int = 0
    write: WritePart | None = None
    reader: ReadSource | None = None
    collate: bool = True  # False: the batch is the list of samples (rotation stores them one by one)
    # The run's seed when the samples are served and go through read_transform (None: they are not:
    # a background chunk, rotation's fresh samples, which the training process transforms per serve).
    transform_seed: int | None = None
    # `indices` is one list a sampler yielded (batch_size=None): dataset[indices] computes the batch whole.
    keys: bool = False
    # The run's seed where the batch's random draws are seeded from (seed, epoch, indices)
    # (loader.executors.seeds: a dataset whose randomness is part of its state).
    draws_seed: int | None = None

    @property
    def mode(self) -> EpochMode:
        """What the task does (see the class docstring)."""
        if self.write is not None:
            return EpochMode.GENERATE
        return EpochMode.READ if self.reader is not None else EpochMode.COMPUTE

    @property
    def shard(self) -> ShardSpec | None:
        """The shards a generate task writes into (``None``: it sends records, or writes nothing)."""
        return self.write.shard if self.write is not None else None

    @property
    def send_records(self) -> bool:
        """A generate task whose worker cannot write the store sends its samples back as records."""
        return self.write is not None and self.write.shard is None

    @property
    def on_budget(self) -> BudgetPolicy:
        return self.write.on_budget if self.write is not None else BudgetPolicy.ERROR

    @property
    def present(self) -> np.ndarray | None:
        """Per sample, whether the generation holds it already (read back, never written again)."""
        return self.write.present if self.write is not None else None

    @property
    def stored_at(self) -> np.ndarray:
        """The store index of each sample (its position in the generation)."""
        return self.positions if self.positions is not None else self.indices


@dataclass(frozen=True)
class FlushShard:
    """Close the current shard writer (its data is then complete on disk)."""


@dataclass(frozen=True)
class RetireSlots:
    """Close these shared-memory slots (by name): the training process retired them.

    A worker's mapping keeps a slot's pages alive, so every worker gets this
    (see "Shrinking" in :mod:`loader.executors.process.slots`); names it never mapped are ignored.
    """

    names: tuple[str, ...]


@dataclass(frozen=True)
class Stop:
    """Exit the worker loop."""


@dataclass(frozen=True)
class StreamBegin:
    """Start run `tag` of the worker's copy of a stream (a stream is fetched by copy, not by index: each
    worker iterates its own, ``docs/ARCHITECTURE.md``, "Streams"): a new iterator, from position `state`
    when given (:func:`loader.executors.positions.iterate_from`); batches of `batch_size` samples, a short
    last one dropped with `drop_last`, collated when `collate`; a datapipe sharded by `world` (torch's
    ``(world size, rank)``) at the first run and its random pipes seeded from `pipe_seed` (alike in every
    worker); a worker process's global generators reseeded from ``(reseed, worker_id)`` when given."""

    tag: int
    collate: bool
    batch_size: int
    drop_last: bool
    world: tuple[int, int] = (1, 0)
    pipe_seed: int | None = None
    state: Any = None
    reseed: int | None = None


@dataclass(frozen=True)
class StreamNext:
    """The next batch of run `tag` of the worker's stream copy (answered only while `tag` is its run)."""

    tag: int


@dataclass(frozen=True)
class StreamItems:
    """A batch of `count` samples of run `tag`: collated, or the list of samples; the copy's position
    after it (a stateful stream's, :func:`loader.executors.positions.position`)."""

    tag: int
    worker_id: int
    count: int
    items: Any
    state: Any = None


@dataclass(frozen=True)
class StreamEnd:
    """The worker's copy ran out in run `tag`, leaving its dataset at `state` (without the spent iterator's)."""

    tag: int
    worker_id: int
    state: Any = None


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
    meta: SlotBatch | None  # None when `batch` is carried inline
    batch: Batch = None
    shard_id: str = ""  # the worker incarnation's shard, which `written` counts into
    written: int = 0
    staged: int = 0  # samples read back from the generation being written instead of computed
    waited: int = 0  # of those, samples another process was computing when the task needed them
    records: list[Record] | None = None
    budget_error: str | None = None


@dataclass(frozen=True)
class TaskFailed:
    """An exception in a worker, carried to the training process to be re-raised there.

    The training process re-raises the dataset's own exception - same class,
    same ``args``, same attributes - so ``except LabelError`` works with and
    without workers; where it happened and the worker's traceback are added
    as notes (:pep:`678`), which print as real lines under the message.
    """

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
    extra: dict[str, object] = field(default_factory=dict)  # attributes set on the re-raised exception
    instance: bytes | None = None  # the pickled exception, when it pickles
    args: bytes | None = None  # its pickled ``args``, when they pickle
    state: bytes | None = None  # the picklable part of its ``__dict__``

    @classmethod
    def from_exception(cls, exc: BaseException, *, epoch: int, seq: int, part: int, worker_id: int,
                       index: int | None, kind: FailureKind) -> "TaskFailed":
        return cls(epoch=epoch, seq=seq, part=part, worker_id=worker_id, index=index,
                   exc_type=_dumps(type(exc)), type_name=f"{type(exc).__module__}.{type(exc).__qualname__}",
                   message=str(exc),
                   traceback="".join(traceback.format_exception(type(exc), exc, exc.__traceback__)), kind=kind,
                   instance=_dumps(exc), args=_dumps(exc.args),
                   state=_dumps({k: v for k, v in getattr(exc, "__dict__", {}).items() if _dumps(v) is not None}))

    def where(self, pid: int | None = None, epoch: int | None = None) -> str:
        """Where the exception was raised, as a sentence."""
        who = f"loader worker {self.worker_id}" + (f" (pid {pid})" if pid else "")
        if self.kind == "init":
            return f"Raised in {who} while building its dataset."
        if self.index is None:
            what = "while producing a batch"
        elif self.kind == "read_transform":
            what = f"while applying read_transform to sample {self.index}"
        else:
            what = f"while computing sample {self.index}"
        if epoch is not None:
            what += f" of epoch {epoch}"
        return f"Raised in {who} {what}."

    def exception(self, pid: int | None = None, epoch: int | None = None) -> BaseException:
        """The exception to raise in the training process: the original one, rebuilt, with notes.

        Falls back to :class:`~loader.errors.WorkerError` only when the
        exception's class cannot be imported here.
        """
        exc = self._rebuild()
        where = self.where(pid, epoch)
        if exc is None:
            exc = WorkerError(f"{self.type_name}: {self.message}\n({where} Its class cannot be imported in the "
                              "training process, so it is re-raised as WorkerError.)")
        if self.kind in ("budget", "store"):
            add_note(exc, where)  # the store's message says what to do; the worker's stack adds nothing
        else:
            add_note(exc, f"{where} Worker traceback:\n{self.traceback.rstrip()}")
        attributes = {**self.extra, "sample_index": self.index, "worker_id": self.worker_id, "worker_pid": pid,
                      "worker_traceback": self.traceback}
        for name, value in attributes.items():
            try:
                setattr(exc, name, value)
            except (AttributeError, TypeError):
                pass  # a class with __slots__: the notes carry the same
        return exc

    def _rebuild(self) -> BaseException | None:
        """The worker's exception, or ``None`` when its class is not importable here.

        Unpickling calls ``cls(*args)``, which fails (or worse, builds a different
        message) when the constructor takes other arguments than it passes to
        ``Exception.__init__`` - ``LabelError(index, path)``. So the unpickled
        instance is kept only when its ``args`` are the worker's; otherwise the
        instance is rebuilt without calling ``__init__``: ``cls.__new__(cls)``,
        then the worker's ``args`` and ``__dict__``.
        """
        exc_type = _loads(self.exc_type)
        if not (isinstance(exc_type, type) and issubclass(exc_type, BaseException)):
            return None
        exc = _loads(self.instance)
        if type(exc) is exc_type and self.args is not None and _dumps(exc.args) == self.args:
            return exc
        try:
            exc = exc_type.__new__(exc_type)
        except Exception:
            return None
        args = _loads(self.args)
        exc.args = args if isinstance(args, tuple) else (self.message,)
        state = _loads(self.state)
        if isinstance(state, dict):
            try:
                exc.__dict__.update(state)
            except AttributeError:
                pass  # no __dict__ (slots): args are what we can give back
        return exc


def _dumps(obj: object) -> bytes | None:
    try:
        return pickle.dumps(obj)
    except Exception:
        return None


def _loads(data: bytes | None) -> object:
    if data is None:
        return None
    try:
        return pickle.loads(data)
    except Exception:
        return None


#: What the training process sends a worker.
Command: TypeAlias = Union[Task, FlushShard, RetireSlots, Stop, StreamBegin, StreamNext]
#: What a worker (or an executor on its behalf) sends back.
Message: TypeAlias = Union[Ready, BatchDone, TaskFailed, ShardFlushed, StreamItems, StreamEnd]
