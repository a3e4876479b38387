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

from cachestore.locking import SHARED_WRITERS

from ..cache.controller import CacheController
from ..settings import EpochMode, LoaderSettings
from .order import block_order, epoch_order, first_draws, node_deck, rank_batches, sampled_batches, split_batches
from .plan import EpochPlan, GeneratePlan, ReadPlan, RotatePlan, StreamGeneratePlan, StreamPlan

log = logging.getLogger(__name__)


def _split(order_for: Callable[[int], np.ndarray], skip: int, settings: LoaderSettings,
           ranks: tuple[int, int, int, int] | None) -> tuple[np.ndarray, list[np.ndarray], int, np.ndarray]:
    """This process's part of an epoch's order (``order_for(ranks)``): ``(its order, its batches,
    batches skipped, positions served before a resume)``.

    `ranks` ``(ranks of the node, this rank, ranks before the resume, batches per rank)``: the node's
    ranks deal the order (:func:`~loader.epochs.order.rank_batches`, as many batches each as every
    rank of every node), and a resume goes on after the first ``skip x batch_size x ranks-before``
    samples of the order those ranks dealt: the rest of the order of the ranks there are now, what
    was served taken out (as many batches as that rest makes).
    """
    s = settings
    if ranks is None:
        order = order_for(1)
        return order, split_batches(order, s.batch_size, s.drop_last), skip, np.zeros(0, dtype=np.int64)
    count, rank, before, per_rank = ranks
    order = order_for(count)
    left: int | None = per_rank
    if not skip:
        served, rest = np.zeros(0, dtype=np.int64), order
    else:
        dealt = order if before == count else order_for(before)
        served = dealt[:min(len(dealt), skip * s.batch_size * before)]
        rest = order[~np.isin(order, served)]
        left = per_rank - skip if before == count else None
    mine, batches = rank_batches(rest, count, rank, s.batch_size, s.drop_last, left)
    return mine, batches, 0, served[rank::count]


def plan_epoch(epoch: int, skip: int, settings: LoaderSettings, indices: np.ndarray, seed: int, rotates: bool,
               cache: CacheController | None, refreshed: Callable[[int, int], bool],
               ranks: tuple[int, int, int, int] | None = None, shuffled_part: bool = False) -> EpochPlan:
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
    ranks
        With a store shared by the ranks of a node: how many ranks split each epoch's order, which one
        this is, and how many there were when `skip` batches were served (see :func:`_split`).
    shuffled_part
        `indices` are this rank's slice of the epoch's permutation: served in order, as ``DistributedSampler``'s.
    """
    s = settings
    before, resumed_at = np.zeros(0, dtype=np.int64), skip
    if s.sampling is not None:  # the user's order (positions are dataset indices: one consumer)
        order, batches = sampled_batches(s.sampling, epoch, len(indices), s.batch_size, s.drop_last)
    else:
        def deck(count: int) -> np.ndarray:
            if shuffled_part:  # its padding comes last, and drop_last drops it (a reshuffle served it)
                return np.arange(len(indices), dtype=np.int64)
            if count == 1:
                return epoch_order(len(indices), epoch, seed, s.shuffle, s.nearby_shuffle)
            return node_deck(len(indices), epoch, seed, count, s.shuffle)

        order, batches, skip, before = _split(deck, skip, s, ranks)
    if rotates:
        # Generation order: the i-th generated sample is dataset index indices[order[i]].
        return RotatePlan(epoch, [], indices[order], skip=skip)
    if cache is None or cache.off:
        return EpochPlan(epoch, batches[skip:], indices)
    generation, mode, notes = cache.choose(epoch)
    if mode == EpochMode.GENERATE and refreshed(generation, epoch):
        mode = EpochMode.READ
    if mode == EpochMode.GENERATE and not notes.get("damaged"):
        locked_by = cache.store.lock_holder()
        newest = cache.newest_committed()
        # It writes the generation with them (Ray's actors cannot read back what others wrote: they do not).
        joins = locked_by == SHARED_WRITERS and cache.shares(s.executor != "ray" or s.nb_worker == 0)
        if locked_by not in (None, os.getpid()) and newest is not None and not joins:
            # Another run writes this prefix: serve what it committed rather than wait or fail.
            log.info("another run (pid %s) is writing %s: epoch %d reads generation %d instead of writing "
                     "generation %d", locked_by, cache.store.path, epoch, newest, generation)
            generation, mode, notes = newest, EpochMode.READ, {"moved_to": newest}
    if mode == EpochMode.READ:
        choice = cache.read_choice(generation)
        blocks = None
        # Ranks splitting one order must draw the same one, whether each reads the generation or (started
        # before its commit) reads it back from the area being written: several ranks read in random order.
        kind = choice.order if ranks is None or ranks[0] == 1 else "random"
        if kind == "block" and s.sampling is None and s.shuffle and not s.nearby_shuffle:
            whole, blocks = block_order(len(indices), epoch, seed, choice.block)
            order, batches, skip, before = _split(lambda count: whole, resumed_at, s, ranks)
        info = cache.committed().get(generation)
        return ReadPlan(epoch, batches[skip:], indices, generation, notes, order=_order_used(blocks is not None, s),
                        committed_at=info.created if info is not None else None, blocks=blocks, stream=choice.stream)
    dropped = len(order) - sum(len(b) for b in batches)
    unserved = (batches[:skip] + ([before] if len(before) else [])
                + ([order[len(order) - dropped:]] if dropped > 0 else []))
    plan = GeneratePlan(epoch, batches[skip:], indices, generation, notes, unserved=unserved)
    if s.sampling is not None:
        # A generation holds every index once: what the sampler draws again is read back, what it never
        # draws is computed by idle workers (or after the served batches, without workers).
        plan.repeats, fill = first_draws(plan.batches + plan.unserved, len(indices))  # type: ignore[operator]
        if s.nb_worker == 0:
            plan.unserved += split_batches(fill, s.batch_size, False)
        else:
            plan.fill = fill
    return plan


def _order_used(in_blocks: bool, s: LoaderSettings) -> str:
    """The order a read epoch serves in, as its stats report it: ``"block"`` or ``"random"`` (the
    read order), or what overrides both (a sampler, ``shuffle=False``, ``nearby_shuffle``)."""
    if in_blocks:
        return "block"
    if s.sampling is not None:
        return "sampler"
    if not s.shuffle:
        return "sequential"
    return "nearby" if s.nearby_shuffle else "random"


def stream_plan(plan: EpochPlan, skip: int, settings: LoaderSettings, seed: int) -> EpochPlan:
    """A stream's epoch: read and rotate plans stay; one that computes iterates the stream, and one that
    generates writes it in arrival order (through a shuffle buffer with ``shuffle``)."""
    if isinstance(plan, (ReadPlan, RotatePlan)):
        return plan
    cache = settings.cache
    common = dict(epoch=plan.epoch, batches=[], indices=np.zeros(0, dtype=np.int64), notes=plan.notes,
                  transform_seed=plan.transform_seed, skip=skip, seed=seed,
                  limit=cache.stream_samples if cache is not None else None)
    if isinstance(plan, GeneratePlan) and cache is not None:
        return StreamGeneratePlan(generation=plan.generation, buffer=cache.stream_buffer if settings.shuffle else 0,
                                  **common)  # type: ignore[arg-type]
    return StreamPlan(**common)  # type: ignore[arg-type]
