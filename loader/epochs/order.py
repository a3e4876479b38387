"""Which indices an epoch visits, in which order, split into batches: the loader's own order, or
the user's sampler's."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..distributed import num_batches, rank_batch_count
from ..settings import Sampling


def epoch_order(n: int, epoch: int, seed: int, shuffle: bool, nearby_shuffle: int = 0) -> np.ndarray:
    """The order of indices ``0..n-1`` for `epoch`, deterministic in `(seed, epoch)`.

    ``nearby_shuffle=W`` sorts ``i + u_i`` with ``u_i`` uniform in ``[0, W)``:
    every index moves fewer than W positions from its own, so a dataset reading
    contiguous files keeps reading nearby records.
    """
    if not shuffle:
        return np.arange(n, dtype=np.int64)
    rng = np.random.default_rng([seed, epoch])
    if nearby_shuffle:
        keys = np.arange(n) + rng.random(n) * nearby_shuffle
        return np.argsort(keys, kind="stable").astype(np.int64)
    return rng.permutation(n).astype(np.int64)


def split_batches(order: np.ndarray, batch_size: int, drop_last: bool) -> list[np.ndarray]:
    """Consecutive chunks of `batch_size` (the last one shorter unless `drop_last`)."""
    stop = len(order) - len(order) % batch_size if drop_last else len(order)
    return [order[i:i + batch_size] for i in range(0, stop, batch_size)]


def node_deck(n: int, epoch: int, seed: int, ranks: int, shuffle: bool) -> np.ndarray:
    """The order of a node's `n` samples in `epoch`, which its `ranks` ranks deal between them (rank
    ``r`` serves ``deck[r::ranks]``, :func:`rank_batches`).

    A new permutation every epoch, like ``DistributedSampler`` with ``set_epoch``, but one whose deal
    moves each rank through the whole node: every ``2 x ranks`` epochs a permutation is drawn and
    laid out in `ranks` columns; every epoch its rows are shuffled anew (a new order and new batches
    inside each column) and rank ``r`` takes column ``(r + epoch) % ranks``. Every ``ranks``
    consecutive epochs of a cycle then show each rank all of the node's samples (independent
    quarters would show 4 ranks 76% of it in 5 epochs), and every epoch each index goes to one rank.
    The ``n % ranks`` samples past the last full row go to the first ranks, in a new order each epoch.
    One rank (or no shuffling) is :func:`epoch_order`.
    """
    if ranks == 1 or not shuffle:
        return epoch_order(n, epoch, seed, shuffle)
    cycle, turn = divmod(epoch, 2 * ranks)
    base = np.random.default_rng([seed, cycle, 11]).permutation(n).astype(np.int64)
    rows = n // ranks
    rng = np.random.default_rng([seed, epoch, 12])
    grid = base[:rows * ranks].reshape(rows, ranks)[rng.permutation(rows)]
    grid = np.roll(grid, -(turn % ranks), axis=1)  # column (r + turn) % ranks lands where rank r deals
    return np.concatenate([grid.ravel(), rng.permutation(base[rows * ranks:])])


def rank_batches(order: np.ndarray, ranks: int, rank: int, batch_size: int, drop_last: bool,
                 count: int | None = None, even: bool = False) -> tuple[np.ndarray, list[np.ndarray]]:
    """Rank `rank`'s share of an order the node's `ranks` ranks split, and its batches.

    Every `ranks`-th sample from `rank` on, as ``DistributedSampler`` deals
    them, so each index goes to one rank; every rank serves the same number of
    batches (:func:`rank_batch_count`), so collective operations in a training
    step never wait on a rank that ran out. Batches hold `batch_size` samples
    except the last ones of a rank with fewer samples, which shrink (at least one
    sample each). Only when a rank has fewer samples than batches (``batch_size``
    1, ``n`` not a multiple of `ranks`) does its last batch take the order's first
    sample again. With `drop_last`, every rank serves full batches and the
    samples past them are not served (returned in neither). `count`: the
    batches every rank of every node serves (nodes' parts differ by a sample),
    by default those of this order. `even`: the order's last ``len(order) % ranks`` samples are not
    served, so every rank serves as many (``DistributedSampler(drop_last=True)``).
    """
    if even:
        order = order[:len(order) - len(order) % ranks]
    mine = order[rank::ranks]
    if count is None:
        count = rank_batch_count(len(order), ranks, batch_size, drop_last)
    if drop_last:
        return mine, [mine[i * batch_size:(i + 1) * batch_size] for i in range(count)]
    if len(mine) < count:
        mine = np.concatenate([mine, order[:count - len(mine)]])
    sizes = np.full(count, batch_size, dtype=np.int64)
    excess = count * batch_size - len(mine)
    for b in range(count - 1, -1, -1):  # shrink from the end, each batch keeping at least one sample
        cut = min(excess, int(sizes[b]) - 1)
        sizes[b] -= cut
        excess -= cut
    bounds = np.concatenate([[0], np.cumsum(sizes)])
    return mine, [mine[bounds[i]:bounds[i + 1]] for i in range(count)]


def sampled_batches(sampling: Sampling, epoch: int, n: int, batch_size: int,
                    drop_last: bool) -> tuple[np.ndarray, list[np.ndarray], bool]:
    """The order a sampler (or batch sampler) draws for `epoch`, its batches, and whether each batch is
    one of the sampler's lists of indices, for ``dataset[list]`` (``sampling.keys``, see :class:`Sampling`).

    ``set_epoch(epoch)`` is called first when the sampler has it, as torch's
    ``DistributedSampler`` expects. Indices may repeat and some may be missing.

    Raises
    ------
    IndexError
        The sampler drew an index outside ``0..n-1``.
    """
    source = sampling.source
    set_epoch = getattr(source, "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)
    keys = False
    if sampling.batch_sampler is not None:
        batches = [np.asarray([int(i) for i in batch], dtype=np.int64) for batch in sampling.batch_sampler]
        order = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    else:
        assert sampling.sampler is not None
        drawn = list(sampling.sampler) if sampling.keys else sampling.sampler
        keys = sampling.keys and bool(drawn) and np.ndim(drawn[0]) == 1  # type: ignore[index]
        if keys:
            batches = [_key(key, sampling.name) for key in drawn]
            order = np.concatenate(batches)
        else:
            order = np.fromiter((int(i) for i in drawn), dtype=np.int64)
            batches = split_batches(order, batch_size, drop_last)
    if len(order) and (order.min() < 0 or order.max() >= n):
        bad = order[(order < 0) | (order >= n)][0]
        raise IndexError(f"the {sampling.name} drew index {bad} in epoch {epoch}; the dataset has {n} samples")
    return order, batches, keys


def _key(key: object, name: str) -> np.ndarray:
    """One list of indices a sampler yielded (with ``batch_size=None``), as an array."""
    array = np.asarray(key)
    if array.ndim != 1 or not (array.size == 0 or np.issubdtype(array.dtype, np.integer)):
        raise TypeError(f"the {name} yields lists of indices (batch_size=None hands each to dataset[...]): "
                        f"every item must be a list of int, got {key!r}")
    return array.astype(np.int64)


def sampled_length(sampling: Sampling, batch_size: int, drop_last: bool) -> int:
    """Batches per epoch with a sampler, as torch counts them (``len`` of the sampler).

    Raises
    ------
    TypeError
        The sampler has no ``len()`` (as torch's ``len(DataLoader)`` says).
    """
    if sampling.batch_sampler is not None:
        return len(sampling.batch_sampler)  # type: ignore[arg-type]
    return num_batches(len(sampling.sampler), batch_size, drop_last)  # type: ignore[arg-type]


@dataclass(frozen=True)
class Redraw:
    """A batch of a sampler's generate epoch that draws indices again.

    ``earlier``: the positions an earlier batch drew (read back from the
    generation once batch ``after`` is in, never computed again); ``whole``:
    the batch draws an index twice itself, so it runs as one task (which
    computes it once).
    """

    earlier: np.ndarray
    after: int
    whole: bool


def first_draws(batches: list[np.ndarray], n: int) -> tuple[dict[int, Redraw], np.ndarray]:
    """Where a sampler's generate epoch draws an index again, and what it never draws.

    Returns the batches (by number, in the order given) that draw indices again
    (:class:`Redraw`), and the indices no batch draws.
    """
    first = np.full(n, -1, dtype=np.int64)
    redraws: dict[int, Redraw] = {}
    for seq, batch in enumerate(batches):
        seen = first[batch]
        earlier = (seen >= 0) & (seen < seq)
        whole = len(np.unique(batch)) < len(batch)
        if earlier.any() or whole:
            redraws[seq] = Redraw(earlier, int(seen[earlier].max()) if earlier.any() else -1, whole)
        first[batch[first[batch] < 0]] = seq
    return redraws, np.flatnonzero(first < 0).astype(np.int64)


#: Blocks read together and shuffled together: each batch mixes samples of up to this many blocks.
WINDOW_BLOCKS = 16


@dataclass(frozen=True)
class BlockOrder:
    """A block order's shape: ``block`` consecutive records per block, read as a whole, and the
    windows of blocks whose records are shuffled together (block ids, in reading order)."""

    block: int
    windows: list[np.ndarray]


def block_order(n: int, epoch: int, seed: int, block: int, window: int = WINDOW_BLOCKS) -> tuple[np.ndarray, BlockOrder]:
    """The order of ``0..n-1`` for `epoch` in blocks of `block` consecutive records.

    The blocks come in a random permutation; every `window` blocks in a row
    form a window whose records are shuffled together, so a batch drawn from
    a window mixes samples of up to `window` blocks while every read stays a
    block long. Deterministic in ``(seed, epoch)``, a new one every epoch, and
    each index exactly once.
    """
    rng = np.random.default_rng([seed, epoch, 5])
    blocks = -(-n // block)
    permutation = rng.permutation(blocks)
    windows = [permutation[w:w + window] for w in range(0, blocks, window)]
    parts = []
    for ids in windows:
        records = np.concatenate([np.arange(b * block, min((b + 1) * block, n), dtype=np.int64) for b in ids])
        parts.append(rng.permutation(records))
    order = np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
    return order, BlockOrder(block, windows)
