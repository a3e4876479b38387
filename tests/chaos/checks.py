"""What must hold after a chaos scenario, each check returning the problems it found.

After every group of runs (:func:`after_group`):

* a run ends by itself (exit 0, loader closed), or by the signal the scenario sent it;
  never by the runner's deadline (a hang); a Ctrl-C that reached the run ends it (KeyboardInterrupt);
* no process of the run is left (workers included, found by the environment variable they
  inherit), no shared-memory slot of it (``/dev/shm`` file or memfd held anywhere);
* no lock, staging directory, temp file or rotation window is left under the prefix once the
  runs have closed (a run ended by Ctrl-C closed too, and runs that outlived a member killed
  holding claims wrote on without it); after another killed run, once the next run on the
  prefix has closed; a shared staging area nobody is a member of is a partial generation
  (not debris) only when it names the store's producer and no commit of it began;
* after a killed or interrupted run, the generation committed before it is still there and verifies.

After the scenario (:func:`after_scenario`):

* every served sample is one the dataset produced, intact, of the run's dataset version;
* every index exactly once per completed epoch (R times in a rotation epoch, one computation
  served R times), never twice in any epoch;
* a generation serves the same computation of an index in every epoch that reads it (unless
  its record was flipped: then a fresh one), and no computation is served under two
  generations (a stale generation, or a fresh epoch serving stored samples);
* each exception is one the faults explain - the dataset's own type with its index, a
  ``WorkerTimeoutError`` naming the stuck worker and index, a ``BudgetExceededError`` on a
  full disk under ``on_budget_exceeded="error"``, a ``StoreLockedError`` beside a concurrent
  run that cannot write with it (lmdb; a memmap run joins the writers instead), a
  ``GenerationNotFoundError`` in a read epoch whose generation was removed meanwhile (a prune,
  ``rm -rf``, another run's newer commit) with the loader's note saying so, the
  ``CacheStoreError`` of a write into a prefix removed meanwhile, a read-only error where nothing
  committed could be read - and every exception the dataset raised reaches the training loop;
* no wait for a batch longer than the bound (``timeout`` + slack, or :data:`WAIT_BOUND`);
* processes writing one memmap generation together commit it once (again only after it was
  removed), and every run serves the same computation of a sample under it, whichever run computed it; a run on a file system remounted read-only before it started serves committed
  generations and calls the dataset for nothing (but records flipped on purpose);
* ``Store.verify()`` finds nothing but the records flipped on purpose, and
  ``cachestore inspect --verify`` agrees; after a commit killed half-way, the next run still ends
  with a committed generation.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import signal
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import psutil

#: Seconds any batch may take without a hang (tiny datasets; worker start-up included).
WAIT_BOUND = 30.0
#: Slack over ``timeout`` for the stack dump of the stuck worker and stopping the workers.
TIMEOUT_SLACK = 8.0
#: Seconds for the kernel to take a killed run's processes and memory away.
REAP_DEADLINE = 15.0

CHAOS_ERROR = "tests.chaos.dataset.ChaosError"
TIMEOUT_ERROR = "loader.errors.WorkerTimeoutError"
WORKER_ERROR = "loader.errors.WorkerError"
BUDGET_ERROR = "cachestore.errors.BudgetExceededError"
LOCKED_ERROR = "cachestore.errors.StoreLockedError"
NOT_FOUND_ERROR = "cachestore.errors.GenerationNotFoundError"
STORE_ERROR = "cachestore.errors.CacheStoreError"
CORRUPT_ERROR = "cachestore.errors.CorruptSampleError"
#: What the store and the loader say of a write into a generation whose files went away (a worker's write:
#: loader/executors/producer.py; a commit: cachestore/guard/safefs.py, lmdb_backend.py).
WRITE_REMOVED = r"was the cache directory removed while it was written|staging area \S+ is gone"
#: The note the loader adds to a GenerationNotFoundError of a read epoch (loader/epochs/runner.py).
READ_REMOVED = "was removed while epoch"
#: How an OSError of a read-only file system reads (EROFS).
EROFS_TEXT = "Read-only file system"
#: What a loader opened on a read-only file system says when it holds nothing committed (controller.py).
READ_ONLY_EMPTY = ("read-only file system and holds no cache", "its file system is read-only")
#: What a debris problem adds when no run of its group wrote the store (the debris is a killed run's).
READ_ONLY = "no run of this group wrote the store"

#: What a debris problem says of a staging area a run that closed normally left of its own.
OWN_STAGING = "its own staging area outlived close()"
STAGING = ".staging"
STAGING_META = "staging.json"

#: Bugs the suite found, each a strict xfail in test_regressions.py: id -> (what a problem it causes
#: says, the bug in a line). A failing scenario whose problems all match is reported as a known bug.
KNOWN_BUGS: dict[str, tuple[str, str]] = {}  # none today: each one found is fixed in test_regressions.py


def known_bug(problem: str) -> str | None:
    """The id of the known bug `problem` shows, or ``None``."""
    return next((bug for bug, (pattern, _) in KNOWN_BUGS.items() if re.search(pattern, problem, re.S)), None)


#: What a WorkerTimeoutError says of a worker that was still starting (spawned) when the timeout expired.
STARTING = "the worker had not finished starting"


@dataclass(frozen=True)
class Paths:
    prefix: str
    rotation: str
    ctl: str
    mount: str


def wait_until(condition: Callable[[], Any], seconds: float) -> Any:
    """`condition()` once it is true, polled until `seconds` pass; its last (false) value otherwise."""
    deadline = time.monotonic() + seconds
    while True:
        value = condition()
        if value or time.monotonic() >= deadline:
            return value
        time.sleep(0.05)  # polling a condition under a deadline, not synchronising by sleeping


# ------------------------------------------------------------------------------------------ evidence
@dataclass
class Epoch:
    run: str
    epoch: int
    version: int
    t_start: float
    t_end: float = 0.0
    # When its last batch came: a generate epoch commits after it, before its end is recorded (which
    # waits for the workers a run that will not write again retires).
    t_last: float = 0.0
    served: list = field(default_factory=list)  # (index, version, nonce)
    batches: list = field(default_factory=list)  # the same, batch by batch
    bad: list = field(default_factory=list)
    waits: list = field(default_factory=list)
    error: dict | None = None
    stats: dict | None = None
    completed: bool = False

    @property
    def mode(self) -> str | None:
        return self.stats["mode"] if self.stats else None

    @property
    def generation(self) -> int | None:
        return self.stats["generation"] if self.stats else None


def epochs_of(run) -> list[Epoch]:
    out: list[Epoch] = []
    version = run.spec["version"]
    for ev in run.events:
        kind = ev["ev"]
        if kind == "epoch":
            out.append(Epoch(run.name, ev["epoch"], version, ev["t"], ev["t"]))
        elif not out:
            continue
        elif kind == "batch":
            e = out[-1]
            e.batches.append(list(zip(ev["y"], ev["v"], ev["nonce"])))
            e.served += e.batches[-1]
            e.bad += ev["bad"]
            e.waits.append(ev["wait"])
            e.t_end = e.t_last = ev["t"]
        elif kind == "error" and ev["epoch"] >= 0:
            out[-1].error, out[-1].t_end = ev, ev["t"]
        elif kind == "stats":
            out[-1].stats, out[-1].completed, out[-1].t_end = ev["stats"], ev["completed"], ev["t"]
    return out


def errors_of(run) -> list[dict]:
    return [ev for ev in run.events if ev["ev"] == "error"]


def actions_of(runs, kind: str) -> list[tuple[Any, dict]]:
    return [(run, ev) for run in runs for ev in run.events
            if ev["ev"] == "action" and ev["kind"] == kind and not ev.get("skipped")]


def windows_of(runs, kind: str) -> list[tuple[float, float]]:
    """(start, end) of each fault `kind` the runs began: from its ``acting`` event to its ``action`` event,
    or to the end of its run when a kill landed in between."""
    out = []
    for run in runs:
        start = None
        for ev in run.events:
            if ev.get("kind") != kind:
                continue
            if ev["ev"] == "acting":
                start = ev["t"]
            elif ev["ev"] == "action" and not ev.get("skipped"):
                out.append((ev["t"] if start is None else start, ev["t"]))
                start = None
        if start is not None:
            out.append((start, run.ended or time.time()))
    return out


def read_calls(ctl: str) -> dict[int, dict[int, int]]:
    """index -> {nonce: version} of every dataset call."""
    calls: dict[int, dict[int, int]] = defaultdict(dict)
    for path in Path(ctl, "calls").glob("*.log"):
        for line in path.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                calls[int(parts[0])][int(parts[1])] = int(parts[2])
    return calls


def read_fired(ctl: str) -> list[dict]:
    out = []
    for path in sorted(Path(ctl, "fired").iterdir()):
        kind, index, pid = path.name.split("-")
        try:
            info = json.loads(path.read_text())
        except ValueError:  # renamed, then its process was killed before it wrote
            info = {"time": path.stat().st_mtime}
        out.append({"kind": kind, "index": int(index), "pid": int(pid), "time": info["time"]})
    return out


def owner_run(pid: int, runs, ctl: str) -> Any:
    """The run a process belonged to (itself, or the training process that started it)."""
    for run in runs:
        if run.pid == pid:
            return run
    try:
        ppid = json.loads(Path(ctl, "procs", str(pid)).read_text())["ppid"]
    except (OSError, ValueError, KeyError):
        return None
    return next((run for run in runs if run.pid == ppid), None)


# ------------------------------------------------------------------------------------------ after each group
def tagged_processes(tag: str) -> list[str]:
    """Live processes whose environment carries `tag` (a run's training process and its workers)."""
    found = []
    for proc in psutil.process_iter():
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                continue
            if proc.environ().get("CACHESTORE_CHAOS_RUN") == tag:
                found.append(f"pid {proc.pid} ({' '.join(proc.cmdline())[:100]})")
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def _in_partial_generation(path: str) -> bool:
    """Whether `path` is, or is inside, a staging area kept with its record for the next run."""
    parts = path.split(os.sep)
    for k, part in enumerate(parts):
        if part.startswith(STAGING) and os.path.isfile(os.sep.join(parts[:k + 1] + [STAGING_META])):
            return True
    return False


def debris(paths: Paths) -> list[str]:
    """Locks, staging areas, temp files and rotation windows anywhere under the prefixes."""
    from tests.loader.conftest import leftovers

    found = []
    for root in (paths.prefix, paths.rotation):
        if os.path.isdir(root):
            # A staging area with its record is a partial generation kept for the next run of the same
            # dataset (it adopts it; another dataset's writer or `prune --partial` removes it): not debris.
            found += [path for path in leftovers(root) if not _in_partial_generation(path)]
            for dirpath, dirnames, _ in os.walk(root):
                found += [os.path.join(dirpath, d) for d in dirnames if d.startswith("rotation-")]
    found += shared_debris(paths.prefix)
    return sorted(found)


def shared_debris(prefix: str) -> list[str]:
    """Shared staging areas (``.shared-<g>-<hash>``, see ``docs/ARCHITECTURE.md``, "Writing together") that
    are no partial generation, and their members' lock files without an area.

    With no member left, an area is a partial generation of the store's producer when its record
    names the store's fingerprint and no commit of it began (``committing``); one of another
    producer, or of a commit cut short, is debris. (:func:`tests.loader.conftest.leftovers` lists
    the ``.shared-tmp-*`` names.)"""
    from cachestore import open_store
    from cachestore.backends.staging import MEMBERS_SUFFIX, has_members, parse_shared, staging_record
    from cachestore.errors import CacheStoreError

    if not os.path.isdir(prefix):
        return []
    try:
        with open_store(prefix, readonly=True) as store:
            mine = (store.partial_record() or {}).get("fingerprint")
    except CacheStoreError:
        mine = None  # no store.json (a prefix removed and not written since): any area is debris
    found = []
    for name in sorted(os.listdir(prefix)):
        path = os.path.join(prefix, name)
        if name.endswith(MEMBERS_SUFFIX) and parse_shared(name[:-len(MEMBERS_SUFFIX)]) is not None:
            if not os.path.isdir(path[:-len(MEMBERS_SUFFIX)]) and not has_members(path[:-len(MEMBERS_SUFFIX)]):
                found.append(f"{path} (the lock file of no area)")
            continue
        if parse_shared(name) is None or has_members(path):
            continue
        record = staging_record(Path(path))
        if record is None or not record.get("shared"):
            found.append(f"{path} (no producer record)")
        elif record.get("committing"):
            found.append(f"{path} (a commit cut short)")
        elif mine is None or record.get("fingerprint") != mine:
            found.append(f"{path} (of another producer)")
    return found


def after_group(s: dict, runs: list, before: list, paths: Paths) -> list[str]:
    from tests.loader.conftest import segments_of

    problems: list[str] = []
    for run in runs:
        planned = run.planned_kill()
        tail = "\n    ".join(run.stderr.strip().splitlines()[-25:])
        if run.timed_out:
            problems.append(f"{run.name}: did not end within its deadline (a hang); its stderr:\n    {tail}")
        elif run.killed_by is not None and run.killed_by != planned:
            problems.append(f"{run.name}: died of signal {run.killed_by} (the scenario sent {planned}); "
                            f"stderr:\n    {tail}")
        elif run.killed_by is None and planned == signal.SIGINT and actions_of([run], "kill-self"):
            ignored = re.search(r"Exception ignored in: (.*)\n(?:.*\n)*?KeyboardInterrupt", run.stderr)
            why = (f" (the KeyboardInterrupt was raised inside {ignored.group(1).strip()}, which ignored it; "
                   f"{'during close()' if _in_close(run) else 'outside close()'})" if ignored else "")
            problems.append(f"{run.name}: Ctrl-C did not end the run{why}; stderr:\n    {tail}")
        elif run.killed_by is None and run.returncode != 0:
            problems.append(f"{run.name}: exited with status {run.returncode}; stderr:\n    {tail}")
        elif run.killed_by is None and not any(ev["ev"] == "closed" for ev in run.events):
            problems.append(f"{run.name}: ended without closing its loader")
        elif run.interrupted and "KeyboardInterrupt" not in run.stderr:
            problems.append(f"{run.name}: died of SIGINT without a KeyboardInterrupt; stderr:\n    {tail}")
        left = wait_until(lambda: tagged_processes(run.tag) == [] or None, REAP_DEADLINE)
        if left is None:
            problems.append(f"{run.name}: processes left {REAP_DEADLINE:.0f} s after the run ended: "
                            f"{tagged_processes(run.tag)}")
        if wait_until(lambda: not segments_of(run.pid), REAP_DEADLINE) is False:
            problems.append(f"{run.name}: shared-memory slots of pid {run.pid} left: {segments_of(run.pid)}")
    # A run ended by Ctrl-C closed its loader (KeyboardInterrupt unwinds through close()): no excuse, unless
    # the Ctrl-C cut a commit short (like a kill inside a commit: the next run removes what it left).
    killed = [run for run in runs if run.killed_by is not None and (not run.interrupted
                                                                    or ctrl_c_inside(run) == "a commit")]
    # Runs that wrote with a member killed holding claims, and closed after it, leave nothing either: the
    # kernel dropped its claims and membership, and the last member out committed or kept the area.
    survivors = [run for run in runs if run not in killed]
    outlived = (killed and survivors and all((r.spec.get("kill") or {}).get("how") == "claim" for r in killed)
                and min(r.ended for r in survivors) > max(r.ended for r in killed))
    if (not killed or outlived) and not read_only_now(paths):
        left = debris(paths)
        in_generations = [path for path in left if re.search(r"/gen-\d+/[^/]*\.tmp$", path)]
        left = [path for path in left if path not in in_generations]
        who = ", ".join(r.name for r in runs)
        if in_generations:
            problems.append(f"after {who} closed: temp files inside committed generations: {in_generations}")
        own = [path for path in left for run in runs if f"{STAGING}-" in path and f"-{run.pid}-" in path]
        left = [path for path in left if path not in own]
        if own:
            problems.append(f"after {who} closed: {OWN_STAGING}: {own}")
        if left:
            wrote = any(e.mode == "generate" for run in runs for e in epochs_of(run))
            full = " (the disk filled during these runs)" if actions_of(runs, "fill-disk") else ""
            cut = "".join(f" (a Ctrl-C cut {r.name}'s close() short)" for r in runs if ctrl_c_inside(r) == "close()")
            problems.append(f"after {who} closed: left under the prefix: {left}"
                            + ("" if wrote else f" ({READ_ONLY})") + full + cut)
    if (killed or any(run.interrupted for run in runs)) and s["mode"] == "cache" and s["backend"] != "memory":
        problems += intact_after_kill(s, before + runs, paths)
    return problems


def ctrl_c_inside(run) -> str | None:
    """Where the KeyboardInterrupt that ended `run` was raised, when it matters: inside the loader's
    ``close()`` (whose clean-up holds Ctrl-C back until it is done), or inside a commit."""
    if not run.interrupted:
        return None
    last = run.stderr[run.stderr.rfind("Traceback (most recent call last)"):]
    if re.search(r'loader/(api|resources)\.py", line \d+, in (close|release)\n', last):
        return "close()"
    if re.search(r'cachestore/[\w/]+\.py", line \d+, in commit\n', run.stderr):
        return "a commit"
    return None


def _in_close(run) -> bool:
    """Whether the run's Ctrl-C was sent while it closed its loader (after its last epoch's stats)."""
    sent = [ev["t"] for ev in run.events if ev["ev"] == "ctrl-c"]
    last = max((ev["t"] for ev in run.events if ev["ev"] == "stats"), default=0.0)
    closed = [ev["t"] for ev in run.events if ev["ev"] == "closed"]
    return bool(sent and closed and any(last <= t <= closed[0] for t in sent))


def read_only_now(paths: Paths) -> bool:
    """Whether the prefix's file system is mounted read-only now (nothing can be cleaned up there)."""
    probe = paths.prefix if os.path.exists(paths.prefix) else paths.mount
    try:
        return bool(os.statvfs(probe).f_flag & os.ST_RDONLY)
    except OSError:
        return False


def intact_after_kill(s: dict, runs: list, paths: Paths) -> list[str]:
    """The generation committed before a killed run is still there, and verifies."""
    from cachestore import open_store
    from cachestore.errors import CacheStoreError

    committed = [e.generation for run in runs for e in epochs_of(run)
                 if e.stats and e.stats["committed"] and e.mode == "generate"]
    if not committed:
        return []
    if windows_of(runs, "rm-prefix") and not os.path.exists(os.path.join(paths.prefix, "store.json")):
        return []  # removed on purpose
    try:
        with open_store(paths.prefix, readonly=True) as store:
            latest = store.latest()
            errors = store.verify()
    except CacheStoreError as exc:
        return [f"after the kill the store cannot be opened: {exc}"]
    problems = []
    removing = ("disk-full", "coop-disk-full", "prune-live", "rm-prefix")
    if not any(f in s["faults"] for f in removing) and (latest is None or latest < max(committed)):
        problems.append(f"after the kill the newest committed generation is {latest}, but generation "
                        f"{max(committed)} had been committed before")
    allowed = live_flips(runs, paths)
    bad = [e for e in errors if (e.generation, e.index) not in allowed]
    if bad:
        problems.append(f"after the kill the store does not verify: {[str(e)[:200] for e in bad[:3]]}")
    return problems


# ------------------------------------------------------------------------------------------ after the scenario
def after_scenario(s: dict, runs: list, paths: Paths) -> list[str]:
    problems: list[str] = []
    calls = read_calls(paths.ctl)
    epochs = [e for run in runs for e in epochs_of(run)]
    problems += check_samples(epochs, calls)
    problems += check_counts(s, epochs)
    problems += check_generations(s, runs, paths)
    problems += check_errors(s, runs, paths)
    problems += check_waits(s, runs)
    problems += check_stats(s, runs)
    if s["mode"] == "cache" and s["backend"] != "memory":
        problems += check_commits(s, runs)
        problems += check_shared_content(s, runs, paths)
        problems += check_read_only_runs(s, runs, paths)
        problems += check_after_killed_commit(s, runs, paths)
        problems += check_store(runs, paths)
    return problems


def check_samples(epochs: list[Epoch], calls: dict) -> list[str]:
    """Every served sample is intact, of the run's version, and produced by a logged dataset call."""
    problems = []
    for e in epochs:
        where = f"{e.run} epoch {e.epoch} ({e.mode}, generation {e.generation})"
        if e.bad:
            problems.append(f"{where}: served corrupt samples: {e.bad[:3]}")
        stale = [(i, v) for i, v, _ in e.served if v != e.version]
        if stale:
            problems.append(f"{where}: served samples of dataset version {stale[0][1]} to a run of version "
                            f"{e.version} (stale): indices {[i for i, _ in stale[:8]]}")
        unknown = [(i, n) for i, _, n in e.served if n not in calls.get(i, {})]
        if unknown:
            problems.append(f"{where}: served samples no dataset call produced: {unknown[:3]}")
    return problems


def expected_repeats(s: dict) -> int:
    """Times a rotation epoch serves each sample (the fallback of "rotate" uses K, or 4)."""
    if s["mode"] == "rotation":
        return s["rotation"]
    return s["K"] or 4


def check_counts(s: dict, epochs: list[Epoch]) -> list[str]:
    problems = []
    n = s["n"]
    rotating: set[str] = set()  # runs that rotate (from the start, or since "rotate" switched)
    for e in epochs:
        mode = e.mode
        if mode is None:  # the run was killed in this epoch: it does what the epoch before did
            mode = "rotate" if s["mode"] == "rotation" or e.run in rotating else None
        if mode == "rotate":
            rotating.add(e.run)
        where = f"{e.run} epoch {e.epoch} ({mode})"
        counts = Counter(i for i, _, _ in e.served)
        if mode == "rotate":
            nonces = defaultdict(set)
            for i, _, nonce in e.served:
                nonces[i].add(nonce)
            twice = {i: len(v) for i, v in nonces.items() if len(v) > 1}
            if twice:
                problems.append(f"{where}: a rotation epoch served several computations of indices {twice}")
            r = expected_repeats(s)
            if e.completed and (set(counts) != set(range(n)) or set(counts.values()) != {r}):
                wrong = {i: counts.get(i, 0) for i in range(n) if counts.get(i, 0) != r}
                problems.append(f"{where}: each index must be served {r} times; got {dict(list(wrong.items())[:8])}")
            elif not e.completed and any(c > r for c in counts.values()):
                problems.append(f"{where}: indices served more than {r} times in a rotation epoch")
            continue
        dup = sorted(i for i, c in counts.items() if c > 1)
        if dup:
            problems.append(f"{where}: indices served more than once: {dup[:8]}")
        if e.completed and set(counts) != set(range(n)):
            missing = sorted(set(range(n)) - set(counts))
            problems.append(f"{where}: completed epoch without indices {missing[:8]}")
    return problems


def store_key(s: dict, e: Epoch, paths: Paths) -> tuple:
    """What a read or generate epoch serves from: the store (one per run for the in-RAM backend),
    the dataset version and the generation."""
    store = e.run if s["backend"] == "memory" else paths.prefix
    return (store, e.version, e.generation)


def live_flips(runs: list, paths: Paths) -> set[tuple[int, int]]:
    """(generation, index) of flipped records that no later commit of their generation replaced."""
    flips = [(ev["t"], ev["generation"], i) for _, ev in actions_of(runs, "flip")
             if ev.get("generation") is not None for i in ev["indices"]]
    # A commit's time is known to lie between the epoch's last batch and its end: a flip after the
    # last batch may have come after the commit too, so it may stay.
    rewrites = [(e.t_last or e.t_end, e.generation) for run in runs for e in epochs_of(run)
                if e.stats and e.stats["committed"]]
    return {(g, i) for t, g, i in flips if not any(t2 > t and g2 == g for t2, g2 in rewrites)}


def check_generations(s: dict, runs: list, paths: Paths) -> list[str]:
    """One computation per index per generation; a computation under one generation only."""
    problems: list[str] = []
    if s["mode"] != "cache":
        keyed = []
    else:
        keyed = sorted((e for run in runs for e in epochs_of(run) if e.mode in ("read", "generate")),
                       key=lambda e: e.t_end)
    flipped = {(ev["t"], ev["generation"], i) for _, ev in actions_of(runs, "flip")
               if ev.get("generation") is not None for i in ev["indices"]}
    # Under which key each computation was served.
    where: dict[int, set] = defaultdict(set)
    for run in runs:
        for e in epochs_of(run):
            if e.stats is None:
                continue  # killed before its stats: what it served from is unknown
            key = store_key(s, e, paths) if e.mode in ("read", "generate") and s["mode"] == "cache" else (
                "fresh", e.run, e.epoch)
            for i, _, nonce in e.served:
                where[nonce].add(key)
    shared = {nonce: keys for nonce, keys in where.items() if len(keys) > 1}
    if shared:
        nonce, keys = next(iter(shared.items()))
        problems.append(f"{len(shared)} computation(s) served under several generations or in fresh epochs, "
                        f"e.g. nonce {nonce} under {sorted(map(str, keys))}")
    content: dict[tuple, dict[int, int]] = defaultdict(dict)
    for e in keyed:
        key = store_key(s, e, paths)
        if e.mode == "generate":
            if e.stats["committed"]:
                content[key] = {i: nonce for i, _, nonce in e.served}
            continue
        known = content[key]
        if e.error is not None and NOT_FOUND_ERROR in e.error["mro"]:
            # The generation was removed while this epoch read it (check_errors says by what): a reader
            # that found it half removed took it for damage, and its batch was a miss, computed afresh.
            continue
        flips_before = {i for t, g, i in flipped if g == e.generation and t < e.t_end}
        differ = []
        for batch in e.batches:
            if any(i in flips_before for i, _, _ in batch):
                continue  # a corrupt record makes its whole batch a miss, computed afresh
            for i, _, nonce in batch:
                if i in known and known[i] != nonce:
                    differ.append(i)
                known.setdefault(i, nonce)
        if differ:
            problems.append(f"{e.run} epoch {e.epoch} read generation {e.generation} but served other "
                            f"computations of indices {differ[:8]} than earlier epochs of that generation")
    return problems


def disk_full_during(runs: list, t0: float, t1: float) -> bool:
    """Whether the disk was full at some moment between `t0` and `t1`."""
    changes = sorted([(ev["t"], True) for _, ev in actions_of(runs, "fill-disk")]
                     + [(ev["t"], False) for _, ev in actions_of(runs, "free-disk")])
    full = False
    for t, state in changes:
        if t > t1:
            break
        if t >= t0 and (state or full):
            return True  # it fills in the window, or was full from `t0` until this change freed it
        full = state
    return full


def check_errors(s: dict, runs: list, paths: Paths) -> list[str]:
    problems: list[str] = []
    fired = read_fired(paths.ctl)
    explained: set[int] = set()  # positions in `fired` an exception accounted for
    for run in runs:
        epochs = {e.epoch: e for e in epochs_of(run)}
        # A timeout kills the executor, the stuck worker with it: a later timeout is about a hang since.
        last_timeout = float("-inf")
        for err in errors_of(run):
            where = f"{run.name} epoch {err['epoch']}: {err['type']}"
            mro = err["mro"]
            e = epochs.get(err["epoch"])
            t0 = e.t_start if e else run.started
            if CHAOS_ERROR in mro:
                match = [k for k, f in enumerate(fired) if f["kind"] == "raise" and f["index"] == err["index"]
                         and owner_run(f["pid"], runs, paths.ctl) is run]
                if not match:
                    problems.append(f"{where} for index {err['index']}, which no fault of this run raised")
                elif err["sample_index"] != err["index"] and not s.get("stream"):  # a stream's samples have none
                    mode = e.mode if e else None
                    problems.append(f"{where}: sample_index {err['sample_index']} is not the index "
                                    f"{err['index']} that raised ({mode} epoch, nb_worker={run.spec['nb_worker']})")
                explained.update(match)
            elif TIMEOUT_ERROR in mro:
                match = [k for k, f in enumerate(fired) if f["kind"] == "hang"
                         and last_timeout < f["time"] <= err["t"] and owner_run(f["pid"], runs, paths.ctl) is run]
                last_timeout = err["t"]
                previous = next((p for p in reversed(errors_of(run)) if p["t"] < err["t"]), None)
                # Writing together, a worker that needs a sample another run's hung worker claimed waits for
                # that claim (Claims.wait_claim) until the other run's timeout kills its worker.
                theirs = [f for f in fired if f["kind"] == "hang" and f["time"] <= err["t"]
                          and s["backend"] == "memmap" and f["index"] in (err["indices"] or [])
                          and owner_run(f["pid"], runs, paths.ctl) not in (run, None)]
                # A run's first epoch starts its workers, and the next epoch after a worker error starts them
                # again (the error killed the executor): the first batch waits for new workers, which a loaded
                # machine may start (and have import the dataset's module) slower than `timeout`.
                first = previous is None and err["epoch"] == min(epochs, default=err["epoch"])
                restarted = (first or previous is not None and previous["epoch"] == err["epoch"] - 1) and \
                    "batch 0 of epoch" in err["message"]
                if (STARTING in err["message"] or restarted) and (not match or err["pid"] != fired[match[-1]]["pid"]):
                    # The loaded machine started workers slower than `timeout`: see notes(). A worker still
                    # starting is no hung one.
                    pass
                elif not match and theirs:
                    pass
                elif not match:
                    problems.append(f"{where} but no worker of this run hung: {err['message'][:300]}")
                else:
                    f = fired[match[-1]]
                    if err["pid"] != f["pid"] or f["index"] not in (err["indices"] or []):
                        problems.append(f"{where} names pid {err['pid']} computing {err['indices']}, but the "
                                        f"stuck worker is pid {f['pid']}, inside dataset[{f['index']}]")
                    explained.update(match)
            elif WORKER_ERROR in mro and s.get("stream") and any(r is run for r, _ in actions_of(runs, "kill-worker")):
                pass  # a stream cannot be taken up where a killed worker left it: the epoch fails, the next one iterates
            elif BUDGET_ERROR in mro:
                full = s["tmpfs"] and disk_full_during(runs, t0, err["t"])
                if not full:
                    problems.append(f"{where} without a full disk: {err['message'][:300]}")
                elif s["mode"] == "cache" and s["policy"] != "error":
                    problems.append(f"{where} although on_budget_exceeded={s['policy']!r} promises to keep "
                                    f"serving: {err['message'][:300]}")
            elif LOCKED_ERROR in mro:
                others = [r for r in runs if r is not run and r.started <= err["t"] <= r.ended]
                if not others:
                    problems.append(f"{where} with no other run alive: {err['message'][:300]}")
                elif s["backend"] == "memmap":
                    problems.append(f"{where}: runs on a memmap store write a generation together (a concurrent "
                                    f"run joins the writers), none is locked out: {err['message'][:300]}")
            elif NOT_FOUND_ERROR in mro:
                why = removed_during(s, runs, run, t0, err["t"])
                if why is None:
                    problems.append(f"{where}, but nothing removed a generation during the epoch: "
                                    f"{err['message'][:300]}\n    {err['traceback'][-1200:]}")
                elif e is not None and e.mode == "read" and not any(READ_REMOVED in n for n in err["notes"]):
                    problems.append(f"{where} after {why}, without the note that says the generation was removed "
                                    f"while the epoch read it: {err['message'][:300]}")
            elif CORRUPT_ERROR in mro and s.get("stream"):
                # A stream's sample cannot be computed again by its index: a record flipped on purpose is an
                # error that says to prune the generation (README, "Streams").
                if not any(ev["t"] <= err["t"] for _, ev in actions_of(runs, "flip")):
                    problems.append(f"{where}, but no record was flipped before it: {err['message'][:300]}")
            elif STORE_ERROR in mro and re.search(WRITE_REMOVED, err["message"]):
                if not [w for w in windows_of(runs, "rm-prefix") if w[0] <= err["t"] and w[1] >= t0]:
                    problems.append(f"{where} of a write into a removed directory, but nothing removed the prefix "
                                    f"during the epoch: {err['message'][:300]}")
            elif [w for w in windows_of(runs, "rm-prefix") if w[0] <= err["t"] and w[1] >= t0]:
                # The loader's promise (tests/loader/test_accidents.py): a read epoch keeps its open files, a
                # write says the cache directory was removed (a CacheStoreError), the next epoch writes again.
                problems.append(f"{where} after the prefix was removed during the epoch, instead of the "
                                f"CacheStoreError that says the cache directory was removed while it was written: "
                                f"{err['message'][:300]}\n    {err['traceback'][-1500:]}")
            elif any(text in err["message"] or text in err["traceback"] for text in (EROFS_TEXT,) + READ_ONLY_EMPTY):
                problems += _read_only_error(s, runs, run, e, err, where, paths)
            else:
                problems.append(f"{where}, which no fault explains: {err['message'][:500]}\n"
                                f"    {err['traceback'][-1500:]}")
    problems += _lost(s, runs, paths, fired, explained)
    return problems


def removed_during(s: dict, runs: list, run, t0: float, t1: float) -> str | None:
    """What may have removed a committed generation between `t0` and `t1` (a run's epoch): a prune or
    ``rm -rf`` of the prefix, another run on it that wrote (its commit prunes older generations; a full
    disk makes it remove them first; a background refresh commits as the epoch of its generation
    starts) or took the prefix over for a new dataset version; ``None``."""
    for kind in ("prune", "rm-prefix"):
        for start, end in windows_of(runs, kind):
            if start <= t1 and end >= t0:
                return f"the {kind} at {start:.3f}"
    if s["backend"] == "memory":
        return None
    for other in runs:
        if other is run:
            continue
        if other.started <= t1 and other.ended >= t0 and other.spec["version"] != run.spec["version"]:
            return f"{other.name} (another dataset version)"
        for e in epochs_of(other):
            if e.mode == "generate" and e.t_start <= t1 and e.t_end >= t0:
                return f"{other.name} epoch {e.epoch}, which wrote generation {e.generation}"
        for start, end, generation in commits_of(other):
            if start <= t1 and end >= t0:
                return f"{other.name}'s commit of generation {generation} (it prunes older ones)"
    return None


def commits_of(run) -> list[tuple[float, float, int]]:
    """``(from, to, generation)``: when each commit `run` made, or found made, as its epochs went on, may
    have happened: an epoch that wrote and committed its generation (at its end); an epoch of a generation
    newer than its previous epoch's (a background refresh completes and commits it once that epoch has
    begun, before its first batch). Each prunes the generations older than the one committed."""
    out: list[tuple[float, float, int]] = []
    before: int | None = None
    for e in epochs_of(run):
        if e.generation is None:
            continue
        if e.stats is not None and e.stats.get("committed"):
            out.append((e.t_end, e.t_end, e.generation))
        elif e.mode == "read" and before is not None and e.generation > before:
            out.append((e.t_start, e.t_end, e.generation))
        before = e.generation
    return out


def committed_now(paths: Paths) -> list[int]:
    """The committed generations of the store at the prefix."""
    from cachestore import open_store
    from cachestore.errors import CacheStoreError

    try:
        with open_store(paths.prefix, readonly=True) as store:
            return [g.id for g in store.generations() if g.committed]
    except CacheStoreError:
        return []


def _read_only_error(s: dict, runs: list, run, e: Epoch | None, err: dict, where: str, paths: Paths) -> list[str]:
    """An error of a read-only file system: explained only when the prefix was made read-only before it and
    nothing committed could be read instead (the loader serves a committed generation and writes nothing;
    the file system stayed read-only to the end, so what is committed now was committed then)."""
    remounts = [ev for _, ev in actions_of(runs, "remount-ro") if ev.get("ok") and ev["t"] <= err["t"]]
    if not remounts:
        return [f"{where}: a read-only file system, but nothing made it read-only: {err['message'][:300]}"]
    committed = committed_now(paths)
    if not committed:
        return []
    what = ("its background refresh could not start" if "start_refresh" in err["traceback"]
            else f"{e.mode} epoch" if e is not None and e.mode else "the epoch's plan")
    between = "between runs" if any(ev.get("by") == "runner" for ev in remounts) else "between epochs"
    return [f"{where} ({what}) after the file system was remounted read-only {between}, although generation(s) "
            f"{committed} are committed (the loader should read the newest and write nothing): "
            f"{err['message'][:300]}\n    {err['traceback'][-1500:]}"]


def _lost(s: dict, runs: list, paths: Paths, fired: list[dict], explained: set[int]) -> list[str]:
    """Dataset exceptions that never reached the training loop (and were not excused)."""
    problems = []
    for k, f in enumerate(fired):
        if k in explained or f["kind"] != "raise":
            continue
        run = owner_run(f["pid"], runs, paths.ctl)
        if run is None or run.killed_by is not None or run.timed_out:
            continue
        killed = [ev for _, ev in actions_of([run], "kill-worker") if ev.get("pid") == f["pid"]]
        if killed:
            continue  # the worker died with its error unsent
        epochs = epochs_of(run)
        current = [e for e in epochs if e.t_start <= f["time"] <= (e.t_end or f["time"])]
        if any(e.error is not None for e in current):
            continue  # another exception ended the epoch first: its workers were stopped
        later = [e for e in epochs if e.t_start >= f["time"]]
        if s["background_refresh"] and not later:
            continue  # a background chunk of the last epoch: the run closed before it was needed
        problems.append(f"{run.name}: dataset[{f['index']}] raised ChaosError in pid {f['pid']}, "
                        "but the exception never reached the training loop")
    return problems


def check_waits(s: dict, runs: list) -> list[str]:
    problems = []
    for run in runs:
        timeout = run.spec["loader"]["timeout"]
        bound = timeout + TIMEOUT_SLACK if timeout is not None and timeout < WAIT_BOUND else WAIT_BOUND
        for ev in run.events:
            if ev["ev"] in ("batch", "error") and ev.get("wait", 0) > bound:
                problems.append(f"{run.name} epoch {ev['epoch']}: waited {ev['wait']:.1f} s for a batch "
                                f"(bound {bound:.0f} s)")
    return problems


def check_stats(s: dict, runs: list) -> list[str]:
    problems = []
    for run in runs:
        for e in epochs_of(run):
            if not e.completed or e.stats is None:
                continue
            if e.stats["samples"] != len(e.served):
                problems.append(f"{run.name} epoch {e.epoch}: epoch_stats says {e.stats['samples']} samples, "
                                f"{len(e.served)} were served")
            if e.mode == "generate" and not e.stats["committed"] and not _may_leave_uncommitted(s, runs, run, e):
                problems.append(f"{run.name} epoch {e.epoch}: a generate epoch ran to its end but committed "
                                f"nothing ({e.stats})")
    return problems


def _may_leave_uncommitted(s: dict, runs: list, run, e: Epoch) -> bool:
    """Whether a completed generate epoch may end without committing: its disk filled, its prefix was
    removed or made read-only, or another run writing the same memmap generation was still in (the
    last member out commits)."""
    if any(f in s["faults"] for f in ("disk-full", "coop-disk-full")):
        return True
    if any(start <= e.t_end for kind in ("rm-prefix", "remount-ro") for start, _ in windows_of(runs, kind)):
        return True
    return s["backend"] == "memmap" and any(other is not run and other.started <= e.t_end and other.ended >= e.t_start
                                            for other in runs)


def check_commits(s: dict, runs: list) -> list[str]:
    """A generation is committed once - by one of the processes that wrote it together - unless it was
    removed (a prune, ``rm -rf``, a generate epoch making room on a full budget) or found damaged before it
    was written again."""
    commits = sorted((e.t_end, e.t_start, e.version, e.generation, run.name, e.epoch, e.stats["extra"])
                     for run in runs for e in epochs_of(run) if e.stats and e.stats["committed"])
    removals = [t for kind in ("prune", "rm-prefix") for window in windows_of(runs, kind) for t in window]
    # A generate epoch on a full budget removes the generations before it first (policy "stream", "rotate").
    removals += [e.t_start for run in runs for e in epochs_of(run) if e.stats and "made_room" in e.stats["extra"]]
    problems = []
    last: dict[tuple, tuple] = {}
    for commit in commits:
        t_end, t_start, version, generation, name, epoch, extra = commit
        before = last.get((version, generation))
        last[(version, generation)] = commit
        if before is None or "damaged" in extra or any(before[1] <= t <= t_end for t in removals):
            continue
        problems.append(f"generation {generation} was committed twice: by {before[4]} epoch {before[5]} and by "
                        f"{name} epoch {epoch}, with nothing removing it in between")
    return problems


def check_read_only_runs(s: dict, runs: list, paths: Paths) -> list[str]:
    """A run started on a prefix remounted read-only reads committed generations and calls the dataset for
    nothing (but records flipped on purpose, which are misses)."""
    problems = []
    calls = calls_by_run(runs, paths)
    flips = bool(actions_of(runs, "flip"))
    for run in runs:
        if not any(ev.get("by") == "runner" and ev.get("ok") for _, ev in actions_of([run], "remount-ro")):
            continue
        wrote = [e.epoch for e in epochs_of(run) if e.mode not in (None, "read")]
        if wrote:
            problems.append(f"{run.name} on a read-only file system: epochs {wrote} did not read a committed "
                            f"generation ({[e.mode for e in epochs_of(run)]})")
        if calls.get(run.name) and not flips:
            problems.append(f"{run.name} on a read-only file system called the dataset {calls[run.name]} times")
    return problems


def calls_by_run(runs: list, paths: Paths) -> dict[str, int]:
    """Dataset calls made by each run's processes."""
    out: dict[str, int] = Counter()
    for path in Path(paths.ctl, "calls").glob("*.log"):
        run = owner_run(int(path.stem), runs, paths.ctl)
        if run is not None:
            out[run.name] += len(path.read_text().splitlines())
    return out


def check_shared_content(s: dict, runs: list, paths: Paths) -> list[str]:
    """Runs that wrote a memmap generation together serve the same computation of each sample under it, in
    every epoch of every run, whichever run computed it (``docs/ARCHITECTURE.md``, "Writing together").

    Only a break makes another computation legitimate: a prune or ``rm -rf`` (the generation is written
    again), a commit cut short (a member killed or interrupted inside it: the area is discarded), a
    generation found damaged. From a break to the next commit of the generation, what a run serves
    may come from the copy that went away (files a reader still has open, an area a member still
    reads back): those serves are not compared, and the first serves after it start afresh.
    Scenarios whose disk fills (a failed commit discards the area; "stream" serves samples it could
    not write) or whose records are flipped on purpose (misses are recomputed) are left to
    :func:`check_generations`."""
    if s["backend"] != "memmap" or any(f in s["faults"] for f in ("disk-full", "coop-disk-full", "bitflip")):
        return []
    breaks = [t for kind in ("prune", "rm-prefix") for window in windows_of(runs, kind) for t in window]
    breaks += [f["time"] for f in read_fired(paths.ctl) if f["kind"] == "killcommit"]
    breaks += [run.ended for run in runs if ctrl_c_inside(run) == "a commit"]
    breaks += [e.t_start for run in runs for e in epochs_of(run) if e.stats and "damaged" in e.stats["extra"]]
    commits = [(e.t_end, e.version, e.generation) for run in runs for e in epochs_of(run)
               if e.stats and e.stats["committed"]]
    # A commit prunes the generations older than the one it published (as an epoch that wrote it ends, or
    # as the epoch of a background refresh's generation begins): a break for those.
    newer = [(t, g) for run in runs for t, _, g in commits_of(run)]

    def breaks_of(generation: int) -> list[float]:
        return breaks + [t for t, g in newer if g > generation]

    def settling(t: float, version: int, generation: int) -> bool:
        """Whether `t` lies between a break and the next commit of the generation."""
        return any(b <= t < min((c for c, v, g in commits if (v, g) == (version, generation) and c >= b),
                                default=math.inf) for b in breaks_of(generation))

    served = []  # (time, version, generation, index, nonce, run, epoch)
    for run in runs:
        epochs = {e.epoch: e for e in epochs_of(run)}
        for ev in run.events:
            e = epochs.get(ev.get("epoch")) if ev["ev"] == "batch" else None
            if e is not None and e.mode in ("read", "generate") and not settling(ev["t"], e.version, e.generation):
                served += [(ev["t"], e.version, e.generation, i, nonce, run.name, e.epoch)
                           for i, nonce in zip(ev["y"], ev["nonce"])]
    first: dict[tuple, tuple] = {}
    differ: dict[tuple, list] = defaultdict(list)
    for t, version, generation, index, nonce, name, epoch in sorted(served):
        key = (version, generation, index)
        seen = first.get(key)
        if seen is None or any(seen[0] < b <= t for b in breaks_of(generation)):
            first[key] = (t, nonce, name, epoch)
        elif seen[1] != nonce:
            differ[(version, generation)].append(f"{index} ({seen[2]} epoch {seen[3]}, then {name} epoch {epoch})")
    return [f"generation {g} (version {v}) served other computations of samples it had served, with nothing "
            f"removing it in between: {where[:4]}" for (v, g), where in differ.items()]


def check_after_killed_commit(s: dict, runs: list, paths: Paths) -> list[str]:
    """After a member was killed inside its commit, the next run on the prefix ends with a committed
    generation (``check_store`` verifies it), unless the disk was full while it ran."""
    if "coop-kill-commit" not in s["faults"] or not runs or runs[-1].spec["after"] is None:
        return []
    follow = runs[-1]
    epochs = epochs_of(follow)
    if not any(e.completed for e in epochs) or committed_now(paths) or disk_full_during(
            runs, min(e.t_start for e in epochs), max(e.t_end for e in epochs)):
        return []
    return [f"{follow.name} completed epochs after a commit was killed, but no generation is committed at the end"]


def check_store(runs: list, paths: Paths) -> list[str]:
    """The store verifies but for the records flipped on purpose; ``cachestore inspect --verify`` agrees."""
    from cachestore import open_store
    from cachestore.cli import main as cli_main
    from cachestore.errors import CacheStoreError

    if not os.path.exists(os.path.join(paths.prefix, "store.json")):
        return []
    try:
        with open_store(paths.prefix, readonly=True) as store:
            errors = store.verify()
    except CacheStoreError as exc:
        return [f"the store cannot be opened at the end: {exc}"]
    allowed = live_flips(runs, paths)
    found = {(e.generation, e.index) for e in errors}
    problems = []
    bad = [str(e)[:300] for e in errors if (e.generation, e.index) not in allowed]
    if bad:
        problems.append(f"Store.verify() at the end: {bad[:3]}")
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        status = cli_main(["inspect", paths.prefix, "--verify"])
    if status != (1 if found else 0):
        problems.append(f"cachestore inspect --verify exited {status} with {len(found)} bad record(s) found by "
                        f"verify(): {(out.getvalue() + err.getvalue())[-600:]}")
    return problems


# ------------------------------------------------------------------------------------------ the table
def fired_faults(s: dict, runs: list, paths: Paths) -> set[str]:
    """The faults of `s` that took effect (a fault armed at an index nobody computed did not)."""
    out = set()
    kinds = {f["kind"] for f in read_fired(paths.ctl)}
    for fault in s["faults"]:
        if fault == "worker-kill":
            took = any(ev.get("pid") for _, ev in actions_of(runs, "kill-worker"))
        elif fault in ("raise", "hang"):
            took = fault in kinds
        elif fault.startswith("train-"):
            took = any(run.killed_by is not None for run in runs)
        elif fault in ("disk-full", "coop-disk-full"):
            took = bool(actions_of(runs, "fill-disk"))
        elif fault == "bitflip":
            took = any(ev.get("indices") for _, ev in actions_of(runs, "flip"))
        elif fault == "double-sigint":
            took = any(run.interrupted for run in runs)
        elif fault == "rm-prefix":
            took = bool(windows_of(runs, "rm-prefix"))
        elif fault == "readonly-remount":
            took = any(ev.get("ok") for _, ev in actions_of(runs, "remount-ro"))
        elif fault == "prune-live":
            took = any(ev.get("removed") for _, ev in actions_of(runs, "prune"))
        elif fault == "coop-kill-claim":
            took = "killrun" in kinds
        elif fault == "coop-kill-commit":
            took = "killcommit" in kinds
        else:
            took = len(runs) > 1
        if took:
            out.add(fault)
    return out


def notes(s: dict, runs: list, paths: Paths) -> list[str]:
    """Things worth knowing that are not failures."""
    out = []
    for f in read_fired(paths.ctl):
        run = owner_run(f["pid"], runs, paths.ctl)
        if f["kind"] == "hang" and run is not None and run.killed_by is None and not any(TIMEOUT_ERROR in e["mro"] for e in errors_of(run)):
            out.append(f"the hang at index {f['index']} (pid {f['pid']}) ended without a timeout error")
    for run in runs:
        for err in errors_of(run):
            if TIMEOUT_ERROR in err["mro"] and STARTING in err["message"]:
                out.append(f"{run.name} epoch {err['epoch']}: WorkerTimeoutError while a worker was still "
                           f"starting (timeout={run.spec['loader']['timeout']})")
        for ev in run.events:
            if ev["ev"] == "action" and ev.get("skipped"):
                out.append(f"{run.name}: {ev['kind']} not reached")
            elif ev["ev"] == "action" and ev["kind"] == "remount-ro" and not ev.get("ok"):
                out.append(f"{run.name}: the remount read-only was refused: {ev.get('refused')}")
            elif ev["ev"] == "action" and ev["kind"] == "prune" and not ev.get("removed"):
                out.append(f"{run.name}: the prune (epoch {ev['epoch']}) removed no generation: "
                           f"{ev.get('output', '')[-200:]}")
            elif ev["ev"] == "action" and ev["kind"] == "rm-prefix" and not ev.get("gone"):
                out.append(f"{run.name}: rm -rf left the prefix after {ev.get('tries')} tries: {ev.get('stderr')}")
            elif ev["ev"] == "action" and ev["kind"] == "kill-in-commit":
                out.append(f"{run.name}: killed in the commit of generation {ev['generation']} ({ev['stage']})")
    kinds = {f["kind"] for f in read_fired(paths.ctl)}
    if "coop-kill-claim" in s["faults"] and "killrun" not in kinds:
        target = next(r for r in s["runs"] if (r.get("kill") or {}).get("how") == "claim")
        out.append(f"coop-kill-claim did not fire: {target['name']} made fewer than {target['kill']['calls']} "
                   "dataset calls (the others computed the rest)")
    if "coop-kill-commit" in s["faults"] and "killcommit" not in kinds:
        stage = next(r["kill"]["stage"] for r in s["runs"] if r.get("kill"))
        out.append(f"coop-kill-commit did not fire: no member reached the commit step {stage!r}")
    if any(f.startswith("coop-") for f in s["faults"]):
        barriers = [ev for run in runs for ev in run.events if ev["ev"] == "barrier"]
        if any(ev["ready"] < ev["of"] for ev in barriers):
            out.append("the cooperating runs did not all reach their barrier within 60 s")
    return out
