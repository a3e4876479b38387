"""What an epoch's plan is decided from: the store as one look found it, and the choice made from it.

Planning is pure (``docs/ARCHITECTURE.md``, "Epoch plan"): every read of the
store happens before it. The runner looks at the store
(:meth:`~loader.cache.controller.CacheController.look`: the catalog, the lock,
whether the file system went read-only), the controller decides from that look
alone (:meth:`~loader.cache.controller.CacheController.decide`), and where the
decision asks for a step (open a generation not opened yet, fetch one the
remote may hold, commit what a background refresh computed) the step is taken
and its outcome goes into a new look (:mod:`loader.epochs.prepare`). The
planner then makes the epoch's plan from the :class:`Prepared` result without
any I/O of its own.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Mapping

from cachestore import GenerationInfo

from ..settings import EpochMode
from .read_order import ReadChoice


@dataclass(frozen=True)
class StoreView:
    """The store as one look found it, with what the steps before the plan learnt since.

    Attributes
    ----------
    committed
        Committed generations by id.
    damaged
        Generations not committed that the catalog (or this run, on removing them) found damaged: why.
    read_only
        The store's file system is read-only (from the start, or remounted during the run).
    lock_holder
        The pid holding the store's writer lock (:data:`cachestore.guard.locking.SHARED_WRITERS` for
        processes writing together), ``None`` when nobody does.
    unreadable
        Committed generations that failed to open: why (the damage shows only there).
    fetched
        What a fetch from the remote gave, by generation: ``"fetched"`` (now committed here),
        ``"direct"`` (too large for the local budget: read from the remote) or ``"absent"``.
    choices
        How the read epochs of a generation go, for the generation the epoch reads.
    """

    committed: Mapping[int, GenerationInfo]
    damaged: Mapping[int, str] = field(default_factory=dict)
    read_only: bool = False
    lock_holder: int | None = None
    unreadable: Mapping[int, str] = field(default_factory=dict)
    fetched: Mapping[int, str] = field(default_factory=dict)
    choices: Mapping[int, ReadChoice] = field(default_factory=dict)

    @property
    def latest(self) -> int | None:
        """The newest committed generation, ``None`` for none."""
        return max(self.committed) if self.committed else None

    def learnt(self, *, unreadable: Mapping[int, str] | None = None, fetched: Mapping[int, str] | None = None,
               choices: Mapping[int, ReadChoice] | None = None) -> StoreView:
        """This view with what a step before the plan found added to what it knew."""
        return dataclasses.replace(self, unreadable={**self.unreadable, **(unreadable or {})},
                                   fetched={**self.fetched, **(fetched or {})},
                                   choices={**self.choices, **(choices or {})})


@dataclass(frozen=True)
class Choice:
    """The generation an epoch uses, and how (see :meth:`~loader.cache.controller.CacheController.decide`).

    Attributes
    ----------
    generation, mode, notes
        The generation, whether it is read or generated, and why (for the epoch's stats).
    base
        The plan's base once the choice is taken (another run moved ahead: its newer generation).
    check
        A committed generation this run has not opened yet: opened before the epoch is planned.
    fetch
        A generation to write that the remote may hold: fetched before the epoch is planned.
    """

    generation: int
    mode: EpochMode
    notes: dict = field(default_factory=dict)
    base: int = 0
    check: bool = False
    fetch: bool = False


@dataclass(frozen=True)
class Prepared:
    """What the planner decides an epoch from: the controller's choice and the look it was made from."""

    choice: Choice
    view: StoreView

    def info(self, generation: int) -> GenerationInfo | None:
        """Generation `generation`'s catalog entry, ``None`` where it is not committed here."""
        return self.view.committed.get(generation)

    def read_choice(self, generation: int) -> ReadChoice:
        """How the read epochs of `generation` go (looked up by :func:`loader.epochs.prepare.prepare`)."""
        return self.view.choices[generation]
