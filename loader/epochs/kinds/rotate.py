"""The rotation epoch: ``R x N`` samples served through a bounded window, each fresh sample served ``R`` times.

With ``rotation_setting``, or after ``on_budget_exceeded="rotate"`` switched
to a window that fits. The schedule and the window are
:mod:`loader.epochs.rotation`'s; the fresh samples come from the place that
computes samples (:mod:`loader.epochs.places`), ahead of the loop; a stream's are its next samples,
in arrival order (:func:`~loader.epochs.kinds.stream.stream_fresh`).
"""

from __future__ import annotations

from typing import Iterator

from cachestore.format.collate import stack_samples

from ...dataset import Batch
from ..plan import EpochStats, RotatePlan
from ..rotation import rotation_epoch
from .base import EpochKind
from .stream import stream_fresh


class RotateEpoch(EpochKind[RotatePlan]):
    """An epoch served through the rotation window (see the module docstring)."""

    shows_progress = True

    def total(self) -> int:
        rotation = self.ctx.state.rotation
        assert rotation is not None
        return len(self.plan.indices) * rotation.rotation

    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        ctx, plan = self.ctx, self.plan
        s, rotation, window = ctx.settings, ctx.state.rotation, ctx.res.window
        assert rotation is not None and window is not None
        fresh = stream_fresh(ctx, plan) if s.dataset.stream else self.place.fresh(plan, stats)
        yield from rotation_epoch(plan, stats, rotation.rotation, window, s.batch_size, s.drop_last, ctx.state.seed,
                                  fresh, s.collate_fn or stack_samples, s.read_transform)
