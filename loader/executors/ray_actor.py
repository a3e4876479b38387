"""The Ray actor of the Ray executor (:mod:`loader.executors.ray`): one worker, anywhere in a Ray cluster.

It runs the tasks a worker process runs (compute tasks; a read never leaves the training node) and
answers a stream's commands with its copy of the stream (:mod:`loader.executors.stream_copy`); every
result comes back as a message, and nothing in it raises to Ray but a death.
"""

from __future__ import annotations

import os
import sys

from ..errors import WorkerError
from ..settings import EpochMode
from . import messages as m
from .producer import BatchProducer, task_failure
from .seeds import seed_torch_only, seed_worker, worker_seed
from .stream_copy import StreamCopy
from .worker_info import WorkerIdentity


class RayWorker:
    """One Ray actor: builds the dataset from its config and runs compute tasks.

    Instantiated by Ray (``ray.remote(RayWorker)``) on whichever node offers
    the actor's resources. It runs one task at a time and returns every
    result as a message; nothing in it raises to Ray but a death.
    """

    def __init__(self, config: m.WorkerConfig) -> None:
        self.config = config
        self.failure: m.TaskFailed | None = None
        self.producer: BatchProducer | None = None
        self.copy: StreamCopy | None = None  # a stream's copy (loader.executors.stream_copy)
        os.environ.update(config.env)  # the rank a stream finds, as in a worker process (a dedicated process)
        try:
            had_torch = "torch" in sys.modules
            if config.seed is not None:
                seed_worker(config.seed, config.worker_id)
            dataset = config.dataset.load().build()
            if config.seed is not None and not had_torch and "torch" in sys.modules:
                seed_torch_only(config.seed, config.worker_id)  # imported by the dataset, just now
            collate_fn = config.collate_fn.load() if config.collate_fn is not None else None
            read_transform = config.read_transform.load() if config.read_transform is not None else None
            # torch's get_worker_info() in worker_init_fn and __getitem__, as in a worker process.
            WorkerIdentity(config.worker_id, config.num_workers,
                           worker_seed(config.seed, config.worker_id) if config.seed is not None else 0,
                           lambda: dataset, thread=False).install()
            if config.worker_init_fn is not None:
                config.worker_init_fn.load()(config.worker_id)
        except Exception as exc:
            # Reported by ready() and every run(), like a worker process's "init" failure.
            self.failure = m.TaskFailed.from_exception(exc, epoch=-1, seq=-1, part=-1, worker_id=config.worker_id,
                                                       index=None, kind="init")
        else:
            self.producer = BatchProducer(dataset, collate_fn, config.shard_id, config.allow_pickle,
                                          read_transform=read_transform)
            self.copy = StreamCopy(lambda: dataset, config.worker_id, config.num_workers, own_process=True)

    def ready(self) -> tuple[int, str, m.TaskFailed | None]:
        """Pid and Ray node id of this actor, and why its dataset could not be built (if so)."""
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id(), self.failure

    def stream(self, msg: m.StreamBegin | m.StreamNext) -> object | None:
        """The answer of this actor's copy of a stream to `msg` (``None``: none is due)."""
        if self.failure is not None:
            return self.failure if isinstance(msg, m.StreamNext) else None
        assert self.copy is not None and self.producer is not None
        return self.copy.handle(msg, self.producer.collate)

    def run(self, task: m.Task) -> m.BatchDone | m.TaskFailed:
        """Compute `task`; the batch (and the records of a generate task) travel in the answer."""
        wid = self.config.worker_id
        if self.failure is not None:
            return self.failure
        if task.shard is not None or task.mode == EpochMode.READ:
            # The store lives on the training node; an actor may not (see the module docstring).
            return task_failure(WorkerError("a Ray actor was asked to read or write the training node's store"),
                                task, wid)
        assert self.producer is not None  # else self.failure says why it could not be built
        try:
            out = self.producer.compute(task)
        except Exception as exc:
            return task_failure(exc, task, wid)
        # A task without a slot (background refresh) only sends its records: the batch is not needed.
        return m.BatchDone(task.epoch, task.seq, task.part, wid, None, batch=out.batch if task.slot >= 0 else None,
                           shard_id=self.config.shard_id, written=out.written, records=out.records,
                           budget_error=out.budget_error)
