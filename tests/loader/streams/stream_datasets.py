"""Streams for the tests: iterable datasets that split their work by worker and count their iterations."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info


def iterations(log: str | bytes | None) -> int:
    """How many times the streams logging to `log` started an iteration (in any process)."""
    return 0 if log is None or not os.path.exists(log) else len(Path(os.fsdecode(log)).read_text().splitlines())


class Counting(IterableDataset):
    """Samples ``0..n-1``, each worker taking every ``num_workers``-th from its id; each ``__iter__`` appends
    a line to `log` (so tests count iterations across processes)."""

    def __init__(self, n: int, log: str | None = None, width: int = 3) -> None:
        # The log as bytes: a file the dataset writes as it runs is bookkeeping, not data, and a path
        # string would count as a data file of the fingerprint (its size changes with every iteration).
        self.n, self.log, self.width = n, None if log is None else os.fsencode(log), width

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        if self.log is not None:
            with open(self.log, "a") as f:
                f.write(f"{os.getpid()} {worker}\n")
        for i in range(worker, self.n, workers):
            yield {"x": np.full((self.width,), i, dtype=np.float32), "i": i}


class Sized(Counting):
    """A stream with ``__len__``, as some IterableDatasets have."""

    def __len__(self) -> int:
        return self.n


class Uneven(IterableDataset):
    """Worker w yields ``sizes[w]`` samples ``(w, k)``: workers run out at different times."""

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        for k in range(self.sizes[worker] if worker < len(self.sizes) else 0):
            yield torch.tensor([worker, k])


class Plain:
    """An iterable that is not a torch dataset: ``__iter__`` and no ``__getitem__``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        return iter(range(worker, self.n, workers))


class Failing(IterableDataset):
    """Raises ``LookupError`` after `after` samples of worker 0's copy."""

    def __init__(self, after: int) -> None:
        self.after = after

    def __iter__(self) -> Iterator[int]:
        for i in range(1000):
            if i == self.after:
                raise LookupError(f"sample {i} is missing")
            yield i


class Endless(IterableDataset):
    """Never ends: ``0, 1, 2, ...``, each worker its own residue class."""

    endless = True

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        i = worker
        while True:
            yield {"i": i}
            i += workers


class Dying(IterableDataset):
    """Worker 1 kills itself (SIGKILL) after `after` samples: a worker lost mid-stream."""

    def __init__(self, n: int, after: int) -> None:
        self.n, self.after = n, after

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for k, i in enumerate(range(worker, self.n, workers)):
            if worker == 1 and k == self.after:
                os.kill(os.getpid(), 9)
            yield i


class Resumable(IterableDataset):
    """:class:`Counting` with its own ``state_dict()``/``load_state_dict()`` (torchdata's ``Stateful``): the
    state is how many samples of its share the copy yielded; ``iter()`` goes on from a loaded one. Each
    sample yielded appends its value to `log` (so tests see that none is yielded twice)."""

    def __init__(self, n: int, log: str) -> None:
        self.n, self.log, self.done = n, os.fsencode(log), 0  # bytes: see Counting

    def state_dict(self) -> dict:
        return {"done": self.done}

    def load_state_dict(self, state: dict) -> None:
        self.done = state["done"]

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        mine = range(worker, self.n, workers)
        while self.done < len(mine):
            i = mine[self.done]
            self.done += 1
            with open(self.log, "a") as f:
                f.write(f"{i}\n")
            yield {"x": np.full((3,), i, dtype=np.float32), "i": i}
        self.done = 0  # the next epoch starts the stream again


def yielded(log: str) -> list[int]:
    """The samples the :class:`Resumable` streams logging to `log` yielded, in any process."""
    return [] if not os.path.exists(log) else [int(v) for v in Path(log).read_text().split()]


class DyingOnce(Counting):
    """:class:`Counting` whose worker 1 kills itself (SIGKILL) after `after` samples, once: the first to
    get there leaves `marker` behind."""

    def __init__(self, n: int, after: int, marker: str) -> None:
        super().__init__(n)
        self.after, self.marker = after, marker

    def __iter__(self) -> Iterator[dict]:
        info = get_worker_info()
        for k, sample in enumerate(super().__iter__()):
            if info is not None and info.id == 1 and k == self.after and not os.path.exists(self.marker):
                Path(self.marker).touch()
                os.kill(os.getpid(), 9)
            yield sample


class Augmented(Counting):
    """:class:`Counting` whose samples carry a random draw of the worker's generator (``"noise"``): each
    iteration of the stream, so each generation written from it, draws anew."""

    def __iter__(self) -> Iterator[dict]:
        for sample in super().__iter__():
            sample["noise"] = float(np.random.random())
            yield sample


class StallsAfterFirst(Counting):
    """:class:`Counting` whose iterations after each worker's first (the ones `log` counts beyond
    `workers` lines) yield two samples, then never end: a background refresh that a close must stop."""

    def __init__(self, n: int, log: str, workers: int) -> None:
        super().__init__(n, log)
        self.workers = workers

    def __iter__(self) -> Iterator[dict]:
        first = iterations(self.log) < self.workers
        for k, sample in enumerate(super().__iter__()):
            if not first and k == 2:
                threading.Event().wait()  # never set: only the worker's end ends it
            yield sample


class FailsOnceArmed(Counting):
    """:class:`Counting` that raises once, in the first iteration to reach its second sample after the file
    `armed` was made (the worker that makes `armed` + ".fired" first raises; no other ever does)."""

    def __init__(self, n: int, log: str, armed: str) -> None:
        super().__init__(n, log)
        self.armed = armed

    def __iter__(self) -> Iterator[dict]:
        for k, sample in enumerate(super().__iter__()):
            if k == 1 and os.path.exists(self.armed):
                try:
                    os.close(os.open(self.armed + ".fired", os.O_CREAT | os.O_EXCL | os.O_WRONLY))
                except FileExistsError:
                    pass
                else:
                    raise RuntimeError("the armed iteration fails")
            yield sample


class Gated(IterableDataset):
    """Samples ``0..n-1``, worker w taking every ``num_workers``-th from w; worker 1 waits for file `gate`
    before each sample (up to a minute), so that only a loader serving out of turn gets worker 0's."""

    def __init__(self, n: int, gate: str) -> None:
        self.n, self.gate = n, os.fsencode(gate)  # bytes: see Counting

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            deadline = time.monotonic() + 60
            while worker == 1 and not os.path.exists(self.gate) and time.monotonic() < deadline:
                time.sleep(0.01)  # the gate is the test's to open
            yield i


class SecondAhead(Gated):
    """:class:`Gated`; once the gate is open, worker 0 waits before each sample (up to a minute) until worker 1
    has begun its `lead`-th (file ``<gate>.lead``): a run resumed then gets worker 1's batches first."""

    def __init__(self, n: int, gate: str, lead: int) -> None:
        super().__init__(n, gate)
        self.lead = lead

    def __iter__(self) -> Iterator[int]:
        info = get_worker_info()
        worker = 0 if info is None else info.id
        lead = self.gate + b".lead"
        for k, i in enumerate(super().__iter__()):
            if worker == 1 and k + 1 == self.lead:
                open(lead, "wb").close()
            deadline = time.monotonic() + 60
            while worker == 0 and os.path.exists(self.gate) and not os.path.exists(lead) and \
                    time.monotonic() < deadline:
                time.sleep(0.01)  # worker 1's to open
            yield i
