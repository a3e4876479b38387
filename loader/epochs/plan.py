"""What an epoch does (:class:`EpochPlan` and one subclass per kind) and what it did (:class:`EpochStats`).

The planner (:mod:`loader.epochs.planner`) makes the plan; the epoch's kind
(:mod:`loader.epochs.kinds`) carries it out and counts into the stats. The
base class holds what every kind needs; each kind's plan adds its own fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Iterable

import numpy as np

from ..settings import EpochMode
from .order import BlockOrder, Redraw

if TYPE_CHECKING:
    from ..executors.positions import StreamAt


@dataclass
class EpochPlan:
    """What one epoch does; this class itself: compute its samples from the dataset, write nothing.

    ``batches`` hold store positions; ``indices`` maps a position to the dataset
    index. ``generation`` is the one the epoch writes or reads (``None``: none).
    """

    mode: ClassVar[EpochMode] = EpochMode.COMPUTE
    epoch: int
    batches: Iterable[np.ndarray]
    indices: np.ndarray
    generation: int | None = None
    notes: dict = field(default_factory=dict)  # why the plan is what it is (for EpochStats.extra)
    transform_seed: int | None = None  # the run's seed when served samples go through read_transform
    draws_seed: int | None = None  # the run's seed when each batch's random draws are seeded (LoaderSettings)
    # Each batch is one list of indices a sampler yielded (batch_size=None): dataset[list] computes it whole.
    keys: bool = False
    # Batches (by their place in ``batches``) a resumed epoch served before its stop, out of order
    # (``in_order=False``): computed and written where the epoch writes, not served again.
    ahead: frozenset[int] = frozenset()


@dataclass
class GeneratePlan(EpochPlan):
    """Compute every sample of ``generation``, write it, serve it; commit at the end.

    ``unserved`` batches are computed and written after the served ones but
    never delivered: samples the generation needs that this epoch does not serve
    (the remainder ``drop_last`` drops, the batches served before a resume).
    A sampler's epoch draws some indices again (``repeats``, by batch: read back,
    never computed twice, :class:`loader.epochs.order.Redraw`) and never draws
    others (``fill``: idle workers compute them).
    """

    mode: ClassVar[EpochMode] = EpochMode.GENERATE
    unserved: list[np.ndarray] = field(default_factory=list)
    repeats: dict[int, Redraw] = field(default_factory=dict)
    fill: np.ndarray | None = None
    # The positions this consumer serves, in the epoch's order, and the batches of it served before a
    # resume: what a rotation window goes through instead when the budget has no room (`as_rotate`).
    order: np.ndarray | None = None
    order_skip: int = 0

    def as_compute(self) -> EpochPlan:
        """This epoch computed instead, writing nothing, in the same batches: the budget had no room and
        its policy gave caching up (``on_budget_exceeded="stream"``)."""
        return EpochPlan(self.epoch, self.batches, self.indices, None, dict(self.notes), self.transform_seed,
                         self.draws_seed, ahead=self.ahead)

    def as_rotate(self) -> RotatePlan:
        """This epoch served through a rotation window instead, over the same order: the budget had no
        room and its policy switched to rotation (``on_budget_exceeded="rotate"``)."""
        assert self.order is not None
        return RotatePlan(self.epoch, [], self.indices[self.order], None, dict(self.notes), self.transform_seed,
                          self.draws_seed, skip=self.order_skip)

    def as_read(self, committed_at: float, order: str) -> ReadPlan:
        """This epoch read instead, batch for batch: the processes writing the generation with this one
        committed it as it was opened (the batches it served before a resume stay served, and those
        served out of order (``ahead``) are left out, as a read plan leaves them)."""
        assert self.generation is not None
        batches = [b for k, b in enumerate(self.batches) if k not in self.ahead]
        return ReadPlan(self.epoch, batches, self.indices, self.generation, {**self.notes, "committed_meanwhile": True},
                        self.transform_seed, self.draws_seed, order=order, committed_at=committed_at)


@dataclass
class ReadPlan(EpochPlan):
    """Serve the epoch from committed ``generation``.

    ``order`` is the order it serves in, as its stats report it (``"random"``,
    ``"block"`` with ``blocks`` their shape, or what overrode both);
    ``committed_at`` says when the generation was committed: one removed and
    written again under the same id is another, and readers kept open from
    epoch to epoch must not serve the old files. ``stream``: the generation does
    not fit the memory room and is read with explicit I/O
    (:mod:`loader.epochs.reads.streamed`). ``remote``: read from the cache's
    remote directly (the local budget cannot hold the generation).
    """

    mode: ClassVar[EpochMode] = EpochMode.READ
    order: str = "random"
    committed_at: float | None = None
    blocks: BlockOrder | None = None
    stream: bool = False
    remote: bool = False


@dataclass
class RotatePlan(EpochPlan):
    """Serve ``R x N`` samples through a rotation window (:mod:`loader.epochs.rotation`).

    ``indices`` is the generation order (the i-th sample generated is dataset
    index ``indices[i]``); ``skip``: batches of the schedule served before a resume.
    """

    mode: ClassVar[EpochMode] = EpochMode.ROTATE
    skip: int = 0


@dataclass
class StreamPlan(EpochPlan):
    """Iterate a stream (an iterable dataset) once and serve what it yields, in torch's order.

    With ``generation`` (a cache with no committed generation for this epoch)
    every sample is written as it arrives, its index its arrival position, and
    the generation is committed at the end of the stream (or after ``limit``
    samples); the epoch is then a generate epoch. ``buffer`` > 0 serves the
    samples through a shuffle buffer of that many samples; ``skip``: batches
    served before a resume (the stream is iterated again up to there, unless
    ``resume`` says where a stateful stream's copies were: they go on from it).
    ``replay``: where a generate epoch iterates its copies again from their start
    (the samples are written again), the batches each copy gave before the resume,
    which are not served again: out of turn (``in_order=False``) the first
    ``skip`` batches to arrive are not those.
    """

    mode: ClassVar[EpochMode] = EpochMode.COMPUTE
    skip: int = 0
    buffer: int = 0
    limit: int | None = None
    seed: int = 0
    resume: StreamAt | None = None
    replay: tuple[int, ...] | None = None


@dataclass
class StreamGeneratePlan(StreamPlan):
    """A stream's generate epoch: :class:`StreamPlan` with ``generation`` written in arrival order."""

    mode: ClassVar[EpochMode] = EpochMode.GENERATE


@dataclass
class EpochStats:
    """What an epoch did; ``loader.epoch_stats`` keeps one per epoch."""

    epoch: int
    mode: EpochMode
    generation: int | None = None
    batches: int = 0
    samples: int = 0
    computed: int = 0  # dataset calls
    read: int = 0  # samples served from the store (or read back from the generation being written)
    waited: int = 0  # of those, samples another process was computing when this one needed them
    written: int = 0  # samples written into the store
    seconds: float = 0.0
    wait_seconds: float = 0.0  # time the training loop waited for data
    committed: bool = False
    extra: dict = field(default_factory=dict)
    # With in_order=False: the batches served so far, by their place in the plan's ``batches``, in the
    # order they were served (in order, they are 0, 1, 2, ...).
    positions: list[int] = field(default_factory=list)
