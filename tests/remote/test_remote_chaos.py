"""Remote faults drawn from a seed: two nodes (plain processes with ``nb_node``/``node_rank``) computing one
generation through a remote that throttles, restarts, loses a node or goes away.

A seed names a scenario (``draw``); only the timing of the real processes varies. Faults:

``slowdown``       every request goes through a proxy answering some with 503 SlowDown and dropping some
                   connections without an answer (the client retries them)
``restart``        the server is restarted once a node has published something (the clients retry)
``kill-node``      node 1 is SIGKILLed inside a drawn dataset call of its part, before publishing it; node 0
                   computes that part after ``part_timeout``; node 1, run again, fetches the generation
``stop-exchange``  only node 0 runs; the server stops once its part is published: it computes the rest

After each: every node's store holds the whole generation with the dataset's values and nothing else,
a generation visible on the remote fetches whole and equal into a fresh store, none is visible where a
part is missing, and without a lost node or server every sample was computed once across the nodes.
``REMOTE_CHAOS_N=<n>`` runs more seeds than the few of ``make test``.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time

import numpy as np
import pytest

from cachestore import open_store
from cachestore.remote import open_remote

from ..marks import long
from .conftest import options
from .proxy import FaultProxy
from .test_nodes import SCRIPT, node_env, finish, stores_hold_everything

FAULTS = ("slowdown", "restart", "kill-node", "stop-exchange")
SEEDS = range(3701, 3701 + int(os.environ.get("REMOTE_CHAOS_N", "4")))

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def draw(seed: int) -> dict:
    rng = random.Random(seed)
    fault = FAULTS[(seed - SEEDS.start) % len(FAULTS)] if seed - SEEDS.start < len(FAULTS) else rng.choice(FAULTS)
    n = rng.choice([24, 40, 60])
    return {"seed": seed, "fault": fault, "n": n, "workers": rng.choice([0, 1]),
            "kill_at": rng.randrange(n // 2 + 1, n), "slowdown_every": rng.choice([3, 4]),
            "drop_every": rng.choice([5, 7])}


def _node(s: dict, tmp_path, url: str, k: int, env: dict, *extra: str) -> subprocess.Popen:
    out = tmp_path / f"out{k}"
    out.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, str(SCRIPT), str(out), str(tmp_path / f"node{k}"), url, "--node", str(k),
                             "--nodes", "2", "--epochs", "2", "--n", str(s["n"]), "--workers", str(s["workers"]),
                             *extra], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _published(url: str, weed) -> list:
    try:
        return open_remote(url, options(weed)).remote_generations()
    except (OSError, ValueError):  # no store there yet
        return []


def _await(condition, procs: list[subprocess.Popen], what: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        # A node that ended may have done so after the last look: look once more before failing.
        ended = any(p.poll() is not None for p in procs)
        if (ended or time.monotonic() > deadline) and not condition():
            raise AssertionError(f"never saw {what}")
        if ended:
            return
        time.sleep(0.1)  # the nodes' progress on the server: nothing to wait on but a look


# Each seed draws one of the faults: two in make test, every one in make check.
@pytest.mark.parametrize("seed", [seed if seed < SEEDS.start + 2 else pytest.param(seed, marks=long) for seed in SEEDS])
def test_remote_fault(seed, tmp_path, weed, remote_url):
    s = draw(seed)
    n, fault = s["n"], s["fault"]
    env, proxy = node_env(weed), None
    codes: list[tuple[int, str]] = []
    procs: list[subprocess.Popen] = []
    try:
        if fault == "slowdown":
            proxy = FaultProxy(weed.ports["s3.port"], slowdown_every=s["slowdown_every"], drop_every=s["drop_every"])
            env = node_env(weed, f"http://127.0.0.1:{proxy.port}")
        if fault == "kill-node":
            procs = [_node(s, tmp_path, remote_url, 0, env, "--part-timeout", "4"),
                     _node(s, tmp_path, remote_url, 1, env, "--kill-at", str(s["kill_at"]))]
        elif fault == "stop-exchange":
            procs = [_node(s, tmp_path, remote_url, 0, env, "--retry-timeout", "2")]
        else:
            procs = [_node(s, tmp_path, remote_url, k, env) for k in range(2)]
        if fault == "restart":
            # A generation completed between two looks counts: its parts' files are gone then.
            _await(lambda: any(g.complete or g.published or g.claimed for g in _published(remote_url, weed)),
                   procs, "a claim")
            weed.restart()
        if fault == "stop-exchange":
            _await(lambda: any(0 in g.published for g in _published(remote_url, weed)), procs, "part 0")
            weed.stop()
        codes = finish(procs)
    finally:
        for p in procs:  # a failed wait leaves no node running past the test
            if p.poll() is None:
                p.kill()
            p.wait()
            for f in (p.stdout, p.stderr):
                if f is not None:
                    f.close()
        if proxy is not None:
            proxy.close()
        if weed.proc is None:
            weed.start()
    # The killed node dies with its training process (SIGKILL), or of its worker's deaths (an error).
    assert codes[0][0] == 0 and (fault != "kill-node" or codes[1][0] in (-9, 1)), \
        f"{s}\n" + "\n".join(err[-2000:] for _, err in codes)
    assert fault == "kill-node" or all(c == 0 for c, _ in codes), f"{s}\n" + "\n".join(e[-2000:] for _, e in codes)
    calls = [json.loads((tmp_path / f"out{k}" / f"node{k}.json").read_text())["calls"]
             for k in range(2) if (tmp_path / f"out{k}" / f"node{k}.json").exists()]
    if fault in ("slowdown", "restart"):
        logs = "\n".join(err[-3000:] for _, err in codes)
        assert sorted(calls[0] + calls[1]) == list(range(n)), f"{s}\n{logs}"  # each sample once across the nodes
    else:
        assert calls[0] == list(range(n)), s  # node 0 computed its part and the one it lacked
    if fault == "kill-node":  # run again, the killed node fetches what the other completed
        (code, err), = finish([_node(s, tmp_path, remote_url, 1, env)])
        assert code == 0, err[-2000:]
    prefixes = [tmp_path / f"node{k}" for k in range(2 if fault != "stop-exchange" else 1)]
    _stores_hold_everything_of(prefixes, n)
    remote = open_remote(remote_url, options(weed), fingerprint=_fingerprint(prefixes[0]))
    if fault == "stop-exchange":
        assert remote.generation_ids() == [], s  # part 1 was never published: nothing visible
    else:
        fresh = open_store(tmp_path / "fresh", fingerprint=_fingerprint(prefixes[0]))
        remote.fetch(fresh, 0)
        _stores_hold_everything_of([tmp_path / "fresh"], n)


def _fingerprint(prefix) -> dict:
    with open_store(prefix, readonly=True) as store:
        return store.fingerprint


def _stores_hold_everything_of(prefixes, n: int) -> None:
    import tests.remote.test_nodes as nodes

    saved, nodes.N = nodes.N, n
    try:
        stores_hold_everything(prefixes)
    finally:
        nodes.N = saved
    assert np.all(np.arange(n) >= 0)
