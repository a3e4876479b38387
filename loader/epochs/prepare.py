"""The steps before an epoch is planned: every read of the store (and of the remote) its plan needs.

The planner (:mod:`loader.epochs.planner`) does no I/O: it decides from a
:class:`~loader.cache.view.Prepared` made here (``docs/ARCHITECTURE.md``,
"Epoch plan"). :func:`prepare` looks at the store, lets the cache controller
decide, and takes the steps that decision asks for, each an explicit act
whose outcome the next decision sees:

* commit the generation a background refresh computed, when the epoch is its first;
* open a committed generation not opened yet this run (damage shows only there);
* fetch from the remote a generation the epoch would otherwise compute;
* find how its read epochs go (their order, from the memory room).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

from ..cache.controller import CacheController
from ..cache.view import Choice, Prepared
from ..settings import EpochMode

log = logging.getLogger(__name__)

#: Looks before the choice settles: each step changes what the next look finds at most once.
LOOKS = 6


def prepare(cache: CacheController, epoch: int, refreshed: Callable[[int], bool] = lambda generation: False,
            fetch: bool = True) -> Prepared:
    """The choice of epoch `epoch` and the look it was decided from, its steps taken (module docstring).

    Parameters
    ----------
    cache
        The loader's cache controller.
    refreshed
        ``refreshed(generation)``: finish and commit a background refresh that computed `generation`
        (``True`` once committed).
    fetch
        Fetch a generation the remote may hold (``False``: an epoch already running asks again).
    """
    view = cache.look()
    choice = cache.decide(epoch, view)
    for _ in range(LOOKS):
        g = choice.generation
        if choice.mode is EpochMode.GENERATE and refreshed(g):
            view = cache.look()
        elif choice.check:
            problem = cache.unreadable(g)
            # None and not sound: it went away as it was opened; the next look says what to do.
            view = view.learnt(unreadable={g: problem}) if problem is not None else cache.look()
        elif choice.fetch and fetch:
            assert cache.remote is not None
            got = cache.remote.fetch(g)
            view = cache.look().learnt(fetched={**view.fetched, g: got or "absent"})
        else:
            break
        choice = cache.decide(epoch, view)
    # The generation read, or the newest: read instead where another run holds the writer (the planner).
    read = choice.generation if choice.mode is EpochMode.READ else \
        view.latest if view.lock_holder not in (None, os.getpid()) else None
    if read is not None:
        view = view.learnt(choices={read: cache.read_choice(read, view)})
    _say(cache, epoch, choice)
    cache.take(choice)
    return Prepared(choice, view)


def _say(cache: CacheController, epoch: int, choice: Choice) -> None:
    """A log line where `choice` departs from the plan (``generation_for(epoch)`` written or read)."""
    generation, notes, path = cache.generation_for(epoch), choice.notes, cache.store.path
    if "damaged" in notes:
        log.warning("generation %d of %s is damaged (%s): writing it again", choice.generation, path, notes["damaged"])
    elif "went_back_to" in notes:
        log.info("epoch %d goes back to generation %d, which this run replaced by generation %d: it reads "
                 "generation %d", epoch, generation, choice.generation, choice.generation)
    elif "moved_to" in notes:
        log.info("another run on %s moved ahead to generation %d: epoch %d reads it instead of writing "
                 "generation %d", path, choice.generation, epoch, generation)
    elif "read_only" in notes and choice.generation != generation:
        log.info("epoch %d would write generation %d, but %s is read-only: it reads generation %d", epoch,
                 generation, path, choice.generation)
