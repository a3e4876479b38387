"""What an epoch does: its order, its batches, and whether it computes, generates, reads or rotates.

The order is the seed's and the epoch's (:mod:`loader.epochs.order`); the
cache controller says which generation the epoch uses and whether it is
committed (:meth:`~loader.cache.controller.CacheController.choose`).
"""

from __future__ import annotations

import logging
import os
from typing import Callable

import numpy as np

from ..cache.controller import CacheController
from ..settings import EpochMode, LoaderSettings
from .order import block_order, epoch_order, first_draws, sampled_batches, split_batches
from .plan import EpochPlan

log = logging.getLogger(__name__)


def plan_epoch(epoch: int, skip: int, settings: LoaderSettings, indices: np.ndarray, seed: int, rotates: bool,
               cache: CacheController | None, refreshed: Callable[[int, int], bool]) -> EpochPlan:
    """What epoch `epoch` does; the first `skip` batches were served before a resume.

    Parameters
    ----------
    indices
        The dataset indices this consumer serves (a store position maps to ``indices[position]``).
    seed
        The run's seed (the settings', or a loaded state's).
    rotates
        Epochs go through a rotation window (``rotation_setting``, or the budget's fallback).
    cache
        The cache controller, ``None`` without a cache.
    refreshed
        ``refreshed(generation, epoch)``: whether a background refresh had computed `generation`
        and could commit it now (the epoch then reads it).
    """
    s = settings
    if s.sampling is not None:  # the user's order (positions are dataset indices: one consumer)
        order, batches = sampled_batches(s.sampling, epoch, len(indices), s.batch_size, s.drop_last)
    else:
        order = epoch_order(len(indices), epoch, seed, s.shuffle, s.nearby_shuffle)
        batches = split_batches(order, s.batch_size, s.drop_last)
    if rotates:
        # Generation order: the i-th generated sample is dataset index indices[order[i]].
        return EpochPlan(epoch, EpochMode.ROTATE, None, [], indices[order], skip=skip)
    if cache is None or cache.off:
        return EpochPlan(epoch, EpochMode.COMPUTE, None, batches[skip:], indices)
    generation, mode, notes = cache.choose(epoch)
    if mode == EpochMode.GENERATE and refreshed(generation, epoch):
        mode = EpochMode.READ
    if mode == EpochMode.GENERATE and not notes.get("damaged"):
        locked_by = cache.store.lock_holder()
        newest = cache.newest_committed()
        if locked_by not in (None, os.getpid()) and newest is not None:
            # Another run writes this prefix: serve what it committed rather than wait or fail.
            log.info("another run (pid %s) is writing %s: epoch %d reads generation %d instead of writing "
                     "generation %d", locked_by, cache.store.path, epoch, newest, generation)
            generation, mode, notes = newest, EpochMode.READ, {"moved_to": newest}
    if mode == EpochMode.READ:
        choice = cache.read_choice(generation)
        blocks = None
        if choice.order == "block" and s.sampling is None and s.shuffle and not s.nearby_shuffle:
            order, blocks = block_order(len(indices), epoch, seed, choice.block)
            batches = split_batches(order, s.batch_size, s.drop_last)
        plan = EpochPlan(epoch, mode, generation, batches[skip:], indices, notes=notes)
        plan.read_order, plan.blocks, plan.stream = choice.order, blocks, choice.stream
        return plan
    if mode != EpochMode.GENERATE:
        return EpochPlan(epoch, mode, generation, batches[skip:], indices, notes=notes)
    dropped = len(order) - sum(len(b) for b in batches)
    unserved = batches[:skip] + ([order[len(order) - dropped:]] if dropped else [])
    plan = EpochPlan(epoch, mode, generation, batches[skip:], indices, unserved, notes=notes)
    if s.sampling is not None:
        # A generation holds every index once: what the sampler draws again is read back, what it never
        # draws is computed by idle workers (or after the served batches, without workers).
        plan.repeats, fill = first_draws(plan.batches + plan.unserved, len(indices))  # type: ignore[operator]
        if s.nb_worker == 0:
            plan.unserved += split_batches(fill, s.batch_size, False)
        else:
            plan.fill = fill
    return plan
