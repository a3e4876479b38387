"""An epoch kind: what one epoch does, from its first batch to its end, as one object.

The runner (:mod:`loader.epochs.runner`) plans each epoch, picks its kind
once (:func:`loader.epochs.kinds.kind_of`) and serves what the kind's
:meth:`EpochKind.batches` yields: the kind alone decides how its batches come
(through the place that computes samples, :mod:`loader.epochs.places`, or a
read path, :mod:`loader.epochs.reads`) and what happens at its end or when it
is broken off. Its plan (:mod:`loader.epochs.plan`) holds its own fields.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Generic, Iterator, TypeVar

from ...dataset import Batch
from ..context import EpochContext
from ..places import ComputePlace
from ..plan import EpochPlan, EpochStats

P = TypeVar("P", bound=EpochPlan)


class EpochKind(ABC, Generic[P]):
    """One epoch of one kind (see the module docstring).

    Parameters
    ----------
    ctx
        The loader's parts (settings, cache, executor, read paths, ...).
    place
        Where the loader computes samples (in this process or by workers).
    plan
        What this epoch does.
    """

    #: Whether the epoch shows progress (``progress=True``): only epochs that compute samples do.
    shows_progress: ClassVar[bool] = False

    def __init__(self, ctx: EpochContext, place: ComputePlace, plan: P) -> None:
        self.ctx = ctx
        self.place = place
        self.plan = plan

    def total(self) -> int:
        """Samples the epoch serves (for its progress bar)."""
        return sum(len(b) for b in self.plan.batches)

    def begin(self, stats: EpochStats) -> None:
        """Before the first batch: what the epoch's stats say of its plan."""

    @abstractmethod
    def batches(self, stats: EpochStats) -> Iterator[Batch]:
        """The epoch's batches, in order, counted into `stats`; the epoch ends with the last one.

        A generator: closed early (the loop broke off), it tidies up in its ``finally``.
        """
