"""The seam between the loader and whatever computes its tasks.

An :class:`Executor` runs :class:`~loader.executors.messages.Task` objects
somewhere (worker processes and threads: :mod:`loader.executors.process.pool`;
Ray actors: :mod:`loader.executors.ray`) and hands back their results as
:data:`~loader.executors.messages.Message` s. The epoch runners only submit,
receive, flush and close; replacing a dead worker and re-running its tasks is
the executor's own business, reported to listeners (a
:class:`~loader.cache.build.GenerationBuild` drops what the dead worker wrote).
See ``docs/ARCHITECTURE.md``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

from ..dataset import CollateFn, DatasetSource, ReadTransform, WorkerInitFn
from ..errors import NotImportableError, WorkerTimeoutError
from .messages import Command, Message, Task, WorkerConfig
from .transport import Portable, PortablePart

#: What torchrun tells each rank (torch.distributed's environment): workers see the training process's.
TORCHRUN_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "GROUP_RANK", "GROUP_WORLD_SIZE",
                      "ROLE_RANK", "ROLE_WORLD_SIZE", "TORCHELASTIC_RUN_ID", "MASTER_ADDR", "MASTER_PORT")
#: Called with the shard id of a worker incarnation that died.
DeathListener = Callable[[str], None]


@dataclass(frozen=True)
class StuckWorker:
    """A worker holding a task that is late: what it runs now, and its Python stack."""

    worker_id: int
    pid: int | None
    running: Task | None  # the task it is computing now (not necessarily the late one)
    stack: str  # its Python stack at this moment, or why it could not be taken


class Executor(Protocol):
    """What the epoch runners need from the workers (see the module docstring)."""

    #: Number of workers (tasks that can run at once).
    nb_worker: int
    #: Whether workers can write into this machine's store (else they send records to the training process).
    writes_local_store: bool

    def submit(self, task: Task) -> None:
        """Queue `task` on some worker."""

    def send_to(self, worker_id: int, msg: Command) -> None:
        """Send `msg` to worker `worker_id` itself (a command to its copy of a stream)."""

    def next_message(self, timeout: float | None = None) -> Message | None:
        """The next result or failure from any worker, ``None`` after `timeout` seconds.

        Dead workers are replaced (and their unfinished tasks re-run) while waiting.
        """

    def flush_shards(self) -> list[str]:
        """Ask every worker to close its shard of the generation being written; return their errors."""

    def begin_epoch(self) -> None:
        """Start counting worker deaths anew (``max_worker_restarts`` is per epoch)."""

    def start_flush(self) -> None:
        """Ask every worker to close its shard without waiting; each answers with ``ShardFlushed``."""

    def retire_slots(self, names: Sequence[str]) -> None:
        """Have every worker close its mapping of the shared-memory slots `names` (see :mod:`loader.executors.process.slots`)."""

    def add_death_listener(self, listener: DeathListener) -> None:
        """Call `listener(shard_id)` when a worker dies."""

    def remove_death_listener(self, listener: DeathListener) -> None:
        """Stop calling `listener`."""

    def worker_pid(self, worker_id: int) -> int | None:
        """Pid of worker `worker_id` (for messages)."""

    def pids(self) -> list[int]:
        """Pids of the live worker processes."""

    def idle_workers(self) -> int:
        """Workers with no task queued or running."""

    def stuck_workers(self, tasks: set[tuple[int, int, int]]) -> list[StuckWorker]:
        """The workers holding any of `tasks` (``(epoch, seq, part)``), with their stacks now."""

    def shutdown(self) -> None:
        """Stop every worker and wait for them (idempotent)."""

    def kill(self) -> None:
        """Stop every worker now, without waiting for running tasks (errors, abandoned epochs)."""


class DeathListeners:
    """The death-listener part of an :class:`Executor`, shared by the implementations."""

    def __init__(self) -> None:
        self._listeners: list[DeathListener] = []

    def add_death_listener(self, listener: DeathListener) -> None:
        self._listeners.append(listener)

    def remove_death_listener(self, listener: DeathListener) -> None:
        if listener in self._listeners:
            self._listeners.remove(listener)

    def notify_death(self, shard_id: str) -> None:
        """Tell every listener that the worker incarnation writing `shard_id` died."""
        for listener in list(self._listeners):
            listener(shard_id)


class WorkerConfigFactory:
    """Builds each worker incarnation's config, with a fresh shard id every time.

    A new incarnation writes a new shard, so what a dead one wrote can be told
    apart from what its replacement writes.
    """

    def __init__(self, dataset: DatasetSource, collate_fn: CollateFn | None, gpu_indices: Sequence[int] | None,
                 allow_pickle: bool, worker_init_fn: WorkerInitFn | None = None,
                 read_transform: ReadTransform | None = None, seed: int | None = None, num_workers: int = 1) -> None:
        # Serialised once for every worker incarnation (see loader.executors.transport).
        self.dataset: Portable[DatasetSource] = Portable(dataset, "dataset")
        self.worker_init_fn: Portable[WorkerInitFn] | None = None
        if worker_init_fn is not None:
            # One pickle: a worker_init_fn bound to the dataset (or holding it) changes the worker's copy.
            self._alone = (self.dataset, Portable(worker_init_fn, "worker_init_fn"))
            together: Portable[tuple[object, ...]] = Portable((dataset, worker_init_fn), "dataset")
            self.dataset = PortablePart(together, 0, "dataset")
            self.worker_init_fn = PortablePart(together, 1, "worker_init_fn")
        self.collate_fn = Portable(collate_fn, "collate_fn") if collate_fn is not None else None
        self.read_transform = Portable(read_transform, "read_transform") if read_transform is not None else None
        self.gpu_indices = gpu_indices
        self.allow_pickle = allow_pickle
        self.seed = seed
        self.num_workers = num_workers
        self.incarnations = 0

    def check_sendable(self) -> None:
        """Serialise what the workers receive now, before any starts (see :mod:`loader.executors.transport`).

        Raises
        ------
        NotImportableError
            Something cannot be sent; the message names it.
        """
        if self.worker_init_fn is not None:
            try:
                self.dataset.payload()
            except NotImportableError:
                for alone in self._alone:  # the message names the dataset's or the function's part at fault
                    alone.payload()
                raise
        for portable in (self.dataset, self.collate_fn, self.read_transform):
            if portable is not None:
                portable.payload()

    def forget_payloads(self) -> None:
        """Drop the bytes :meth:`check_sendable` made, while workers fork (a spawn makes them again)."""
        for portable in (self.dataset, self.collate_fn, self.read_transform):
            if portable is not None:
                portable.forget_payload()

    def __call__(self, wid: int) -> WorkerConfig:
        self.incarnations += 1
        return WorkerConfig(worker_id=wid, shard_id=f"w{wid}-i{self.incarnations}", dataset=self.dataset,
                            collate_fn=self.collate_fn,
                            gpu_index=self.gpu_indices[wid] if self.gpu_indices else None,
                            allow_pickle=self.allow_pickle, worker_init_fn=self.worker_init_fn,
                            read_transform=self.read_transform, seed=self.seed, num_workers=self.num_workers,
                            env=tuple((k, os.environ[k]) for k in TORCHRUN_VARIABLES if k in os.environ))


def late_work_report(executor: Executor, tasks: set[tuple[int, int, int]], what: str,
                     waited: float) -> tuple[str, list[StuckWorker]]:
    """Who holds late `tasks` (``(epoch, seq, part)``) and what they run now, in words."""
    stuck = executor.stuck_workers(tasks)
    lines = [f"{what} has not arrived after {waited:.1f} s"]
    for w in stuck:
        running = w.running.indices.tolist() if w.running is not None else []
        lines.append(f"worker {w.worker_id} (pid {w.pid}) is computing dataset indices {running}; "
                     f"its Python stack:\n{w.stack.rstrip()}")
    if not stuck:
        lines.append("no worker holds it")
    return "\n".join(lines), stuck


def worker_timeout(executor: Executor, tasks: set[tuple[int, int, int]], what: str, timeout: float,
                   waited: float) -> WorkerTimeoutError:
    """The error for late `tasks`: the indices, pid and Python stack of the (first) stuck worker."""
    text, stuck = late_work_report(executor, tasks, what, waited)
    # torch's words first: code written for torch's DataLoader matches them.
    exc = WorkerTimeoutError(f"DataLoader timed out after {timeout:g} seconds (timeout={timeout:g}): {text}")
    if stuck:
        first = stuck[0]
        exc.pid, exc.stack = first.pid, first.stack
        exc.indices = first.running.indices.tolist() if first.running is not None else None
    return exc
