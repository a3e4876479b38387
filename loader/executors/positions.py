"""Where a stream's copy is: its own states, as torchdata records and loads them.

A stream whose dataset or iterator has its own ``state_dict()``/``load_state_dict()`` (torchdata's
``Stateful``) is recorded at a :func:`position` (both states), and a new iterator starts from one
(:func:`iterate_from`: the dataset's state loaded before ``iter()``, the iterator's into what
``__iter__`` returned); :class:`StreamAt` is where an epoch of the stream's copies got
(``docs/ARCHITECTURE.md``, "Resuming"). Batches are taken with ``next()`` alone (:func:`take`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator


def stateful(stream: object) -> bool:
    """Whether `stream` saves and loads its own position (torchdata's ``Stateful``)."""
    return callable(getattr(stream, "state_dict", None)) and callable(getattr(stream, "load_state_dict", None))


def position(dataset: object, iterator: object) -> list[Any] | None:
    """Where a copy of a stream is, as torchdata records it: ``[the dataset's state, its iterator's]``,
    each ``None`` where it keeps none (the dataset's, when it is its own iterator: recorded once);
    ``None`` when neither keeps one."""
    it = iterator.state_dict() if iterator is not None and stateful(iterator) else None  # type: ignore[attr-defined]
    ds = dataset.state_dict() if stateful(dataset) and iterator is not dataset else None  # type: ignore[attr-defined]
    return None if it is None and ds is None else [ds, it]


def stream_start(dataset: object) -> StreamAt | None:
    """Where a stream not begun yet is (its own state as it is now), ``None`` when it keeps none."""
    at = position(dataset, None) if dataset is not None else None
    return StreamAt((at,), (False,), 0, 0) if at is not None else None


def iterate_from(dataset: Any, at: Any) -> Iterator[Any]:
    """A new iterator of `dataset`, from position `at` (:func:`position`'s) when given, in torchdata's
    order: the dataset's state loaded before ``iter()``, the iterator's into what ``__iter__`` returned
    (state it creates in ``__iter__`` exists only then)."""
    ds, it = at if isinstance(at, (list, tuple)) and len(at) == 2 else (None, None)
    if ds is not None and stateful(dataset):
        dataset.load_state_dict(ds)
    iterator: Iterator[Any] = iter(dataset)
    if it is not None and stateful(iterator):
        iterator.load_state_dict(it)  # type: ignore[attr-defined]
    return iterator


@dataclass(frozen=True)
class StreamAt:
    """Where an epoch of a stream got: after `arrived` samples, each worker's copy at `states` (``None``: it
    keeps no state, or nothing was taken from it yet), those in `ended` out of the turn, worker `next` next;
    `taken`, served out of turn (``in_order=False``): how many batches each copy gave (a copy without a
    state is iterated again up to there)."""

    states: tuple[Any, ...]
    ended: tuple[bool, ...]
    next: int
    arrived: int
    taken: tuple[int, ...] | None = None

    def plain(self) -> dict[str, object]:
        """As the plain values of a loader state."""
        plain = {"states": list(self.states), "ended": list(self.ended), "next": self.next, "arrived": self.arrived}
        return plain if self.taken is None else {**plain, "taken": list(self.taken)}

    @classmethod
    def from_plain(cls, value: object, workers: int) -> StreamAt:
        """The position a loader state recorded for `workers` workers (1 for a stream iterated in place).

        Raises
        ------
        ValueError
            `value` is not such a position.
        """
        ok = isinstance(value, dict) and isinstance(value.get("states"), list) and isinstance(
            value.get("ended"), list) and len(value["states"]) == len(value["ended"]) == workers and all(
            isinstance(e, bool) for e in value["ended"])
        nat = [isinstance(value.get(k), int) and not isinstance(value.get(k), bool) and value[k] >= 0
               for k in ("next", "arrived")] if isinstance(value, dict) else [False]
        if not ok or not all(nat) or value["next"] >= workers:  # type: ignore[index]
            raise ValueError(f"damaged loader state: state['stream'] must be the position of a stream's {workers} "
                             "iterator(s) {'states': [...], 'ended': [bool, ...], 'next': int, 'arrived': int}, "
                             f"got {value!r}")
        assert isinstance(value, dict)
        taken = value.get("taken")
        if taken is not None and not (isinstance(taken, list) and len(taken) == workers and all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in taken)):
            raise ValueError(f"damaged loader state: state['stream']['taken'] must be {workers} counts of batches "
                             f"(ints >= 0), got {taken!r}")
        return cls(tuple(value["states"]), tuple(value["ended"]), value["next"], value["arrived"],
                   tuple(taken) if taken is not None else None)


def take(iterator: Iterator[Any], n: int) -> list[Any]:
    """The iterator's next `n` items (fewer at its end), by ``next()`` alone, as torch's fetcher takes
    them: ``islice`` would call ``iter()`` on it again, which restarts a stream that is its own iterator
    and sets its position up in ``__iter__``."""
    items = []
    for _ in range(n):
        try:
            items.append(next(iterator))
        except StopIteration:
            break
    return items
