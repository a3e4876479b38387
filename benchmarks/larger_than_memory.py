"""Scenario: a cache larger than memory, read by processes under a memory limit.

How close do cached epochs of a store three or more times the memory limit get
to what the disk gives? Per sample size (48 KiB: uint8 ``(3, 128, 128)``; 4 KiB:
uint8 ``(4096,)``; an int label each), in one run, every read cold (the store's
pages dropped first, :func:`benchmarks.cgroup.evict`):

* **sequential**: every file of the store read once with 8 MiB reads, the
  limit; measured just before and just after the block-order epoch (this
  shared disk's speed moves with the neighbours' load), both runs counted;
* **pread**: the records of the arrays' file in a random order, one ``pread``
  of a record each, by 8 threads (what random reads of the disk give); and the
  same with one ``pread`` of a block of the block order each (what the block
  order's reads can give);
* **random** and **block**: a cached epoch of ``CachedLoader`` with
  ``read_order`` ``"random"`` or ``"block"`` (memmap, 2 workers, batch 256,
  default settings otherwise), timed once its workers have started; each right
  after its baseline;
* **torch**: torch's ``DataLoader(open_store(prefix).reader(), batch_size=256,
  shuffle=True, num_workers=2)``, one sample at a time through the mapping;
* **lmdb** and **zstd**: a cached epoch of the same data written with
  ``backend="lmdb"``, or memmap with ``compression="zstd"`` (the store's one
  level, 3), read in the order ``read_order="auto"`` picks. These stores are
  written without the limit (lmdb's writer was killed for memory under one);
* **generate**: the epoch that computes and writes the memmap store, with and
  without the memory limit;
* **shuffle**: how well the block order mixes a batch next to a full shuffle,
  from the orders alone (:func:`shuffle_quality`).

torch, lmdb and zstd are timed for a budget of seconds and their rate
extrapolated to the epoch (the report says which share was timed); the others
stop after four budgets, should one be far slower than expected.

**Modes.** As root, the reading processes run in a child memory cgroup of this
process's own, limited to ``limit`` bytes (v1 ``memory.limit_in_bytes`` or v2
``memory.max``), made for the run and removed after it (mode ``cgroup``).
Without root, or when the kernel refuses the cgroup, mode ``evict``: no limit,
the store's pages are dropped before every measurement (``os.sync``, then
``POSIX_FADV_DONTNEED`` on each of its files, never ``drop_caches``, which
would empty the whole machine's cache), and the reading processes are told a
memory room of ``limit`` bytes (``cachestore.space.room.memory_room`` replaced, in
the loader's workers too), so the loader reads as it would under the limit: the
store does not fit, it is not mapped in, and streamed reads drop their pages.
Reads through a mapping (torch, lmdb, zstd) keep their pages for the rest of
the epoch in that mode, which flatters them; the generate epoch has no limit to
compare with. The mode is in the results.

**Sizes.** The limit holds the reading processes too: a loader with 2 workers
and batches of 256 x 48 KiB holds up to ~280 MiB of its own (the training
process, the workers, the shared-memory slots), none of it reclaimable without
swap. At 256 MiB its workers were killed for memory; 384 MiB (``--quick``, a
1.25 GB store) leaves it ~100 MiB of page cache, 512 MiB (full run, 2 GB) ~230.

Each measurement is a process of its own (``python -m benchmarks.larger_than_memory
--reader PHASE ARGS``), started inside the cgroup, so one's memory does not
weigh on the next. Run ``python -m benchmarks --only larger_than_memory``
(``--quick`` for small sizes), or this module alone.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np

from .cgroup import CgroupRefused, MemoryCgroup, child_memory_cgroup, command_in, evict, run_bounded, store_files

ROOT = Path(__file__).resolve().parents[1]
#: Sample sizes: a label and the shape of the uint8 array (plus an int64 label per sample).
SHAPES: dict[str, tuple[int, ...]] = {"48 KiB": (3, 128, 128), "4 KiB": (4096,)}
BATCH, WORKERS, IO_THREADS = 256, 2, 8
#: Size of each read of the sequential baseline.
READ_BYTES = 8 << 20
#: A memory room the reading processes report instead of theirs (mode ``evict``).
ROOM_ENV = "CACHESTORE_BENCH_MEMORY_ROOM"
#: Seconds any one measurement process may run before it is killed.
PHASE_TIMEOUT = 600
#: Random walks of a dataset, made once per process: sample i is one of them, shifted by i.
WALKS = 64


class RandomWalkSamples:
    """Sample ``i``: ``(uint8 array of shape `shape`, i)``, cheap and somewhat compressible.

    Each array is a random walk (steps -1, 0, +1 with probabilities 1/4, 1/2,
    1/4, wrapping at 256), like a smooth signal: zstd level 3 stores it in
    about half the bytes. 64 walks are made once per process; sample ``i`` is
    one of them plus ``i % 251``.
    """

    def __init__(self, n: int, shape: tuple) -> None:
        self.n = n
        self.shape = tuple(shape)
        self._walks: np.ndarray | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple:
        if self._walks is None:
            rng = np.random.default_rng(0)
            steps = rng.choice(np.array([-1, 0, 1]), size=(WALKS, int(np.prod(self.shape))), p=[0.25, 0.5, 0.25])
            self._walks = (steps.cumsum(axis=1) % 256).astype(np.uint8).reshape(WALKS, *self.shape)
        return self._walks[(index * 7919) % WALKS] + np.uint8(index % 251), index


# ------------------------------------------------------------------------------ the shuffle, from the orders
def shuffle_quality(n: int, block: int, batch_size: int = BATCH, seed: int = 0) -> dict[str, dict[str, float]]:
    """How a full shuffle and the block order (blocks of `block` records) mix the batches of an epoch.

    Per order, averaged over the epoch's full batches: ``spread``, the standard
    deviation of the indices in a batch over `n` (about 0.29 for uniform draws);
    ``same_block``, the share of neighbours in a batch's sorted indices that lie
    in one block; ``blocks``, the distinct blocks a batch draws from.
    """
    from loader.epochs.order import block_order

    orders = {"random": np.random.default_rng([seed, 1]).permutation(n),
              "block": block_order(n, 1, seed, block)[0]}
    out = {}
    for name, order in orders.items():
        batches = np.sort(order[:n - n % batch_size].reshape(-1, batch_size), axis=1)
        same = np.diff(batches // block, axis=1) == 0
        out[name] = {"spread": float((batches.std(axis=1) / n).mean()), "same_block": float(same.mean()),
                     "blocks": float((1 + (~same).sum(axis=1)).mean())}
    return out


# ------------------------------------------------------------------------------ the reading processes
def _room_in_worker(worker_id: int = 0) -> None:
    """Mode ``evict``: report the memory room of :data:`ROOM_ENV` (a worker_init_fn; the main process calls it too)."""
    room = os.environ.get(ROOM_ENV)
    if room:
        import cachestore.space.room

        cachestore.space.room.memory_room = lambda *args, **kwargs: int(room)  # type: ignore[assignment]


def _loader(args: dict, setting: dict) -> Any:
    from loader import CachedLoader

    from benchmarks.larger_than_memory import RandomWalkSamples as Samples  # not __main__'s: one fingerprint

    return CachedLoader(Samples, {"n": args["n"], "shape": tuple(args["shape"])}, batch_size=BATCH,
                        nb_worker=WORKERS, cache_setting={"prefix": args["prefix"], **setting},
                        worker_init_fn=_room_in_worker if os.environ.get(ROOM_ENV) else None)


def _generate(args: dict) -> dict:
    """The first epoch of a loader with an empty store: computes and writes it."""
    with _loader(args, args["setting"]) as loader:
        t = time.perf_counter()
        for _ in loader:
            pass
        seconds = time.perf_counter() - t
        stats = loader.epoch_stats[-1]
        info = next(g for g in loader.store.generations() if g.committed)
    return {"seconds": seconds, "samples": stats.samples, "mode": stats.mode.value, "raw_bytes": info.raw_bytes,
            "stored_bytes": info.stored_bytes, "nbytes": info.nbytes,
            "disk_bytes": sum(p.stat().st_size for p in store_files(args["prefix"]))}


def _sequential(args: dict) -> dict:
    """Every file of the store, cold, read once with large reads."""
    evict(args["prefix"])
    buf, total = bytearray(READ_BYTES), 0
    t = time.perf_counter()
    for path in store_files(args["prefix"]):
        fd = os.open(path, os.O_RDONLY)
        try:
            while got := os.readv(fd, [buf]):
                total += got
        finally:
            os.close(fd)
    return {"bytes": total, "seconds": time.perf_counter() - t}


def _pread(args: dict) -> dict:
    """Records of the store's largest file (the arrays), cold, in a random order, by 8 threads: one
    ``pread`` of a record each, or of ``records`` consecutive records (the block order's reads)."""
    evict(args["prefix"])
    path = max(store_files(args["prefix"]), key=lambda p: p.stat().st_size)
    size = path.stat().st_size // args["n"] * args.get("records", 1)
    reads = path.stat().st_size // size
    order = np.random.default_rng(0).permutation(reads)
    counts = [0] * IO_THREADS
    fd = os.open(path, os.O_RDONLY)
    start = time.perf_counter()
    deadline = start + args["budget"]

    def work(k: int) -> None:
        buf = bytearray(size)
        for i in order[k::IO_THREADS].tolist():
            os.preadv(fd, [buf], i * size)
            counts[k] += 1
            if time.perf_counter() > deadline:
                return

    threads = [threading.Thread(target=work, args=(k,)) for k in range(IO_THREADS)]
    try:
        for th in threads:
            th.start()
        for th in threads:
            th.join()
    finally:
        os.close(fd)
    return {"bytes": sum(counts) * size, "seconds": time.perf_counter() - start, "read_bytes": size,
            "file": path.name, "share": sum(counts) / reads}


def _workers_started(loader: Any, timeout: float = 15.0) -> None:
    """Wait until the loader's workers have started (their CPU time stops growing).

    A training run starts them once; here each measurement is a new process, and on two
    cores their imports would slow the first seconds of the epoch timed.
    """
    import psutil

    procs = [psutil.Process(pid) for pid in loader.worker_pids()]
    last, end = -1.0, time.monotonic() + timeout
    while time.monotonic() < end:
        try:
            cpu = sum(sum(p.cpu_times()[:2]) for p in procs)
        except psutil.Error:
            return
        if cpu - last < 0.01:
            return
        last = cpu
        time.sleep(0.2)


def _epoch(args: dict) -> dict:
    """One cached epoch of a loader over the committed store, cold, stopped after the budget."""
    from cachestore.space.room import memory_room

    _room_in_worker()
    n = args["n"]
    seen = np.zeros(n, dtype=np.int32)
    with _loader(args, args["setting"]) as loader:
        _workers_started(loader)
        evict(args["prefix"])
        samples, t = 0, time.perf_counter()
        for batch in loader:
            labels = np.asarray(batch[1])
            seen[labels] += 1
            samples += len(labels)
            if time.perf_counter() - t > args["budget"]:
                break
        seconds = time.perf_counter() - t
        stats = loader.epoch_stats[-1]
    return {"samples": samples, "seconds": seconds, "share": samples / n, "mode": stats.mode.value,
            "read_order": stats.extra.get("read_order"), "gather": stats.extra.get("gather"),
            "served_once": bool(seen.max() <= 1 and seen.sum() == samples), "room": memory_room()}


def _torch(args: dict) -> dict:
    """torch's DataLoader over the store's reader (a map-style dataset), cold, stopped after the budget."""
    import torch.utils.data as tud

    from cachestore import open_store

    evict(args["prefix"])
    with open_store(args["prefix"]) as store:
        reader = store.reader()
        samples, t = 0, time.perf_counter()
        for batch in tud.DataLoader(reader, batch_size=BATCH, shuffle=True, num_workers=WORKERS):
            samples += len(batch[1])
            if time.perf_counter() - t > args["budget"]:
                break
        seconds = time.perf_counter() - t
        reader.close()
    return {"samples": samples, "seconds": seconds, "share": samples / args["n"]}


PHASES: dict[str, Callable[[dict], dict]] = {"generate": _generate, "sequential": _sequential, "pread": _pread,
                                             "epoch": _epoch, "torch": _torch}


def _reader_main(phase: str, args: dict) -> int:
    """One measurement in this process; its result as the last line of stdout."""
    _room_in_worker()
    print(json.dumps(PHASES[phase](args)), flush=True)
    return 0


# ------------------------------------------------------------------------------ the run
def _rates(figures: dict, sample_bytes: int) -> dict:
    """`figures` with ``gbps`` (and ``samples_per_s`` for an epoch) added, when it did not fail."""
    if "error" in figures:
        return figures
    nbytes = figures["bytes"] if "bytes" in figures else figures["samples"] * sample_bytes
    figures["gbps"] = nbytes / figures["seconds"] / 1e9
    if "samples" in figures:
        figures["samples_per_s"] = figures["samples"] / figures["seconds"]
    return figures


class _Phases:
    """Starts the measurement processes of one run: in the cgroup (when there is one) or not."""

    def __init__(self, cg: MemoryCgroup | None, room: int | None, log: Callable[[str], None]) -> None:
        self.cg, self.log = cg, log
        path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env = {**os.environ, "PYTHONPATH": path, **({ROOM_ENV: str(room)} if room else {})}

    def __call__(self, phase: str, args: dict, limited: bool = True) -> dict:
        cg = self.cg if limited else None
        self.log(f"  larger_than_memory: {phase} {json.dumps({k: v for k, v in args.items() if k != 'shape'})}"
                 + ("" if cg else " (no limit)"))
        if cg is not None:
            cg.reset_peak()
        argv = [sys.executable, "-m", "benchmarks.larger_than_memory", "--reader", phase, json.dumps(args)]
        done = run_bounded(command_in(cg, argv), PHASE_TIMEOUT, cwd=ROOT, env=self.env)
        if done.returncode != 0:
            tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-3:]
            self.log(f"  larger_than_memory: {phase} failed (exit {done.returncode}): " + " / ".join(tail))
            return {"error": f"exit {done.returncode}: {tail[-1] if tail else ''}"}
        figures = json.loads(done.stdout.strip().splitlines()[-1])
        # A worker killed (out of memory in the cgroup, say) is restarted and its batches re-run: the
        # figure stands, slower; say so.
        figures["worker_deaths"] = sum("died (" in line for line in done.stderr.splitlines())
        if cg is not None:
            figures["peak_bytes"] = cg.peak()
        return figures


def _both(first: dict, second: dict) -> dict:
    """Two runs of one measurement as one (bytes and seconds added), each run's GB/s kept."""
    if "error" in first or "error" in second:
        return second if "error" in first else first
    return {"bytes": first["bytes"] + second["bytes"], "seconds": first["seconds"] + second["seconds"],
            "runs_gbps": [run["bytes"] / run["seconds"] / 1e9 for run in (first, second)]}


def _case(label: str, shape: tuple[int, ...], store_bytes: int, budget: float, tmp: Path, run: _Phases) -> dict:
    """Every measurement of one sample size (see the module docstring)."""
    from loader.cache.read_order import block_size

    sample_bytes = int(np.prod(shape)) + 8
    n = store_bytes // sample_bytes
    key = label.split()[0]
    c: dict[str, Any] = {"sample": label, "shape": list(shape), "n": n, "sample_bytes": sample_bytes}
    base = {"n": n, "shape": list(shape), "budget": budget}
    memmap = str(tmp / f"{key}-memmap")
    # The generate epoch without the limit first (a plain process), then with it: the store read below.
    if run.cg is not None:
        unlimited = str(tmp / f"{key}-unlimited")
        c["generate_unlimited"] = run("generate", {**base, "prefix": unlimited, "setting": {}}, limited=False)
        shutil.rmtree(unlimited, ignore_errors=True)
    c["generate"] = gen = run("generate", {**base, "prefix": memmap, "setting": {}})
    if "error" in gen:
        return c
    c["store_disk_bytes"] = gen["disk_bytes"]
    c["block_records"] = block_size((gen["stored_bytes"] or gen["nbytes"]) // n)  # as the loader sizes blocks
    # Uncapped measurements still stop after a few budgets, should a read be far slower than expected.
    long = {**base, "prefix": memmap, "budget": 4 * budget}
    # Each epoch right after its baseline, and the sequential read on both sides of the block order:
    # this disk's speed moves with the neighbours' load, by 2x at times.
    c["pread"] = _rates(run("pread", long), sample_bytes)
    c["random"] = _rates(run("epoch", {**long, "setting": {"read_order": "random"}}), sample_bytes)
    before = run("sequential", long)
    c["pread_blocks"] = _rates(run("pread", {**long, "records": c["block_records"]}), sample_bytes)
    c["block"] = _rates(run("epoch", {**long, "setting": {"read_order": "block"}}), sample_bytes)
    c["sequential"] = _rates(_both(before, run("sequential", long)), sample_bytes)
    c["torch"] = _rates(run("torch", {**base, "prefix": memmap}), sample_bytes)
    shutil.rmtree(memmap, ignore_errors=True)
    # Written without the limit (only their reads are measured under it; lmdb's writer was killed for
    # memory under a 256 MiB limit), then read in the cgroup.
    for name, setting in (("lmdb", {"backend": "lmdb"}), ("zstd", {"compression": "zstd"})):
        prefix = str(tmp / f"{key}-{name}")
        written = run("generate", {**base, "prefix": prefix, "setting": setting}, limited=False)
        read = run("epoch", {**base, "prefix": prefix, "setting": setting}) if "error" not in written else written
        c[name] = {"generate": written, "epoch": _rates(read, sample_bytes)}
        shutil.rmtree(prefix, ignore_errors=True)
    c["shuffle"] = shuffle_quality(n, c["block_records"])
    return c


def larger_than_memory_scenario(limit: int, store_bytes: int, budget: float, mode: str = "auto",
                                log: Callable[[str], None] | None = None) -> dict:
    """Read a store of `store_bytes` per sample size under a memory limit of `limit` bytes.

    Parameters
    ----------
    limit
        The memory limit of the reading processes, in bytes.
    store_bytes
        The size of each store (at least 3 times `limit` for the scenario to mean anything).
    budget
        Seconds the slow readers (torch, lmdb, zstd) are timed for; others stop after 4 times that.
    mode
        ``"auto"`` (a cgroup when one can be made, else eviction), ``"cgroup"`` (an error without one) or
        ``"evict"`` (see the module docstring).
    log
        Where progress lines go (default: stderr).
    """
    log = log or (lambda line: print(line, file=sys.stderr, flush=True))
    result: dict[str, Any] = {"limit_bytes": limit, "store_bytes": store_bytes, "budget_s": budget,
                              "batch_size": BATCH, "workers": WORKERS, "io_threads": IO_THREADS, "cases": []}
    tmp = Path(tempfile.mkdtemp(prefix="cachestore-ltm-"))
    try:
        with contextlib.ExitStack() as stack:
            cg = None
            if mode != "evict":
                try:
                    cg = stack.enter_context(child_memory_cgroup(limit))
                except CgroupRefused as exc:
                    if mode == "cgroup":
                        raise
                    result["why_evict"] = str(exc)
                    log(f"  larger_than_memory: no memory cgroup ({exc}); evicting pages instead")
            result["mode"] = "cgroup" if cg is not None else "evict"
            result["cgroup"] = f"{cg.path} (v{cg.version})" if cg is not None else None
            run = _Phases(cg, None if cg is not None else limit, log)
            for label, shape in SHAPES.items():
                result["cases"].append(_case(label, shape, store_bytes, budget, tmp, run))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return result



# ------------------------------------------------------------------------------ the figures and the report
def ratios(case: dict) -> dict[str, float | None]:
    """The ratios the targets are about (``None`` where a measurement is missing or failed)."""
    def rate(key: str, sub: str | None = None) -> float | None:
        figures = case.get(key) or {}
        figures = (figures.get(sub) or {}) if sub else figures
        return figures.get("gbps")

    def over(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    seq, pread, torch = rate("sequential"), rate("pread"), rate("torch")
    free, limited = case.get("generate_unlimited") or {}, case.get("generate") or {}
    return {"block_vs_sequential": over(rate("block"), seq), "random_vs_pread": over(rate("random"), pread),
            "block_vs_block_pread": over(rate("block"), rate("pread_blocks")),
            "block_pread_vs_sequential": over(rate("pread_blocks"), seq),
            "random_vs_torch": over(rate("random"), torch), "block_vs_torch": over(rate("block"), torch),
            "lmdb_vs_sequential": over(rate("lmdb", "epoch"), seq),
            "zstd_vs_uncompressed": over(rate("zstd", "epoch"), rate(_zstd_order(case))),
            "generate_limited_vs_unlimited": over(limited.get("seconds"), free.get("seconds"))}


def _zstd_order(case: dict) -> str:
    """The uncompressed epoch the zstd epoch compares with: the one in the same order."""
    return "random" if ((case.get("zstd") or {}).get("epoch") or {}).get("read_order") == "random" else "block"


def _rate(figures: dict | None, samples: bool = True) -> str:
    """``GB/s, k samples/s`` of a measurement, with the share of the epoch timed when it was bounded."""
    if not figures:
        return "-"
    if "error" in figures:
        return f"failed ({figures['error']})"
    text = f"{figures['gbps']:.3g} GB/s"
    if samples and "samples_per_s" in figures:
        text += f", {figures['samples_per_s'] / 1e3:.3g}k samples/s"
    if figures.get("share", 1) < 1:
        text += f" (timed {figures['seconds']:.0f} s, {figures['share']:.1%} of the epoch)"
    if figures.get("worker_deaths"):
        text += f" ({figures['worker_deaths']} worker deaths)"
    return text


def _how(figures: dict | None) -> str:
    """The loader's read order and where it gathered, as its epoch stats say."""
    figures = figures or {}
    return f" ({figures['read_order']}, {figures['gather']})" if figures.get("read_order") else ""


def _times(value: float | None, of: str) -> str:
    if value is None:
        return ""
    return f"; {value:.2f}x {of}" if value >= 0.1 else f"; {value:.2g}x {of}"


def _case_column(c: dict, limit: int) -> list[str]:
    """One sample size's cells, in the order of :data:`ROWS`."""
    gen = c.get("generate") or {}
    if "error" in gen:
        return [f"failed ({gen['error']})"] + ["-"] * (len(ROWS) - 1)
    r = ratios(c)
    free, zstd, lmdb = c.get("generate_unlimited") or {}, c["zstd"], c["lmdb"]
    zgen = zstd["generate"]
    compressed = (f"{zgen['disk_bytes'] / 1e9:.2f} GB ({zgen['disk_bytes'] / c['store_disk_bytes']:.2f}x the "
                  "uncompressed store)" if "disk_bytes" in zgen else _rate(zgen))
    pays = r["zstd_vs_uncompressed"]
    verdict = ("" if pays is None else _times(pays, f"the uncompressed {_zstd_order(c)}-order epoch: ")
               + ("pays" if pays > 1 else "does not pay"))
    best = max((x for x in (r["random_vs_torch"], r["block_vs_torch"]) if x is not None), default=None)
    generate = (f"{gen['seconds']:.1f} s / {free['seconds']:.1f} s = {r['generate_limited_vs_unlimited']:.2f}x"
                if r["generate_limited_vs_unlimited"] is not None else f"{gen['seconds']:.1f} s (no limit)")
    if gen.get("worker_deaths"):
        generate += f" ({gen['worker_deaths']} worker deaths)"
    sh = c["shuffle"]
    return [f"{c['n']:,} x {c['sample']}, {c['store_disk_bytes'] / 1e9:.2f} GB "
            f"({c['store_disk_bytes'] / limit:.1f}x the limit)",
            _rate(c["sequential"], samples=False) + (" ({:.3g} before the block order, {:.3g} after)".format(
                *c["sequential"]["runs_gbps"]) if "runs_gbps" in c["sequential"] else ""),
            _rate(c["pread"], samples=False),
            _rate(c["pread_blocks"], samples=False) + _times(r["block_pread_vs_sequential"], "sequential"),
            _rate(c["random"]) + _times(r["random_vs_pread"], "pread") + _how(c["random"]),
            _rate(c["block"]) + _times(r["block_vs_sequential"], "sequential")
            + _times(r["block_vs_block_pread"], "block preads") + _how(c["block"]),
            _rate(c["torch"]) + (f"; ours {best:.0f}x" if best is not None else ""),
            _rate(lmdb["epoch"]) + _times(r["lmdb_vs_sequential"], "sequential") + _how(lmdb["epoch"]),
            compressed,
            _rate(zstd["epoch"]) + verdict + _how(zstd["epoch"]),
            generate,
            f"{sh['random']['spread']:.3f} / {sh['block']['spread']:.3f}",
            f"{sh['random']['same_block']:.2f} / {sh['block']['same_block']:.2f}",
            f"{sh['random']['blocks']:.0f} / {sh['block']['blocks']:.1f} (blocks of {c['block_records']} records)"]


ROWS = ["store: samples, size on disk", "sequential cold read, 8 MiB reads (the limit)",
        "random `pread` of a record, 8 threads", "random `pread` of a block, 8 threads",
        "CachedLoader, `read_order='random'`", "CachedLoader, `read_order='block'`",
        "torch `DataLoader` over `store.reader()`, shuffle", "CachedLoader, lmdb backend",
        "zstd (level 3): size on disk", "CachedLoader, zstd store",
        "generate epoch (memmap): with / without the limit", "shuffle: spread in a batch (std / N), full / block",
        "shuffle: sorted neighbours from one block, full / block", "shuffle: blocks per batch, full / block"]


def markdown_section(result: dict) -> list[str]:
    """The report's section of this scenario: the conditions, then one column per sample size."""
    from .tables import md_table

    limit = result["limit_bytes"]
    if result["mode"] == "cgroup":
        how = (f"The reading processes ran in a child memory cgroup limited to {limit / 2**20:.0f} MiB "
               f"(mode `cgroup`: {result['cgroup']}; removed after the run).")
    else:
        how = (f"Mode `evict` ({result.get('why_evict', 'asked for')}): no memory limit; the store's pages were "
               f"dropped before every measurement and the loader was told a memory room of "
               f"{limit / 2**20:.0f} MiB, so it streams. Reads through a mapping keep their pages within an "
               "epoch here, which flatters torch, lmdb and zstd; no generate ratio.")
    peaks = [v["peak_bytes"] for c in result["cases"] for k in ("random", "block")
             for v in [c.get(k) or {}] if v.get("peak_bytes")]
    if peaks:  # the limit reached: the page cache was under pressure, as it should be
        span = sorted({f"{p / 2**20:.0f}" for p in (min(peaks), max(peaks))}, key=float)
        how += f" The cgroup's memory peaked at {'-'.join(span)} MiB in the loader's epochs."
    cols = [_case_column(c, limit) for c in result["cases"]]
    rows = [[name, *(col[i] for col in cols)] for i, name in enumerate(ROWS)]
    return [f"### Larger than memory: stores of {result['store_bytes'] / 1e9:.2f} GB, memory limit "
            f"{limit / 2**20:.0f} MiB, batch {result['batch_size']}, {result['workers']} workers", "",
            how + " Every read starts cold (the store's pages dropped first). GB/s counts sample bytes "
            "(array + label); *pread*: `os.preadv` by 8 threads in a random order, of one record or of one "
            "block of the block order (what its reads can give on this disk). The loader's epochs are timed "
            "once its workers have started; it streams a generation that does not fit the memory room with "
            f"{result['io_threads']} I/O threads (*stream*), lmdb and compressed stores are read through their "
            "mappings by the workers, written without the limit, read under it. torch, lmdb and zstd are "
            f"timed for {result['budget_s']:g} s and extrapolated, the others stop after "
            f"{4 * result['budget_s']:g} s; *timed* says which share of the epoch was. Shuffle: over an "
            "epoch's batches, the spread of a batch's indices (0.29 for uniform draws), the share of "
            "neighbours in its sorted indices that lie in one block of the block order, and the blocks it "
            "draws from.",
            "", md_table(["measure", *(f"{c['sample']} samples" for c in result["cases"])], rows,
                         "l" * (len(cols) + 1))]

def main(argv: list[str] | None = None) -> int:
    """Run the scenario alone and print its section of the report (or, with ``--reader``, one measurement)."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.larger_than_memory",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the sizes of python -m benchmarks --quick")
    parser.add_argument("--mode", choices=["auto", "cgroup", "evict"], default="auto",
                        help="a memory cgroup, page eviction, or the first that works (default)")
    parser.add_argument("--reader", nargs=2, metavar=("PHASE", "ARGS"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.reader:
        return _reader_main(args.reader[0], json.loads(args.reader[1]))
    from .config import SIZES

    size = SIZES["quick" if args.quick else "full"]["larger_than_memory"]
    result = larger_than_memory_scenario(size["limit_mib"] << 20, size["store_mb"] * 10**6, size["budget_s"],
                                         args.mode)
    print("\n".join(markdown_section(result)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
