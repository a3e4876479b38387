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
``acting``  a fault begins (a kill may land before its ``action``)
``action``  a fault performed, and what it did
``barrier`` every run of its group has built its loader (runs that start together)
``interrupted``  KeyboardInterrupt (Ctrl-C) reached the training loop; the run closes its loader, as a
            ``with`` block would, and ends with it
``closed``  ``loader.close()`` returned
``ctrl-c``  SIGINT sent to the run's process group; ``ctrl-c-lost``: no KeyboardInterrupt came of it

An exception ends its epoch, never the run: the next epoch must work; Ctrl-C ends the
run. The spec is written by :mod:`tests.chaos.runner` from a scenario of :mod:`tests.chaos.scenario`.

The run's kill (``spec["kill"]``) lands in one of three ways (``how``): a timer started at its
moment, which sends the signal wherever the process is then (``timer``, the default; SIGINT goes
to the whole process group, as Ctrl-C in a shell does, maybe twice); inside the run's k-th
dataset call, which holds the sample's claim (``claim``: armed by the runner, fired by the
dataset, see :mod:`tests.chaos.dataset`); or, at a step of a shared commit, in the member that
reaches it first (``commit``, see :func:`kill_in_commit`).
"""

from __future__ import annotations

import faulthandler
import functools
import json
import os
import signal
import sys
import threading
import time
import traceback
from typing import Any

import numpy as np

#: Seconds after the last Ctrl-C by which KeyboardInterrupt must have reached the run.
CTRL_C_GRACE = 3.0


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
            "notes": [str(note)[:1000] for note in getattr(exc, "__notes__", [])],
            "errno": getattr(exc, "errno", None) if isinstance(getattr(exc, "errno", None), int) else None,
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
        self.kill_timer: threading.Timer | None = None  # a timer kill on its way
        self.kill_started = False  # the kill's moment was reached
        self.loader: Any = None

    # faults ------------------------------------------------------------------
    def act(self, epoch: int, batch: int) -> None:
        if (self.kill is not None and not self.kill_started and self.kill.get("how", "timer") == "timer"
                and (epoch, batch) >= (self.kill["epoch"], self.kill["batch"])):
            self.start_kill()
        while self.actions and (self.actions[0]["epoch"], self.actions[0]["batch"]) <= (epoch, batch):
            self.perform(self.actions.pop(0), epoch, batch)

    def start_kill(self) -> None:
        """The training process is killed a moment from now, wherever it is then (loader code included)."""
        self.kill_started = True
        sig, delay = self.kill["signal"], self.kill["delay"]
        self.log.write("action", kind="kill-self", signal=sig, delay=delay, again=self.kill.get("again"))
        target = self.interrupt if sig == signal.SIGINT else functools.partial(os.kill, os.getpid(), sig)
        self.kill_timer = threading.Timer(delay, target)
        self.kill_timer.daemon = True
        self.kill_timer.start()

    def interrupt(self) -> None:
        """Ctrl-C in the run's terminal: SIGINT to its process group (workers included), maybe twice."""
        self.log.write("ctrl-c")
        os.killpg(os.getpgid(0), signal.SIGINT)
        again = self.kill.get("again")
        if again is not None:
            time.sleep(again)  # the fault is the interval between two key presses
            self.log.write("ctrl-c")
            os.killpg(os.getpgid(0), signal.SIGINT)

    def perform(self, action: dict, epoch: int, batch: int) -> None:
        from . import faults

        kind, result = action["kind"], {}
        ctl = self.spec["ctl"]
        self.log.write("acting", kind=kind, epoch=epoch, batch=batch)  # a kill may land before it is done
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
        elif kind == "rm-prefix":
            result = {"t_start": time.time(), **faults.rm_prefix(self.spec["store_path"])}
        elif kind == "remount-ro":
            result = faults.remount(self.spec["mount"], read_only=True)
        elif kind == "prune":
            t0 = time.time()
            result = faults.prune_all(self.spec["store_path"], action["how"])
            result["t_start"] = t0
        self.log.write("action", kind=kind, epoch=epoch, batch=batch, planned=action, **result)

    def barrier(self) -> None:
        """Wait until every run of the group has built its loader (at most 60 s), so that they really
        write together; the runs' tiny epochs would otherwise be over before the next run started."""
        count = self.spec.get("barrier")
        if not count:
            return
        where = self.spec["barrier_dir"]
        open(os.path.join(where, f"ready-{self.spec['name']}"), "w").close()
        deadline = time.monotonic() + 60
        while len(os.listdir(where)) < count and time.monotonic() < deadline:
            time.sleep(0.005)  # polling a directory: there is no event to wait on across unrelated processes
        self.log.write("barrier", ready=len(os.listdir(where)), of=count)

    # the run -------------------------------------------------------------------
    def main(self) -> None:
        self.log.write("start", pid=os.getpid())
        self.epoch = -1
        try:
            self.epochs()
        except KeyboardInterrupt:
            # What `with CachedLoader(...) as loader:` around the loop does on the way out; a second
            # Ctrl-C may cut this short (the loader is then released at exit).
            self.log.write("interrupted", epoch=self.epoch)
            if self.loader is not None:
                self.loader.close()
                self.log.write("closed")
            raise

    def epochs(self) -> None:
        from loader import CachedLoader

        from .dataset import ChaosDataset, ChaosStream, check_sample

        spec = self.spec
        if self.kill is not None and self.kill.get("how") == "commit":
            kill_in_commit(self.kill["stage"], spec["ctl"], self.log)
        kwargs = dict(spec["loader"])
        params = kwargs.pop("dataset_params")
        dataset = ChaosStream if kwargs.pop("stream", False) else ChaosDataset
        try:
            self.loader = CachedLoader(dataset, params, **kwargs)
        except Exception as exc:
            self.log.write("error", epoch=-1, **describe_error(exc))
            self.barrier()
            self.finish()
            return
        self.barrier()
        loader = self.loader
        for epoch in range(spec["epochs"]):
            self.epoch = epoch
            self.log.write("epoch", epoch=epoch, loader_epoch=loader.epoch)
            self.act(epoch, -1)
            completed, number, batch = False, 0, None
            it = None
            while True:
                t0 = time.monotonic()
                try:
                    if it is None:
                        it = iter(loader)  # the loader opens its store at its first iter(): a full disk fails here
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
        if self.kill is not None and not self.kill_started and self.kill.get("how", "timer") == "timer":
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
            if self.kill["signal"] != signal.SIGINT:
                threading.Event().wait()
            # Ctrl-C: KeyboardInterrupt comes within moments of the last key press, unless something
            # swallowed it (a finalizer that ignores exceptions); then the run ends by itself, and says so.
            self.kill_timer.join()
            threading.Event().wait(CTRL_C_GRACE)
            self.log.write("ctrl-c-lost")


def kill_in_commit(stage: str, ctl: str, log: EventLog) -> None:
    """Make this process SIGKILL its process group at step `stage` of a shared commit
    (:data:`tests.chaos.scenario.COMMIT_STAGES`), if it is the first member of the scenario to get
    there (it renames ``ctl/arm/killcommit`` into ``ctl/fired``). The steps are reached through
    the names ``cachestore.write.shared`` calls; an exclusive writer's commit is left alone."""
    import cachestore.write.shared as shared
    from cachestore.backends.directory import DirectoryBackend
    from cachestore.backends.staging import parse_shared

    def fire(generation: int, where: str) -> None:
        fired = os.path.join(ctl, "fired", f"killcommit-{generation}-{os.getpid()}")
        try:
            os.rename(os.path.join(ctl, "arm", "killcommit"), fired)
        except FileNotFoundError:
            return  # another member was killed already
        with open(fired, "w") as f:
            f.write(json.dumps({"kind": "killcommit", "index": generation, "pid": os.getpid(), "time": time.time(),
                                "stage": where}))
        log.write("action", kind="kill-in-commit", stage=where, generation=generation)
        os.killpg(os.getpgid(0), signal.SIGKILL)

    if stage == "marked":
        mark = shared.mark_committing

        def marked(staging):
            mark(staging)
            fire(parse_shared(os.path.basename(staging)) or 0, stage)
        shared.mark_committing = marked
    elif stage == "canonical":
        keep = shared.SharedWriter._keep_canonical

        def canonical(self):
            keep(self)
            fire(self.generation, stage)
        shared.SharedWriter._keep_canonical = canonical
    else:
        commit = DirectoryBackend.commit

        def publish(self, token, num_samples, extra):
            if token.shared and stage == "before-publish":
                fire(token.generation, stage)
            info = commit(self, token, num_samples, extra)
            if token.shared and stage == "published":
                fire(token.generation, stage)
            return info
        DirectoryBackend.commit = publish


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
