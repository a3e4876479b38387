"""Runs one chaos scenario: its training processes, with deadlines, and the evidence for the checks.

Layout of a scenario's directory::

    ctl/arm, ctl/fired       faults armed for the dataset, and those that fired (see dataset.py)
    ctl/started, ctl/count.* runs started together that began computing; a run's dataset calls (ditto)
    ctl/calls/<pid>.log      every dataset call: index, nonce, version
    ctl/procs/<pid>          every process that built the dataset
    <run>.json, <run>.log    a run's spec and its event log (see trainer.py)
    <run>.err                its stderr (a hang's stacks land there)
    barrier/                 ``ready-<run>`` of each run of a group that starts together (cooperation)
    cache/ or fs/cache/      the loader's prefix (fs/: a tmpfs mounted for a disk-full or read-only scenario)

Runs without ``after`` start together (a concurrent second run); the others start when the
ones before them have ended. Each run is the leader of its own process group, as a job started
from a shell is: a Ctrl-C (SIGINT to the group) reaches its workers too, and a kill of the group
takes the whole job. Before a run starts, the runner does its ``setup`` (``remount-ro``: the
prefix's tmpfs becomes read-only); it arms the kills of a cooperation scenario at the start. After
each group of runs the process, shared-memory and debris checks run at once (with deadlines:
the kernel reaps a killed process's children asynchronously); the data and store checks run at
the end (:mod:`tests.chaos.checks`), the file system made writable again first.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import checks
from .dataset import RUN_NAME  # names the run a process belongs to (the dataset's faults aimed at one run)
from .scenario import TMPFS_SIZE, describe, loader_settings

ROOT = Path(__file__).resolve().parents[2]
#: Seconds a training run may take before it counts as hung (tiny datasets: a few seconds is normal).
RUN_DEADLINE = 90.0
#: Environment variable that marks every process of a run (workers inherit it).
TAG = "CACHESTORE_CHAOS_RUN"


@dataclass
class RunResult:
    name: str
    spec: dict
    pid: int = 0
    returncode: int | None = None
    timed_out: bool = False
    started: float = 0.0
    ended: float = 0.0
    events: list = field(default_factory=list)
    stderr: str = ""
    tag: str = ""
    proc: Any = None
    err_file: Any = None

    @property
    def killed_by(self) -> int | None:
        """The signal that ended the run, if one did."""
        return -self.returncode if self.returncode is not None and self.returncode < 0 else None

    def planned_kill(self) -> int | None:
        kill = self.spec.get("kill")
        return kill["signal"] if kill else None

    @property
    def interrupted(self) -> bool:
        """Ended by Ctrl-C: KeyboardInterrupt reached the top (Python then dies of SIGINT)."""
        return self.killed_by == signal.SIGINT


@dataclass
class ScenarioResult:
    scenario: dict
    problems: list = field(default_factory=list)
    fired: set = field(default_factory=set)  # faults that took effect
    notes: list = field(default_factory=list)
    seconds: float = 0.0
    skipped: str | None = None  # why the scenario could not run (a mount refused)
    directory: str = ""

    @property
    def passed(self) -> bool:
        return not self.problems and self.skipped is None

    @property
    def known_bugs(self) -> list[str]:
        """The known bugs behind the problems, when every problem is one (else empty)."""
        bugs = [checks.known_bug(p) for p in self.problems]
        return sorted(set(bugs)) if bugs and None not in bugs else []

    @property
    def status(self) -> str:
        if self.skipped:
            return "SKIP"
        if self.passed:
            return "ok"
        return "KNOWN" if self.known_bugs else "FAIL"


class Mount:
    """A tmpfs of :data:`TMPFS_SIZE` at `path` (root only); unmounted lazily on exit."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.mounted = False
        self.refused: str | None = None

    def __enter__(self) -> "Mount":
        self.path.mkdir(parents=True, exist_ok=True)
        try:
            subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={TMPFS_SIZE}", "tmpfs", str(self.path)],
                           check=True, capture_output=True, text=True, timeout=30)
            self.mounted = True
        except (OSError, subprocess.SubprocessError) as exc:
            self.refused = (f"mounting a {TMPFS_SIZE} tmpfs is not permitted here "
                            f"({str(getattr(exc, 'stderr', None) or exc).strip()})")
        return self

    def __exit__(self, *exc) -> None:
        if self.mounted:
            subprocess.run(["umount", "-l", str(self.path)], check=False, timeout=30)


def run_scenario(s: dict, workdir: Path, keep: bool = False) -> ScenarioResult:
    """Run scenario `s` under `workdir`; its directory is removed unless it failed or `keep`."""
    result = ScenarioResult(s)
    base = workdir / f"seed-{s['seed']}"
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    result.directory = str(base)
    start = time.monotonic()
    try:
        with Mount(base / "fs") if s["tmpfs"] else _NoMount() as mount:
            if mount.refused:
                result.skipped = mount.refused
                return result
            try:
                _run(s, base, result, mount)
            except Exception:  # a fault of the suite itself: this scenario fails, the others still run
                result.problems.append(f"the chaos runner failed: {traceback.format_exc()}")
    finally:
        result.seconds = time.monotonic() - start
        if result.passed and not keep:
            shutil.rmtree(base, ignore_errors=True)
    return result


class _NoMount:
    refused = None
    mounted = False

    def __enter__(self) -> "_NoMount":
        return self

    def __exit__(self, *exc) -> None:
        pass


def _run(s: dict, base: Path, result: ScenarioResult, mount) -> None:
    ctl = base / "ctl"
    for sub in ("arm", "fired", "calls", "procs"):
        (ctl / sub).mkdir(parents=True)
    disk = base / "fs" if s["tmpfs"] else base
    prefix, rotation_dir = disk / "cache", disk / "rotation"
    paths = checks.Paths(prefix=str(prefix), rotation=str(rotation_dir), ctl=str(ctl), mount=str(disk))
    groups = [[r for r in s["runs"] if r["after"] is None]] + [[r] for r in s["runs"] if r["after"] is not None]
    together = [r["name"] for r in s["runs"] if r.get("barrier")]
    if together:  # their first dataset calls wait for each other (see dataset.py)
        (ctl / "arm" / "together").write_text(" ".join(together))
        (ctl / "started").mkdir()
    for r in s["runs"]:
        how = (r.get("kill") or {}).get("how")
        if how == "commit":  # the first member to reach the drawn commit step is killed
            (ctl / "arm" / "killcommit").touch()
        elif how == "claim":  # the run is killed inside its k-th dataset call
            (ctl / "arm" / f"killrun.{r['name']}").write_text(str(r["kill"]["calls"]))
    done: list[RunResult] = []
    for group in groups:
        runs: list[RunResult] = []
        try:
            for spec in group:
                for kind in spec.get("setup", []):
                    _setup(kind, spec, base, paths)
                runs.append(_start(s, spec, base, paths))
            for run in runs:
                _wait(run)
        finally:
            for run in runs:  # only after an error of our own (or Ctrl-C): nothing may outlive the suite
                if run.proc.poll() is None:
                    run.proc.kill()
                    run.proc.wait(30)
        result.problems += checks.after_group(s, runs, done, paths)
        done += runs
    if s["tmpfs"]:
        from .faults import free_disk, remount

        remount(str(disk), read_only=False)  # a read-only scenario's; nothing else remounts it
        free_disk(str(disk))
    result.problems += checks.after_scenario(s, done, paths)
    result.fired = checks.fired_faults(s, done, paths)
    result.notes += checks.notes(s, done, paths)


def _setup(kind: str, run_spec: dict, base: Path, paths: "checks.Paths") -> None:
    """What happens to the prefix before `run_spec` starts; written first in its event log (the
    checks read it with the run's own actions)."""
    from .faults import remount

    if kind != "remount-ro":
        raise ValueError(f"unknown setup {kind!r}")
    result = remount(paths.mount, read_only=True)
    with open(base / f"{run_spec['name']}.log", "a") as log:
        log.write(json.dumps({"ev": "action", "t": time.time(), "kind": kind, "epoch": -1, "batch": -1,
                              "by": "runner", **result}) + "\n")


def _start(s: dict, run_spec: dict, base: Path, paths: "checks.Paths") -> RunResult:
    name = run_spec["name"]
    spec = {**run_spec, "log": str(base / f"{name}.log"), "ctl": paths.ctl, "mount": paths.mount,
            "store_path": paths.prefix, "deadline": RUN_DEADLINE, "barrier_dir": str(base / "barrier"),
            "loader": loader_settings(s, run_spec, paths.prefix, paths.rotation, paths.ctl)}
    spec_path = base / f"{name}.json"
    spec_path.write_text(json.dumps(spec, indent=1))
    (base / "barrier").mkdir(exist_ok=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           TAG: f"{s['seed']}-{name}-{base}", RUN_NAME: name}
    err = open(base / f"{name}.err", "w")
    run = RunResult(name, spec, started=time.time())
    # Its own process group (a job started from a shell): see the module docstring.
    run.proc = subprocess.Popen([sys.executable, "-m", "tests.chaos.trainer", str(spec_path)], cwd=str(ROOT),
                                env=env, stdout=err, stderr=subprocess.STDOUT, start_new_session=True)
    run.err_file = err
    run.pid = run.proc.pid
    run.tag = env[TAG]
    return run


def _wait(run: RunResult) -> None:
    try:
        run.proc.wait(max(1.0, run.started + RUN_DEADLINE - time.time()))
    except subprocess.TimeoutExpired:
        run.timed_out = True
        run.proc.kill()
        run.proc.wait(30)
    run.ended = time.time()
    run.returncode = run.proc.returncode
    run.err_file.close()
    log = Path(run.spec["log"])
    if log.exists():
        for line in log.read_text().splitlines():
            try:
                run.events.append(json.loads(line))
            except ValueError:
                pass  # the last line of a killed run may be cut
    run.stderr = Path(run.spec["log"]).with_suffix(".err").read_text(errors="replace")


def summary_line(result: ScenarioResult) -> str:
    s = result.scenario
    known = f" (known bug: {', '.join(result.known_bugs)})" if result.known_bugs else ""
    return f"[{result.status:5}] {result.seconds:5.1f}s {describe(s)}{known}"
