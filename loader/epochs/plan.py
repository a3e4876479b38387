"""What an epoch does (:class:`EpochPlan`) and what it did (:class:`EpochStats`).

The runner decides the plan (:mod:`loader.epochs.runner`); the scheduler
(:mod:`loader.epochs.scheduler`), the inline path (:mod:`loader.epochs.inline`)
and the rotation epochs carry it out and count into the stats.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable

import numpy as np

from ..settings import EpochMode
from .order import BlockOrder, Redraw


@dataclass
class EpochPlan:
    """What one epoch does.

    ``mode``: ``COMPUTE`` (dataset only), ``GENERATE`` (dataset, written into
    ``generation``), ``READ`` (served from committed ``generation``),
    ``ROTATE`` (see :mod:`loader.epochs.rotation`). ``batches`` hold store
    positions; ``indices`` maps a position to the dataset index.
    ``unserved`` batches are computed and written after the served ones but
    never delivered: samples a generation needs that this epoch does not serve
    (the remainder ``drop_last`` drops, the batches served before a resume).
    """

    epoch: int
    mode: EpochMode
    generation: int | None
    batches: Iterable[np.ndarray]
    indices: np.ndarray
    unserved: list[np.ndarray] = field(default_factory=list)
    skip: int = 0  # rotation: batches of the schedule already served before a resume
    notes: dict = field(default_factory=dict)  # why the plan is what it is (for EpochStats.extra)
    # A sampler's generate epoch: the batches that draw indices again (loader.epochs.order.Redraw), and
    # the positions it never draws (idle workers fill them in).
    repeats: dict[int, Redraw] = field(default_factory=dict)
    fill: np.ndarray | None = None
    transform_seed: int | None = None  # the run's seed when served samples go through read_transform
    # A read epoch: its order ("random" or "block", with the blocks' shape), and whether it reads with
    # explicit I/O (the generation does not fit the memory room: loader.epochs.reads.streamed).
    read_order: str | None = None
    # When the generation read was committed: a generation removed and written again under the same
    # id is another one, and readers kept open from epoch to epoch must not serve the old files.
    committed_at: float | None = None
    blocks: BlockOrder | None = None
    stream: bool = False


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
