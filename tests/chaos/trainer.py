"""One training run of a chaos scenario, in its own process: ``python -m tests.chaos.trainer SPEC.json``.

It builds the loader, iterates the run's epochs, performs the faults of the run at their
moments (``after batch b of epoch e``; ``b = -1``: before the epoch's first batch), and
writes what happened as JSON lines to the spec's ``log``, one flushed line per event, so
that a run killed half-way leaves an exact record of what it had been served:

``start``   pid, time
``epoch``   an epoch begins
``batch``   the indices, versions and nonces served, what is wrong with any sample, the wait
``error``   an exception ended the epoch: type, message, the attributes the checks look at
``stats``   the loader's ``epoch_stats`` entry of the epoch, and whether it ran to its end
``action``  a fault performed, and what it did
``closed``  ``loader.close()`` returned

An exception ends its epoch, never the run: the next epoch must work (issue 12). The spec
is written by :mod:`tests.chaos.runner` from a scenario of :mod:`tests.chaos.scenario`.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np


class EventLog:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    def write(self, event: str, **fields: Any) -> None:
        line = json.dumps({"ev": event, "t": time.time(), **fields}, default=_plain) + "\n"
        os.write(self.fd, line.encode())


def _plain(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return str(value)


def describe_error(exc: BaseException) -> dict:
    """What the checks need to know about an exception raised by the loader."""
    return {"type": f"{type(exc).__module__}.{type(exc).__qualname__}",
            "mro": [f"{c.__module__}.{c.__qualname__}" for c in type(exc).__mro__],
            "message": str(exc)[:2000],
            "index": getattr(exc, "index", None) if isinstance(getattr(exc, "index", None), int) else None,
            "sample_index": getattr(exc, "sample_index", None),
            "indices": getattr(exc, "indices", None),
            "pid": getattr(exc, "pid", None),
            "traceback": "".join(traceback.format_exception(exc))[-4000:]}


def stats_of(loader: Any, epoch: int) -> dict | None:
    for s in reversed(loader.epoch_stats):
        if s.epoch == epoch:
            return {"mode": getattr(s.mode, "value", str(s.mode)), "generation": s.generation, "samples": s.samples, "batches": s.batches,
                    "computed": s.computed, "read": s.read, "written": s.written, "committed": s.committed,
                    "extra": {k: str(v) for k, v in s.extra.items()}}
    return None


class Run:
    """The run of one spec (see the module docstring)."""

    def __init__(self, spec: dict) -> None:
        self.spec = spec
        self.log = EventLog(spec["log"])
        self.actions = list(spec["actions"])
        self.kill = spec.get("kill")
        self.kill_timer: threading.Timer | None = None
        self.loader: Any = None

    # faults ------------------------------------------------------------------
    def act(self, epoch: int, batch: int) -> None:
        if self.kill is not None and self.kill_timer is None and (epoch, batch) >= (self.kill["epoch"],
                                                                                   self.kill["batch"]):
            self.start_kill()
        while self.actions and (self.actions[0]["epoch"], self.actions[0]["batch"]) <= (epoch, batch):
            self.perform(self.actions.pop(0), epoch, batch)

    def start_kill(self) -> None:
        """The training process is killed a moment from now, wherever it is then (loader code included)."""
        sig, delay = self.kill["signal"], self.kill["delay"]
        self.log.write("action", kind="kill-self", signal=sig, delay=delay)
        self.kill_timer = threading.Timer(delay, os.kill, (os.getpid(), sig))
        self.kill_timer.daemon = True
        self.kill_timer.start()

    def perform(self, action: dict, epoch: int, batch: int) -> None:
        from . import faults

        kind, result = action["kind"], {}
        ctl = self.spec["ctl"]
        if kind == "kill-worker":
            pids = self.loader.worker_pids()
            if pids:
                pid = pids[action["which"] % len(pids)]
                os.kill(pid, signal.SIGKILL)
                result = {"pid": pid}
            else:
                result = {"pid": None}
        elif kind in ("arm-raise", "arm-hang"):
            name = f"{kind[4:]}-{action['index']}"
            open(os.path.join(ctl, "arm", name), "w").close()
        elif kind == "flip":
            result = faults.flip_records(self.spec["store_path"], action["count"], action["seed"])
        elif kind == "fill-disk":
            faults.fill_disk(self.spec["mount"])
        elif kind == "free-disk":
            faults.free_disk(self.spec["mount"])
        self.log.write("action", kind=kind, epoch=epoch, batch=batch, planned=action, **result)

    # the run -------------------------------------------------------------------
    def main(self) -> None:
        from loader import CachedLoader

        from .dataset import ChaosDataset, check_sample

        spec = self.spec
        self.log.write("start", pid=os.getpid())
        kwargs = dict(spec["loader"])
        params = kwargs.pop("dataset_params")
        try:
            self.loader = CachedLoader(ChaosDataset, params, **kwargs)
        except Exception as exc:
            self.log.write("error", epoch=-1, **describe_error(exc))
            self.finish()
            return
        loader = self.loader
        for epoch in range(spec["epochs"]):
            self.log.write("epoch", epoch=epoch, loader_epoch=loader.epoch)
            self.act(epoch, -1)
            completed, number, batch = False, 0, None
            it = iter(loader)
            while True:
                t0 = time.monotonic()
                try:
                    batch = next(it)
                except StopIteration:
                    completed = True
                    break
                except Exception as exc:
                    self.log.write("error", epoch=epoch, wait=round(time.monotonic() - t0, 4), **describe_error(exc))
                    break
                wait = time.monotonic() - t0
                x, y = np.asarray(batch["x"]), np.asarray(batch["y"])
                bad = [problem for xi, yi in zip(x, y.tolist()) if (problem := check_sample(xi, yi))]
                self.log.write("batch", epoch=epoch, b=number, y=y.tolist(), v=x[:, 1].astype(np.int64).tolist(),
                               nonce=x[:, 2].astype(np.int64).tolist(), bad=bad[:5], wait=round(wait, 4))
                batch = x = y = None  # a batch keeps its shared-memory slot
                self.act(epoch, number)
                number += 1
            it = None
            self.log.write("stats", epoch=epoch, completed=completed, stats=stats_of(loader, epoch))
        if self.kill is not None and self.kill_timer is None:
            self.start_kill()  # the moment was not reached: now, while the loader is closed
        self.finish()

    def finish(self) -> None:
        if self.loader is not None:
            self.loader.close()
        for action in self.actions:
            self.log.write("action", kind=action["kind"], planned=action, skipped=True)
        self.log.write("closed")
        if self.kill_timer is not None:
            # The signal is on its way: wait for it (the runner's deadline bounds this).
            threading.Event().wait()


def main(argv: list[str]) -> int:
    with open(argv[0]) as f:
        spec = json.load(f)
    # A hang of the run itself (the loader waiting forever) leaves the stacks in stderr before the
    # runner's deadline kills it.
    faulthandler.dump_traceback_later(spec["deadline"] - 5, exit=False)
    Run(spec).main()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
