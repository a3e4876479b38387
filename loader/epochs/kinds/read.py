"""The read epoch: served from a committed generation, by the read path chosen for it.

Which path reads it (the training process, its threads, the workers, or
explicit I/O for a generation larger than memory) is chosen once, by
:meth:`loader.epochs.reads.paths.ReadPaths.choose`; the workers are offered
where they can read the store. A generation removed while it is read is an event
the epoch handles: where another process committed a newer one (the ranks of a
node share its store, and one that ran ahead committed the next generation and
pruned this one), the rest of the epoch reads that one, as the planner would
have chosen it; where none is (a ``cachestore prune``), the epoch fails with a note
saying so, and the next epoch writes it again.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

from cachestore.errors import GenerationNotFoundError

from ...dataset import Batch
from ...errors import add_note
from ...settings import EpochMode
from ..plan import EpochStats, ReadPlan
from ..prepare import prepare
from ..reads.base import ReadPath
from .base import EpochKind


#: Generations an epoch moves on to when the one it reads is removed, before it gives up.
MOVES = 3


class ReadEpoch(EpochKind[ReadPlan]):
    """An epoch read from the store (see the module docstring)."""

    _served_before = 0  # batches served before the plan read now

    def begin(self, stats: EpochStats) -> None:
        stats.extra["read_order"] = self.plan.order

    def path(self, stats: EpochStats) -> ReadPath:
        """The read path this epoch takes."""
        store, plan = self.ctx.res.store, self.plan
        assert store is not None
        cache = self.ctx.cache
        if plan.remote and cache is not None and cache.remote is not None and cache.remote.remote is not None:
            # Too large for the local budget: read from the remote by the training process (one ranged
            # read per run of consecutive records, objects in parallel: the remote reader's own threads).
            return self.ctx.reads.remote(plan, stats, cache.remote.remote)
        return self.ctx.reads.choose(plan, stats, store, lambda: self.place.read_workers(plan, store))

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        self.plan = dataclasses.replace(self.plan, batches=list(self.plan.batches))  # its rest is taken below
        self._served_before = stats.batches
        for moves in range(MOVES + 1):
            plan = self.plan
            try:
                yield from self.path(stats).batches(plan, stats)
                return
            except GenerationNotFoundError as exc:
                self.ctx.reads.drop_reader()
                if moves == MOVES or not self._move_on(stats):
                    add_note(exc, f"Generation {plan.generation} was removed while epoch {plan.epoch} read it (by "
                                  "`cachestore prune`, or by a run that committed a newer one on the same prefix); "
                                  "the next epoch reads a newer generation or writes it again.")
                    raise

    def _move_on(self, stats: EpochStats) -> bool:
        """The epoch's generation is gone: whether the rest of the epoch now reads the generation the
        cache chooses for it (a newer one another process committed), in ``self.plan``."""
        plan, cache = self.plan, self.ctx.cache
        # Out of order, a state numbers the served batches in the plan's order: kept one plan per epoch.
        if cache is None or plan.remote or not self.ctx.settings.in_order:
            return False
        ready = prepare(cache, plan.epoch, fetch=False)
        generation, mode, notes = ready.choice.generation, ready.choice.mode, ready.choice.notes
        if mode is not EpochMode.READ:
            return False
        batches = list(plan.batches)
        rest = batches[stats.batches - self._served_before:]  # in order: the first ones were served
        info = ready.info(generation)
        self._served_before = stats.batches
        stats.generation = generation
        stats.extra.update(notes)
        stats.extra["removed_while_read"] = plan.generation
        self.plan = dataclasses.replace(plan, batches=rest, generation=generation, notes={**plan.notes, **notes},
                                        committed_at=info.created if info is not None else None)
        return True
