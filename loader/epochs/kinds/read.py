"""The read epoch: served from a committed generation, by the read path chosen for it.

Which path reads it (the training process, its threads, the workers, or
explicit I/O for a generation larger than memory) is chosen once, by
:meth:`loader.epochs.reads.paths.ReadPaths.choose`; the workers are offered
where they can read the store. A generation removed while it is read (a
``cachestore prune``, another run on the prefix) fails the epoch with a note
saying so; the next epoch reads a newer generation or writes it again.
"""

from __future__ import annotations

from typing import Iterator

from cachestore.errors import GenerationNotFoundError

from ...dataset import Batch
from ...errors import add_note
from ..plan import EpochStats, ReadPlan
from ..reads.base import ReadPath
from .base import EpochKind


class ReadEpoch(EpochKind[ReadPlan]):
    """An epoch read from the store (see the module docstring)."""

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
        plan = self.plan
        try:
            yield from self.path(stats).batches(plan, stats)
        except GenerationNotFoundError as exc:
            add_note(exc, f"Generation {plan.generation} was removed while epoch {plan.epoch} read it (by "
                          "`cachestore prune`, or by a run that committed a newer one on the same prefix); the "
                          "next epoch reads a newer generation or writes it again.")
            self.ctx.reads.drop_reader()
            raise
