"""What the tasks of an epoch do, and how their results count: the part of a task its epoch's kind decides.

The scheduler (:mod:`loader.epochs.scheduler`) and the inline path
(:mod:`loader.epochs.inline`) build every task the same way; the epoch's
kind hands them one of these for the rest:

* :class:`ComputeWork`: the dataset computes the samples (a compute epoch,
  a rotation epoch's fresh samples) and, given a build, they are written into
  the generation (a generate epoch: its unserved batches and a sampler's
  repeated draws come with it);
* :class:`ReadWork`: the samples are gathered from a committed generation.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ..cache.build import GenerationBuild
from ..executors import messages as m
from .order import Redraw
from .plan import EpochStats


class ComputeWork:
    """Tasks that call the dataset; with `build`, they write each sample into its generation.

    Parameters
    ----------
    build
        The generation a generate epoch writes, ``None`` when nothing is written.
    unserved
        Batches computed and written after the served ones, never delivered.
    repeats
        By batch: the positions a sampler draws again (read back once batch ``after`` is in).
    """

    def __init__(self, build: GenerationBuild | None = None, unserved: list[np.ndarray] | None = None,
                 repeats: dict[int, Redraw] | None = None) -> None:
        self.build = build
        self.unserved = unserved or []
        self.repeats = repeats or {}

    def part(self, positions: np.ndarray, earlier: np.ndarray | None, here: bool = False) -> dict[str, Any]:
        """The fields of a task computing `positions` (`earlier`: those an earlier batch drew; `here`:
        the task runs in the training process, which writes its own shard)."""
        if self.build is None:
            return {}
        return {"write": self.build.write_part(positions, earlier, here)}

    def count(self, task: m.Task, msg: m.BatchDone, stats: EpochStats) -> None:
        """Count a delivered result into `stats` (and its samples into the generation)."""
        stats.computed += len(task.indices) - msg.staged
        stats.read += msg.staged
        stats.waited += msg.waited
        if self.build is not None:
            stats.written += self.build.accept(msg)


class ReadWork:
    """Tasks that gather their samples from the committed generation `source` names."""

    def __init__(self, source: m.ReadSource) -> None:
        self.source = source
        self.unserved: list[np.ndarray] = []  # a read epoch serves every batch it reads
        self.repeats: dict[int, Redraw] = {}

    def part(self, positions: np.ndarray, earlier: np.ndarray | None, here: bool = False) -> dict[str, Any]:
        return {"reader": self.source}

    def count(self, task: m.Task, msg: m.BatchDone, stats: EpochStats) -> None:
        stats.read += len(task.indices)


#: Either kind of work.
Work = ComputeWork | ReadWork
