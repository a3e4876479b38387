"""Rotation (data echoing): each generated sample is served R times from a bounded window.

Schedule
--------
The window has ``W = min(S, N)`` slots. Slot ``k`` holds a sequence of
samples, one after the other; each sample is served R times and then replaced
by the next one. A batch is a set of *distinct slots*, so it never holds the
same sample twice, and a slot holds one sample at a time, so the window never
holds more than W samples. Choosing the slots of each batch is the classic
problem of realising a bipartite degree sequence (slot k needs ``R * m_k``
serves, batch j has ``n_j`` places): taking, for every batch, the slots with
the most serves left - ties broken at random - succeeds whenever any schedule
with distinct slots does (Gale-Ryser / Havel-Hakimi). With balanced ``m_k``
it always does once ``N >= S >= batch_size``; in the corner cases where it
cannot (tiny datasets, ``N`` barely above ``S``) a batch takes a slot twice -
at a sample boundary, so each sample is still served exactly R times.

The tie-breaking makes slots cycle like passes over the window with a fresh
random partition each pass: a sample's R serves are spread about ``W / B``
batches apart. Which dataset index a sample is comes from a fresh permutation
every epoch, deterministic in ``(seed, epoch)``.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from cachestore import codec
from cachestore.backends.directory import ROTATION_PREFIX, remove_paths, rotation_debris

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Serve:
    slot: int
    sample: int  # generation order: the i-th sample this epoch generates
    fresh: bool  # first serve: the sample must be computed
    last: bool  # last serve: the slot is free afterwards


def batch_sizes(n: int, rotation: int, batch_size: int, drop_last: bool) -> list[int]:
    total = rotation * n
    sizes = [batch_size] * (total // batch_size)
    if total % batch_size and not drop_last:
        sizes.append(total % batch_size)
    return sizes


def rotation_schedule(n: int, rotation: int, size: int, batch_size: int, drop_last: bool,
                      rng: np.random.Generator) -> Iterator[list[Serve]]:
    """Batches of serves covering ``rotation * n`` serves, built lazily (see the module docstring).

    Slot ``k`` gives ``d_k = rotation * m_k`` serves in ``nb`` batches. When
    ``d_k > nb`` (``S`` close to ``batch_size``, rounding) the slot must appear
    twice in ``d_k - nb`` batches: those *doubles* are placed where one sample's
    last serve meets the next one's first, so the batch still holds distinct samples.
    """
    if n == 0:
        return
    slots = min(size, n)
    per_slot = np.full(slots, n // slots, dtype=np.int64)
    per_slot[rng.permutation(slots)[: n % slots]] += 1
    sizes = batch_sizes(n, rotation, batch_size, drop_last)
    demand = per_slot * rotation
    doubles = np.maximum(0, demand - len(sizes))
    appear = demand - doubles  # batches each slot still appears in
    done = np.zeros(slots, dtype=np.int64)
    current = np.full(slots, -1, dtype=np.int64)
    next_sample = 0
    for need in sizes:
        key = appear + rng.random(slots)
        key[appear == 0] = -np.inf
        width = min(slots, 2 * need + 8)
        cand = np.argpartition(-key, width - 1)[:width] if width < slots else np.arange(slots)
        order = list(cand[np.argsort(-key[cand])])
        batch: list[Serve] = []
        in_batch: set[int] = set()
        while len(batch) < need:
            if not order:
                # Every slot is in the batch already (tiny windows): take more serves from
                # the slots with the most left, a sample boundary first.
                left = [t for t in range(slots) if demand[t] > done[t]]
                if not left:
                    break
                left.sort(key=lambda t: (done[t] % rotation != rotation - 1, -(demand[t] - done[t])))
                order = left[:1]
            t = int(order.pop(0))
            if demand[t] == done[t]:
                continue
            if t in in_batch:
                appear[t] += 1  # an extra appearance, paid for below
            appear[t] -= 1
            take = 1
            if (doubles[t] and done[t] % rotation == rotation - 1 and demand[t] - done[t] >= 2
                    and need - len(batch) >= 2 and t not in in_batch):
                take = 2
                doubles[t] -= 1
            for _ in range(take):
                fresh = done[t] % rotation == 0
                if fresh:
                    current[t] = next_sample
                    next_sample += 1
                done[t] += 1
                batch.append(Serve(t, int(current[t]), bool(fresh), bool(done[t] % rotation == 0)))
            in_batch.add(t)
            if not order and len(batch) < need:
                rest = [int(u) for u in np.argsort(-(appear + rng.random(slots))) if u not in in_batch and appear[u] > 0]
                order = rest
        yield batch


class MemoryWindow:
    """The window in this process's RAM: one sample (own copy) per slot."""

    def __init__(self, slots: int) -> None:
        self._samples: list[Any] = [None] * slots

    def put(self, slot: int, sample: Any) -> None:
        treedef, leaves = codec.flatten(sample, allow_pickle=True)
        self._samples[slot] = codec.unflatten(treedef, [np.array(leaf) for leaf in leaves])

    def get(self, slot: int) -> Any:
        return self._samples[slot]

    def free(self, slot: int) -> None:
        self._samples[slot] = None

    def held(self) -> int:
        return sum(s is not None for s in self._samples)

    def close(self) -> None:
        self._samples = []


class DiskWindow:
    """The window as one record file per slot under ``<prefix>/rotation-<pid>-<hex>/``.

    At most one file per slot, so the bytes on disk stay within the window's
    samples. The directory is removed on close; one left by a crashed process
    is removed by the next loader using the prefix, or by ``cachestore prune``.
    """

    def __init__(self, prefix: str, slots: int) -> None:
        root = Path(prefix)
        root.mkdir(parents=True, exist_ok=True)
        stale = rotation_debris(root)
        if stale:
            remove_paths([path for path, _ in stale])
            log.info("removed %d rotation window(s) left by dead processes under %s", len(stale), root)
        self.path = root / f"{ROTATION_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        self.path.mkdir()
        self._held = [False] * slots

    def _file(self, slot: int) -> Path:
        return self.path / f"slot-{slot}.rec"

    def put(self, slot: int, sample: Any) -> None:
        record = codec.encode_record(*codec.flatten(sample, allow_pickle=True))
        tmp = self.path / f"slot-{slot}.tmp"
        tmp.write_bytes(record)
        os.replace(tmp, self._file(slot))
        self._held[slot] = True

    def get(self, slot: int) -> Any:
        treedef, leaves = codec.decode_record(self._file(slot).read_bytes(), copy=False)
        return codec.unflatten(treedef, leaves)

    def free(self, slot: int) -> None:
        self._file(slot).unlink(missing_ok=True)
        self._held[slot] = False

    def held(self) -> int:
        return sum(self._held)

    def close(self) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
