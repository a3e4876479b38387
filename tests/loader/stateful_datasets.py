"""Datasets that keep their own state as torchdata's ``Stateful`` ones do (``state_dict``/``load_state_dict``),
and draw random numbers from torch's global generator, as torchdata's own tests' datasets do."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


class RandomMap(Dataset):
    """Sample ``i`` is ``(i, a number torch's global generator draws)``; its state is that generator's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> list[int]:
        return [i, int(torch.randint(1000, (1,)).item())]

    def state_dict(self) -> dict:
        return {"g": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["g"])


class Cursor:
    """An iterator that keeps its position (its state), made by :class:`StateMadeInIter`'s ``__iter__``."""

    def __init__(self, start: int, end: int) -> None:
        self.at, self.end = start, end

    def __next__(self) -> list[int]:
        if self.at >= self.end:
            raise StopIteration
        self.at += 1
        return [self.at - 1, int(torch.randint(1000, (1,)).item())]

    def __iter__(self) -> "Cursor":
        return self

    def state_dict(self) -> dict:
        return {"at": self.at, "g": torch.get_rng_state()}  # torch's generator too, as torchdata's tests do

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]
        torch.set_rng_state(state["g"])


class StateMadeInIter(IterableDataset):
    """Each worker's share of ``0..n-1``, with a random draw each; its position lives in the iterator
    ``__iter__`` returns (the dataset itself keeps none)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[list[int]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        per = self.n // workers
        return Cursor(worker * per, (worker + 1) * per if worker < workers - 1 else self.n)


class CountsEpochs(IterableDataset):
    """Each worker's share of ``0..n-1`` as ``[i, epoch]``; its epoch counter (its state) moves on at the
    end of each pass, as torchdata's tests' ``GeneratorIterable(increment_epoch=True)``."""

    def __init__(self, n: int) -> None:
        self.n, self.epoch = n, 0

    def __iter__(self) -> Iterator[list[int]]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            yield [i, self.epoch]
        self.epoch += 1

    def state_dict(self) -> dict:
        return {"epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        self.epoch = state["epoch"]


class OwnIterator(IterableDataset):
    """A stream that is its own iterator, never rewound: iterated to its end, it yields nothing more."""

    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def __iter__(self) -> "OwnIterator":
        return self

    def __next__(self) -> list[int]:
        if self.at >= self.n:
            raise StopIteration
        self.at += 1
        return [self.at - 1, 0]

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


class SetsUpInIter(IterableDataset):
    """Its own iterator, whose position is set up in ``__iter__`` (each worker's share of ``0..n-1``) and
    exists only from then on, as torchdata's tests' ``CountIterCallsIter``; it counts its ``__iter__``."""

    def __init__(self, n: int) -> None:
        self.n, self.iter_calls = n, 0

    def __iter__(self) -> "SetsUpInIter":
        self.iter_calls += 1
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        per = self.n // workers
        self.cursor = {"at": worker * per, "end": (worker + 1) * per}
        return self

    def __next__(self) -> list[int]:
        if self.cursor["at"] >= self.cursor["end"]:
            raise StopIteration
        self.cursor["at"] += 1
        return [self.cursor["at"] - 1, 0]

    def state_dict(self) -> dict:
        return {"cursor": dict(self.cursor), "iter_calls": self.iter_calls}

    def load_state_dict(self, state: dict) -> None:
        self.cursor = dict(state["cursor"])
