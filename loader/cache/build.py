"""One generation being written: the single owner of its life from open to commit or abort.

A :class:`GenerationBuild` holds the store's writer, decides where samples are
written (by the workers into their own shards, or here from records they
send), assembles the write part of every task, counts what each worker
incarnation wrote in results that were delivered, drops what a dead worker
wrote for results that never arrived, applies the budget policy, and finally
flushes, commits, aborts or keeps. The epoch runner and the background
refresh both compose it; nothing else touches a writer. See
``docs/ARCHITECTURE.md``.

A build whose epoch is broken off, fails or is closed is *kept*, not aborted:
its staging area stays as the partial generation, and the next build of the
same generation (this run's next epoch, or a later run with the same
fingerprint) adopts it. :attr:`GenerationBuild.have` says which positions it
already holds; tasks mark those ``present`` so workers read them back instead
of computing them, and never write them twice.
"""

from __future__ import annotations

import logging

import numpy as np

from cachestore import GenerationInfo, Writer
from cachestore.backends import ShardWriter
from cachestore.backends.base import Backend
from cachestore.errors import BudgetExceededError
from cachestore.format import codec
from cachestore.format.records import decode_record
from cachestore.write.shared import SharedWriter

from ..executors import messages as m
from ..executors.base import Executor
from ..settings import BudgetPolicy

log = logging.getLogger(__name__)

#: Shard id of samples written by the training process itself.
MAIN_SHARD = "main"


def workers_can_write(backend: Backend, use_threading: bool, executor: Executor | None = None) -> bool:
    """Whether workers write their own shards (else they send records to the training process).

    Processes can when the backend accepts several writers in several
    processes; threads share this process, so any file-based backend will do.
    Workers of an executor whose ``writes_local_store`` is false (Ray actors,
    perhaps on other machines) never can.
    """
    if executor is not None and not executor.writes_local_store:
        return False
    return backend.persistent if use_threading else backend.supports_multiprocess_write


class GenerationBuild:
    """Generation ``writer.generation`` while it is written (see the module docstring).

    Parameters
    ----------
    writer
        The open writer; the build commits or aborts it.
    policy
        What a budget overrun does (``"error"`` raises, the others stop writing).
    in_workers
        Workers write their shards themselves (:func:`workers_can_write`).
    """

    def __init__(self, writer: Writer, policy: BudgetPolicy, in_workers: bool) -> None:
        self.writer = writer
        self.shared = writer.shared
        self.generation = writer.generation
        self.policy = BudgetPolicy(policy)
        self.in_workers = in_workers
        self.spec = writer.shard_spec()
        self.failed: str | None = None  # why writing stopped (budget), else None
        self.written = 0
        # Positions already in the generation: adopted from an interrupted attempt.
        self.have = np.zeros(writer.num_samples or 0, dtype=bool)
        self.have[writer.present()] = True
        self.adopted = int(self.have.sum())
        if self.adopted:
            log.info("generation %d: %d of %d samples were written by %s; completing it", self.generation,
                     self.adopted, len(self.have),
                     "the processes writing it together" if self.shared else "an interrupted attempt")
        self._main_shard: ShardWriter | None = None
        self._written_by: dict[str, int] = {}  # shard id -> samples in delivered results
        self._executor: Executor | None = None
        self.epoch = -1  # the epoch that writes it (set when that epoch is broken off)
        self.made_room: list[int] = []  # older generations removed to make room for it (the budget)
        self.from_parts = False  # this node computes its part, the others come from the remote (loader.cache.remote)

    # state ---------------------------------------------------------------
    @property
    def active(self) -> bool:
        """Samples are still being written (no budget failure)."""
        return self.failed is None

    @property
    def open(self) -> bool:
        """Neither committed nor aborted yet."""
        return self.writer.state == "open"

    def attach(self, executor: Executor) -> None:
        """Follow `executor`'s worker deaths: what a dead worker wrote for lost results is dropped."""
        if self._executor is not executor:
            self.detach()
            self._executor = executor
            executor.add_death_listener(self.worker_lost)

    def detach(self) -> None:
        if self._executor is not None:
            self._executor.remove_death_listener(self.worker_lost)
            self._executor = None

    # tasks and results ----------------------------------------------------
    def complete(self) -> bool:
        """Whether every sample is in (on disk, results not delivered included); the writers must be stopped."""
        return self.active and self.open and len(self.writer.present()) == len(self.have)

    def missing(self, positions: np.ndarray) -> np.ndarray:
        """`positions` the generation does not hold yet."""
        return positions[~self.have[positions]] if self.adopted else positions

    def write_part(self, positions: np.ndarray | None = None, written: np.ndarray | None = None,
                   here: bool = False) -> m.WritePart | None:
        """The write part of a task computing samples of this generation (the one place it is built);
        ``None`` once writing stopped (the budget): the task then only computes.

        With `positions`, those already in the generation (adopted, or `written` by an
        earlier task of this epoch) are marked ``present``: read back, never written again.
        `here`: the task runs in the training process, which writes its own shard.
        """
        if not self.active:
            return None
        present = None
        if positions is not None and (self.adopted or written is not None):
            present = self.have[positions] if self.adopted else np.zeros(len(positions), dtype=bool)
            if written is not None:
                present = present | written
            if not present.any():
                present = None
        return m.WritePart(self.spec if self.in_workers or here else None, self.policy, present)

    def accept(self, msg: m.BatchDone) -> int:
        """Account for a delivered result; return the samples it added to the generation."""
        added = msg.written
        if msg.written:
            self._written_by[msg.shard_id] = self._written_by.get(msg.shard_id, 0) + msg.written
        if msg.records:
            added += self.put_records(msg.records)
        if msg.budget_error is not None:
            self.over_budget(msg.budget_error)
        self.written += added
        return added

    def count_inline(self, written: int) -> None:
        """Samples the training process wrote itself (``nb_worker=0``)."""
        self.written += written

    def put_records(self, records: list) -> int:
        """Write records sent by workers that cannot write themselves; return how many went in."""
        if not self.active:
            return 0
        if self._main_shard is None:
            self._main_shard = self.spec.open(MAIN_SHARD)
        for pos, record in records:
            try:
                # Records our own workers encoded: their pickled leaves are this run's.
                sample = codec.unflatten(*decode_record(record, copy=False), allow_pickle=True)
                self._main_shard.put(pos, sample)
            except BudgetExceededError as exc:
                self.over_budget(str(exc), exc)
                return 0
        return len(records)

    def over_budget(self, message: str, exc: BaseException | None = None) -> None:
        """The generation no longer fits: raise (policy ``"error"``) or stop writing it."""
        if self.policy is BudgetPolicy.ERROR:
            raise exc if exc is not None else BudgetExceededError(message)
        if self.failed is None and self.policy is BudgetPolicy.STREAM:
            log.warning("cache disabled, serving uncached samples from now on: %s", message)
        self.failed = message

    def worker_lost(self, shard_id: str) -> None:
        """A worker incarnation died: keep only what it wrote for results that were delivered."""
        if self.open and self.in_workers:
            self.writer.discard_shard_tail(shard_id, self._written_by.get(shard_id, 0))

    # end of life -----------------------------------------------------------
    def finish(self, executor: Executor | None) -> str | None:
        """Close every shard (workers' included); return why the generation cannot commit, or ``None``."""
        errors = executor.flush_shards() if executor is not None and self.in_workers else []
        if self._main_shard is not None:
            self._main_shard.close()
        if self.failed is not None:
            return self.failed
        return "; ".join(errors) or None

    def commit(self, extra: dict) -> GenerationInfo | None:
        """Publish the generation (after :meth:`finish`); ``None`` when it is written together with
        other processes and left to them, or committed by one (:class:`cachestore.write.shared.SharedWriter`)."""
        self.detach()
        return self.writer.commit(extra=extra)

    def abort(self) -> None:
        """Discard everything written, kept or not (idempotent)."""
        self.detach()
        if self.writer.state == "kept" and not self.shared:
            # Kept a moment ago (the workers were stopped first), then found not worth keeping.
            self.writer.backend.discard(self.writer.token)
        if isinstance(self.writer, SharedWriter):
            self.writer.drop()  # a complete area whose publish failed too: the last member out removes it
            return
        self.writer.abort()

    def keep(self) -> None:
        """Leave what was written as a partial generation for the next attempt (idempotent).

        Every writer must have stopped: the workers' shards closed (or the
        workers gone), results of abandoned tasks in.
        """
        self.detach()
        if not self.open:
            return
        try:
            if self._main_shard is not None:
                self._main_shard.close()
        except Exception as exc:  # what it could not flush is not part of the partial generation
            log.debug("closing the main shard of generation %d: %s", self.generation, exc)
        if not self.active:
            self.writer.abort()  # over the budget: a partial generation that cannot be completed
            return
        self.writer.keep()

