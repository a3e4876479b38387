"""A deterministic dataset whose samples say what produced them, with faults armed from outside.

Sample ``i`` is ``{"x": float64[DIM], "y": i}`` with ``x = [i, version, nonce, h_3 .. h_DIM-1]``:
``nonce`` is fresh for every call of ``__getitem__`` (48 random bits) and ``h_k`` a
hash of ``(i, version, nonce, k)``. So a served sample tells

* which index and which dataset ``version`` it claims to be (a stale cache serves an old version),
* which *computation* produced it (the nonce: every call is logged to ``ctl/calls/<pid>.log``,
  so two epochs that serve the same nonce served the same stored record),
* whether its bytes are intact (``h`` must match: a flipped bit served is caught).

Faults are armed by creating a file in ``ctl/arm``: ``raise-<i>`` (``dataset[i]`` raises
:class:`ChaosError`) or ``hang-<i>`` (``dataset[i]`` never returns; in worker processes only,
where the loader's ``timeout`` can end it). Each fires once: the process that computes ``i``
first renames the file into ``ctl/fired`` and writes there where and when. ``killrun.<run>``
(holding a number k) kills run ``<run>`` (its whole process group, SIGKILL) inside the k-th
dataset call its processes make (counted in ``ctl/count.<run>``, a byte a call), whatever the
index: a call the loader makes holding the sample's claim (see ``docs/ARCHITECTURE.md``,
"Writing together"); it fires as ``killrun-<i>-<pid>``. ``together`` (the names of runs started
together) makes each of those runs' first dataset calls wait, at most :data:`TOGETHER_TIMEOUT`
seconds, until every one of them has begun computing (``ctl/started/<run>``): a run whose workers
start slowly would otherwise find every sample computed by the others, and cooperate in nothing.

Every process that builds the dataset (the training process and each worker) leaves
``ctl/procs/<pid>``: the runner checks that all of them are gone after a run.
"""

from __future__ import annotations

import json
import multiprocessing
import os
import signal
import threading
import time

import numpy as np

DIM = 8
_MASK = (1 << 48) - 1
#: Environment variable naming the run a process belongs to (set by the runner, inherited by workers).
RUN_NAME = "CACHESTORE_CHAOS_NAME"
#: Seconds a run's first dataset calls wait for the runs started with it to begin computing too.
TOGETHER_TIMEOUT = 5.0


class ChaosError(Exception):
    """The dataset's own exception; its constructor takes other arguments than a message."""

    def __init__(self, index: int, where: str) -> None:
        super().__init__(f"chaos: sample {index} cannot be read ({where})")
        self.index = index
        self.where = where


def expected_x(index: int, version: int, nonce: int) -> np.ndarray:
    """The ``x`` of sample `index` of dataset `version` computed with `nonce`."""
    x = np.empty(DIM, np.float64)
    x[0], x[1], x[2] = index, version, nonce
    h = (index * 0x9E3779B1 + version * 0x85EBCA77 + nonce) & _MASK
    for k in range(3, DIM):
        h = (h * 0x5DEECE66D + 0xB + k) & _MASK
        x[k] = h
    return x


def check_sample(x: np.ndarray, y: int) -> str | None:
    """Why a served ``(x, y)`` is not a sample the dataset can have produced, or ``None``."""
    if x.shape != (DIM,):
        return f"x has shape {x.shape}"
    index, version, nonce = x[0], x[1], x[2]
    if not (index == int(index) and version == int(version) and nonce == int(nonce) and 0 <= nonce <= _MASK):
        return f"x does not encode a computation: {x[:3].tolist()}"
    if int(index) != y:
        return f"x is sample {int(index)} but y is {y}"
    if not np.array_equal(x, expected_x(int(index), int(version), int(nonce))):
        return f"sample {y}: bytes differ from what the dataset produced (corrupt)"
    return None


class ChaosDataset:
    """See the module docstring. `delay` seconds of sleep per sample make epochs last long enough
    for faults to land in the middle of them."""

    def __init__(self, n: int = 24, version: int = 1, ctl: str = "", delay: float = 0.0) -> None:
        self.n, self.version, self.ctl, self.delay = n, version, ctl, delay
        self._log = None
        self._log_pid = -1
        self._together_done = False
        if ctl:
            me = psutil_start_time()
            with open(os.path.join(ctl, "procs", str(os.getpid())), "w") as f:
                f.write(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "start": me}))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        index = int(index)
        if self.ctl:
            self._fault(index)
        if self.delay:
            time.sleep(self.delay)
        nonce = int.from_bytes(os.urandom(6), "little")
        if self.ctl:
            self._record(index, nonce)
        return {"x": expected_x(index, self.version, nonce), "y": np.int64(index)}

    def _record(self, index: int, nonce: int) -> None:
        if self._log_pid != os.getpid():  # a dataset pickled into another process opens its own log
            self._log = os.open(os.path.join(self.ctl, "calls", f"{os.getpid()}.log"),
                                os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            self._log_pid = os.getpid()
        os.write(self._log, f"{index} {nonce} {self.version}\n".encode())

    def _fault(self, index: int) -> None:
        in_worker = multiprocessing.parent_process() is not None
        run = os.environ.get(RUN_NAME)
        if run and not self._together_done:
            self._together(run)
        if run and self._kill_due(run):
            if self._fire(f"killrun.{run}", "killrun", index, in_worker):
                os.killpg(os.getpgid(0), signal.SIGKILL)  # the run's training process and workers at once
        for kind in ("raise", "hang"):
            if kind == "hang" and not in_worker:
                continue  # nothing could end a hang in the training process (timeout needs workers)
            if not os.path.exists(os.path.join(self.ctl, "arm", f"{kind}-{index}")):
                continue
            if not self._fire(f"{kind}-{index}", kind, index, in_worker):
                continue
            if kind == "raise":
                raise ChaosError(index, f"pid {os.getpid()}")
            threading.Event().wait()  # a read that never returns; only a signal ends it

    def _together(self, run: str) -> None:
        """Wait for the runs started with `run` to begin computing (see the module docstring)."""
        try:
            with open(os.path.join(self.ctl, "arm", "together")) as f:
                names = f.read().split()
        except OSError:
            names = []
        if run in names:
            started = os.path.join(self.ctl, "started")
            open(os.path.join(started, run), "w").close()
            deadline = time.monotonic() + TOGETHER_TIMEOUT
            while not set(names) <= set(os.listdir(started)) and time.monotonic() < deadline:
                time.sleep(0.002)  # polling a directory: there is no event to wait on across unrelated processes
        self._together_done = True

    def _kill_due(self, run: str) -> bool:
        """Whether this call of run `run` is the one its armed ``killrun`` names (or a later one)."""
        try:
            with open(os.path.join(self.ctl, "arm", f"killrun.{run}")) as f:
                due = int(f.read() or 1)
        except (OSError, ValueError):
            return False
        fd = os.open(os.path.join(self.ctl, f"count.{run}"), os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        try:
            os.write(fd, b".")
            return os.fstat(fd).st_size >= due
        finally:
            os.close(fd)

    def _fire(self, armed: str, kind: str, index: int, in_worker: bool) -> bool:
        """Take the armed fault `armed` (``False``: another process took it first) and say where and when."""
        fired = os.path.join(self.ctl, "fired", f"{kind}-{index}-{os.getpid()}")
        try:
            os.rename(os.path.join(self.ctl, "arm", armed), fired)  # exactly one process wins
        except FileNotFoundError:
            return False
        with open(fired, "w") as f:
            f.write(json.dumps({"kind": kind, "index": index, "pid": os.getpid(), "time": time.time(),
                                "in_worker": in_worker}))
        return True


def psutil_start_time() -> float:
    """This process's start time as psutil reports it (tells a pid from a later process reusing it)."""
    import psutil

    return psutil.Process().create_time()


class ChaosStream:
    """:class:`ChaosDataset` as a stream: iterated, never indexed (no ``__getitem__``). Each worker yields
    every ``num_workers``-th sample from its id (torch's ``get_worker_info()``), in index order, each
    computed (and logged, and faulted) as ``ChaosDataset`` computes it."""

    def __init__(self, n: int = 24, version: int = 1, ctl: str = "", delay: float = 0.0,
                 endless: bool = False) -> None:
        self.n, self.version, self.ctl, self.delay = n, version, ctl, delay
        self.endless = endless  # goes round for ever (the loader then caches its first n samples)
        self._samples = ChaosDataset(n, version, ctl, delay)

    def __iter__(self):  # type: ignore[no-untyped-def]
        from torch.utils.data import get_worker_info

        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        while True:
            for index in range(worker, self.n, workers):
                yield self._samples[index]
            if not self.endless:
                return
