"""What an epoch does: its order, its batches, and whether it computes, generates, reads or rotates.

The order is the seed's and the epoch's (:mod:`loader.epochs.order`); the
cache controller says which generation the epoch uses and whether it is
committed (:meth:`~loader.cache.controller.CacheController.decide`, from the look
:func:`loader.epochs.prepare.prepare` took). Planning does no I/O.
"""

from __future__ import annotations

import logging
import os
import warnings
from typing import Callable

import numpy as np

from cachestore.guard.locking import SHARED_WRITERS

from ..cache.controller import CacheController
from ..cache.read_order import read_order
from ..cache.view import Prepared
from ..distributed import ConsumerLayout
from ..executors.host import executor_class
from ..executors.positions import StreamAt
from ..settings import EpochMode, LoaderSettings
from .order import block_order, epoch_order, first_draws, node_deck, rank_batches, sampled_batches, split_batches
from .plan import EpochPlan, GeneratePlan, ReadPlan, RotatePlan, StreamGeneratePlan, StreamPlan

log = logging.getLogger(__name__)


def _split(order_for: Callable[[int], np.ndarray], skip: int, settings: LoaderSettings,
           ranks: tuple[int, int, tuple[tuple[int, int], ...], int] | None
           ) -> tuple[np.ndarray, list[np.ndarray], int, np.ndarray]:
    """This process's part of an epoch's order (``order_for(ranks)``): ``(its order, its batches,
    batches skipped, positions served before a resume)``.

    `ranks` ``(ranks of the node, this rank, legs before the resume, batches per rank)``: the node's
    ranks deal the order (:func:`~loader.epochs.order.rank_batches`, as many batches each as every
    rank of every node). Each leg before a resume, ``(ranks, batches served when it stopped)``,
    served the first ``batches x batch_size x ranks`` samples of what the legs before it left, dealt by
    its ranks; the epoch goes on with the rest of the order of the ranks there are now, what was
    served taken out (as many batches as that rest makes).
    """
    s = settings
    if ranks is None:
        order = order_for(1)
        return order, split_batches(order, s.batch_size, s.drop_last), skip, np.zeros(0, dtype=np.int64)
    count, rank, legs, per_rank = ranks
    order = order_for(count)
    left: int | None = per_rank
    if not skip:
        served, rest = np.zeros(0, dtype=np.int64), order
    elif len(legs) == 1 and legs[0][0] == count:  # on as many ranks all along
        served = order[:min(len(order), skip * s.batch_size * count)]
        rest, left = order[~np.isin(order, served)], per_rank - skip
    else:
        served, done = np.zeros(0, dtype=np.int64), 0
        for leg_ranks, upto in legs:
            dealt = order if leg_ranks == count else order_for(leg_ranks)
            dealt = dealt[~np.isin(dealt, served)]
            served = np.concatenate([served, dealt[:(upto - done) * s.batch_size * leg_ranks]])
            done = upto
        rest, left = order[~np.isin(order, served)], None
    mine, batches = rank_batches(rest, count, rank, s.batch_size, s.drop_last, left, s.even_ranks)
    return mine, batches, 0, served[rank::count]


def _unless_another_run_writes(cache: CacheController, s: LoaderSettings, epoch: int, prepared: Prepared
                               ) -> tuple[int, EpochMode, dict]:
    """``(generation, mode, notes)`` of a generate epoch, or, where another run writes this prefix (and
    this one cannot write with it), a read of what that run committed rather than a wait or a failure."""
    choice, view = prepared.choice, prepared.view
    locked_by, newest = view.lock_holder, view.latest
    # It writes the generation with them, where its workers read back what others wrote (Ray's actors
    # do not: they may run on other machines) or where it has none.
    readable = executor_class(s.executor).writes_local_store or s.nb_worker == 0
    joins = locked_by == SHARED_WRITERS and cache.shares(readable)
    if locked_by in (None, os.getpid()) or newest is None or joins:
        return choice.generation, choice.mode, choice.notes
    log.info("another run (pid %s) is writing %s: epoch %d reads generation %d instead of writing "
             "generation %d", locked_by, cache.store.path, epoch, newest, choice.generation)
    return newest, EpochMode.READ, {"moved_to": newest}


def plan_epoch(epoch: int, skip: int, settings: LoaderSettings, indices: np.ndarray, seed: int, rotates: bool,
               cache: CacheController | None, ready: Prepared | None,
               ranks: tuple[int, int, tuple[tuple[int, int], ...], int] | None = None,
               shuffled_part: bool = False, blocks_before: bool = True) -> EpochPlan:
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
    ready
        The controller's choice and the store as the steps before the plan left it
        (:func:`loader.epochs.prepare.prepare`); ``None`` where the epoch does not use the cache.
    ranks
        With a store shared by the ranks of a node: how many ranks split each epoch's order, which one
        this is, and how many there were when `skip` batches were served (see :func:`_split`).
    shuffled_part
        `indices` are this rank's slice of the epoch's permutation: served in order, as ``DistributedSampler``'s.
    blocks_before
        The `skip` batches came in block order (``False``: a generate epoch's, whose rest keeps its order).
    """
    s = settings
    before, resumed_at = np.zeros(0, dtype=np.int64), skip
    if s.sampling is not None:  # the user's order (positions are dataset indices: one consumer)
        order, batches, keys = sampled_batches(s.sampling, epoch, len(indices), s.batch_size, s.drop_last)
        if keys:
            return _keys_plan(epoch, batches[skip:], indices, rotates or (cache is not None and not cache.off))
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
    assert ready is not None, "an epoch that uses the cache is prepared first (loader.epochs.prepare)"
    generation, mode, notes = ready.choice.generation, ready.choice.mode, ready.choice.notes
    # The node's ranks writing their streams together: the writer lock another rank holds is this job's.
    stream_ranks = s.dataset.stream and ranks is not None and ranks[0] > 1
    if mode == EpochMode.GENERATE and not notes.get("damaged") and not stream_ranks:
        generation, mode, notes = _unless_another_run_writes(cache, s, epoch, ready)
    if mode == EpochMode.READ:
        choice = ready.read_choice(generation)
        blocks = None
        # Read from the remote directly, blocks of consecutive records make one ranged read each.
        kind = read_order(choice, s, ranks, direct="direct" in notes)
        kind = "random" if kind == "block" and resumed_at and not blocks_before else kind
        if kind == "block":
            whole, blocks = block_order(len(indices), epoch, seed, choice.block)
            order, batches, skip, before = _split(lambda count: whole, resumed_at, s, ranks)
        info = ready.info(generation)
        return ReadPlan(epoch, batches[skip:], indices, generation, notes, order=kind,
                        committed_at=info.created if info is not None else None, blocks=blocks, stream=choice.stream,
                        remote="direct" in notes)
    dropped = len(order) - sum(len(b) for b in batches)
    unserved = (batches[:skip] + ([before] if len(before) else [])
                + ([order[len(order) - dropped:]] if dropped > 0 else []))
    plan = GeneratePlan(epoch, batches[skip:], indices, generation, notes, unserved=unserved, order=order,
                        order_skip=skip)
    if s.sampling is not None:
        # A generation holds every index once: what the sampler draws again is read back, what it never
        # draws is computed by idle workers (or after the served batches, without workers).
        plan.repeats, fill = first_draws(plan.batches + plan.unserved, len(indices))  # type: ignore[operator]
        if s.nb_worker == 0:
            plan.unserved += split_batches(fill, s.batch_size, False)
        else:
            plan.fill = fill
    return plan


def _keys_plan(epoch: int, batches: list[np.ndarray], indices: np.ndarray, stores: bool) -> EpochPlan:
    """The epoch of a sampler that yields lists of indices with ``batch_size=None``: each list goes to
    ``dataset[...]`` whole (``EpochPlan.keys``), computed every epoch.

    With a cache or rotation (`stores`) too, said once (a warning): what ``dataset[list]`` returns is one
    object for several indices, not a sample per index, so it cannot fill a generation that holds each
    index once; kept by the list itself, it would be found again only if the sampler drew the same list,
    which a shuffling sampler never does. Served as torch serves it, the run goes on uncached.
    """
    if stores:
        warnings.warn("a sampler that yields lists of indices with batch_size=None hands each list to dataset[...] "
                      "whole: its result is not one sample per index, which a cache or a rotation window stores, so "
                      "every epoch computes it (nothing is cached). To cache, let the sampler yield indices "
                      "(a batch_sampler yields the lists, and collate_fn sees each batch whole)", stacklevel=2)
    return EpochPlan(epoch, batches, indices, keys=True)


def plan_cluster_epoch(epoch: int, skip: int, s: LoaderSettings, indices: np.ndarray, seed: int,
                       cache: CacheController, layout: ConsumerLayout, ready: Prepared,
                       legs: tuple[tuple[int, int], ...] = ()) -> EpochPlan:
    """An epoch of several nodes whose stores each hold the whole dataset (a cache with a remote).

    A read epoch deals a new order of the whole dataset to every rank of every node
    (:func:`~loader.epochs.order.node_deck` over all of them). A generate epoch serves this
    node's part (:meth:`loader.cache.remote.RemoteTier.own_part`) dealt to its ranks, as many
    batches as a read epoch; what a rank's share holds beyond them is computed and written
    unserved. Without the remote (unreachable) the node's part is the whole dataset: every node
    computes it all, serving as many batches as with the remote. `legs`: ``(ranks of a node,
    batches served)`` before a resume (:func:`_split`; every node has as many ranks, so a read
    epoch's legs deal over ``ranks x nodes``).
    """
    n, per_rank = len(indices), layout.batches(s.batch_size, s.drop_last)
    generation, mode, notes = ready.choice.generation, ready.choice.mode, ready.choice.notes
    # Resumed on another number of ranks per node (as many nodes): the legs before served the first
    # samples of their own deals (_split), and the ranks there are now split the rest.
    elastic = bool(skip) and (len(legs) > 1 or (legs and legs[0][0] != layout.local_ranks))
    if mode == EpochMode.READ:
        if elastic:
            _, batches, skip, _ = _split(lambda count: node_deck(n, epoch, seed, count, s.shuffle), skip, s, (
                layout.nb_consumer, layout.consumer_index, tuple((r * layout.nodes, upto) for r, upto in legs),
                per_rank))
        else:
            deck = node_deck(n, epoch, seed, layout.nb_consumer, s.shuffle)
            _, batches = rank_batches(deck, layout.nb_consumer, layout.consumer_index, s.batch_size, s.drop_last,
                                      per_rank, layout.even)
        info, choice = ready.info(generation), ready.read_choice(generation)
        return ReadPlan(epoch, batches[skip:], indices, generation, notes, order=read_order(choice, s, None, dealt=True),
                        committed_at=info.created if info is not None else None, stream=choice.stream,
                        remote="direct" in notes)
    start, stop = cache.remote.own_part(n) if cache.remote is not None else (0, n)
    if elastic:
        share, batches, skip, before = _split(
            lambda count: start + node_deck(stop - start, epoch, seed, count, s.shuffle), skip, s,
            (layout.local_ranks, layout.local_rank, legs, per_rank))
        rest = share[sum(len(b) for b in batches):]
        unserved = ([before] if len(before) else []) + split_batches(rest, s.batch_size, False)
    else:
        deck = start + node_deck(stop - start, epoch, seed, layout.local_ranks, s.shuffle)
        share = deck[layout.local_rank::layout.local_ranks]
        cap = per_rank * s.batch_size  # what a read epoch serves; the rest of the share is written unserved
        if layout.even:  # each rank serves n // ranks (DistributedSampler(drop_last=True))
            cap = min(cap, layout.num_samples // layout.nb_consumer)
        mine, batches = rank_batches(share[:cap], 1, 0, s.batch_size, s.drop_last, per_rank)
        served = sum(len(b) for b in batches)
        rest = np.concatenate([mine[served:], share[cap:]])
        unserved = batches[:skip] + split_batches(rest, s.batch_size, False)
    return GeneratePlan(epoch, batches[skip:], indices, generation, notes, unserved=unserved, order=share,
                        order_skip=skip)


def stream_plan(plan: EpochPlan, skip: int, settings: LoaderSettings, seed: int,
                resume: StreamAt | None = None) -> EpochPlan:
    """A stream's epoch: read and rotate plans stay; one that computes iterates the stream (from `resume`,
    a stateful stream's position after batch `skip`), and one that generates writes it in arrival order
    (through a shuffle buffer with ``shuffle``)."""
    if isinstance(plan, (ReadPlan, RotatePlan)):
        return plan
    cache = settings.cache
    common = dict(epoch=plan.epoch, batches=[], indices=np.zeros(0, dtype=np.int64), notes=plan.notes,
                  transform_seed=plan.transform_seed, skip=skip, seed=seed,
                  limit=cache.stream_samples if cache is not None else None, resume=resume)
    if isinstance(plan, GeneratePlan) and cache is not None:
        return StreamGeneratePlan(generation=plan.generation, buffer=cache.stream_buffer if settings.shuffle else 0,
                                  **common)  # type: ignore[arg-type]
    return StreamPlan(**common)  # type: ignore[arg-type]
