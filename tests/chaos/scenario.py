"""A chaos scenario drawn from one seed: the loader's settings, its training runs and their faults.

Everything random is drawn here, from ``random.Random(seed)``, so a seed names a scenario
exactly (what happens and where; only the timing of real processes varies). A scenario is
plain data (JSON-able dicts), handed to the training processes as files.

Faults (the rows of the table):

``worker-kill``     SIGKILL of a worker (``loader.worker_pids()``) in the middle of an epoch
``hang``            ``dataset[i]`` never returns in a worker; ``timeout`` is set
``raise``           ``dataset[i]`` raises :class:`~tests.chaos.dataset.ChaosError`
``train-sigkill``   SIGKILL of the training process, then a new run on the same prefix
``train-sigterm``   SIGTERM of the training process, then a new run on the same prefix
``disk-full``       the file system under the prefix fills up (a real tmpfs), maybe freed later
``bitflip``         a byte flipped in committed records between epochs
``second-run``      another run on the same prefix, after the first one
``concurrent-run``  another run on the same prefix, at the same time
``new-version``     a run after the first with another dataset version (``on_mismatch="regenerate"``)
"""

from __future__ import annotations

import math
import random
import signal
from typing import Any

FAULTS = ("worker-kill", "hang", "raise", "train-sigkill", "train-sigterm", "disk-full", "bitflip", "second-run",
          "concurrent-run", "new-version")

#: Relative weights of the faults when a scenario draws them.
WEIGHTS = {"worker-kill": 3, "hang": 2, "raise": 2, "train-sigkill": 2, "train-sigterm": 1, "disk-full": 2,
           "bitflip": 2, "second-run": 1, "concurrent-run": 2, "new-version": 1}

#: Seconds a batch may take when a hang is armed (the loader's ``timeout``).
HANG_TIMEOUTS = (2.0, 3.0)
#: The ``timeout`` of runs without a hang: None (wait) or generous.
PLAIN_TIMEOUTS = (None, 30.0)
#: Size of the tmpfs of a disk-full scenario.
TMPFS_SIZE = "2m"


def batches_per_epoch(s: dict, rotation: bool) -> int:
    """Batches of one epoch (rotation serves each sample R times)."""
    total = s["n"] * (s["rotation"] if rotation else 1)
    return -(-total // s["batch_size"])


def applicable(s: dict) -> list[str]:
    """The faults that make sense for settings `s`."""
    persistent = s["backend"] != "memory"
    cache = s["mode"] == "cache"
    out = ["raise", "train-sigkill", "train-sigterm"]
    if s["nb_worker"] > 0:
        out += ["worker-kill", "hang"]
    if (cache and persistent) or (not cache and s["medium"] == "disk"):
        out += ["disk-full", "second-run", "concurrent-run"]
    if cache and persistent and s["epochs"] >= 2:
        out += ["bitflip", "new-version"]
    return out


def draw(seed: int) -> dict:
    """The scenario of `seed` (see the module docstring)."""
    rng = random.Random(seed)
    s: dict[str, Any] = {
        "seed": seed,
        "backend": rng.choice(["memmap", "lmdb", "memory"]),
        "nb_worker": rng.randint(0, 3),
        "mode": rng.choices(["cache", "rotation"], weights=[3, 1])[0],
        "K": rng.choice([2, 3, None]),  # None: math.inf
        "background_refresh": rng.random() < 0.4,
        "policy": rng.choice(["error", "stream", "rotate"]),
        "medium": rng.choice(["memory", "disk"]),
        "rotation": rng.randint(2, 3),
        "n": rng.randint(12, 40),
        "batch_size": rng.randint(2, 8),
        "epochs": rng.randint(2, 5),
        "delay": rng.choice([0.0, 0.001, 0.003]),
        "loader_seed": rng.randrange(1 << 16),
    }
    s["size"] = rng.randint(s["batch_size"], max(s["batch_size"], s["n"]))  # rotation window
    s["backend"] = s["backend"] if s["mode"] == "cache" else "memmap"
    nb_faults = rng.choices([1, 2, 3], weights=[5, 4, 1])[0]
    pool = applicable(s)
    faults: list[str] = []
    while len(faults) < nb_faults and len(faults) < len(pool):
        kind = rng.choices(pool, weights=[WEIGHTS[k] for k in pool])[0]
        if kind not in faults:
            faults.append(kind)
    # One follow-up run at most: a kill's restart, a second run, or a new version, in that order.
    if any(f.startswith("train-") for f in faults):
        faults = [f for f in faults if f not in ("second-run", "new-version")]
    if "second-run" in faults and "new-version" in faults:
        faults.remove("second-run")
    s["faults"] = faults
    s["tmpfs"] = "disk-full" in faults
    s["timeout"] = rng.choice(HANG_TIMEOUTS) if "hang" in faults else rng.choice(PLAIN_TIMEOUTS)
    s["runs"] = _runs(s, rng)
    return s


def computing_epochs(s: dict) -> list[int]:
    """Epochs of the first run that call the dataset when nothing goes wrong (a cache generates at
    epoch 0 and every K epochs; a refresh computes during cached epochs too)."""
    epochs = range(s["epochs"])
    if s["mode"] != "cache" or (s["background_refresh"] and s["K"]):
        return list(epochs)
    return [e for e in epochs if e == 0 or (s["K"] and e % s["K"] == 0)]


def _point(s: dict, rng: random.Random, rotation: bool, epochs: int, first_epoch: int = 0) -> tuple[int, int]:
    """A random moment: (epoch, batch after which it happens; -1 = before the epoch's first batch)."""
    epoch = rng.randrange(first_epoch, epochs)
    return epoch, rng.randrange(-1, batches_per_epoch(s, rotation))


def _runs(s: dict, rng: random.Random) -> list[dict]:
    rotation = s["mode"] == "rotation"
    faults = s["faults"]
    first: dict[str, Any] = {"name": "run1", "version": 1, "nb_worker": s["nb_worker"], "epochs": s["epochs"],
                             "actions": [], "on_mismatch": "error", "kill": None, "after": None}
    acts = first["actions"]
    if "worker-kill" in faults:
        for _ in range(rng.randint(1, 2)):
            e, b = _point(s, rng, rotation, s["epochs"])
            acts.append({"kind": "kill-worker", "epoch": e, "batch": max(b, 0), "which": rng.randrange(3)})
    for kind in ("raise", "hang"):
        if kind in faults:
            # Armed early in an epoch that computes samples, so that it fires more often than not.
            e = rng.choice(computing_epochs(s))
            b = rng.randrange(-1, max(0, batches_per_epoch(s, rotation) // 2))
            acts.append({"kind": f"arm-{kind}", "epoch": e, "batch": b, "index": rng.randrange(s["n"])})
    if "bitflip" in faults:
        e = rng.randrange(1, s["epochs"])
        acts.append({"kind": "flip", "epoch": e, "batch": -1, "count": rng.randint(1, 3),
                     "seed": rng.randrange(1 << 30)})
    if "disk-full" in faults:
        e, b = _point(s, rng, rotation, s["epochs"])
        acts.append({"kind": "fill-disk", "epoch": e, "batch": b})
        if e + 1 < s["epochs"] and rng.random() < 0.6:
            acts.append({"kind": "free-disk", "epoch": rng.randrange(e + 1, s["epochs"]), "batch": -1})
    for sig in ("sigkill", "sigterm"):
        if f"train-{sig}" in faults and first["kill"] is None:
            e, b = _point(s, rng, rotation, s["epochs"])
            first["kill"] = {"signal": int(signal.SIGKILL if sig == "sigkill" else signal.SIGTERM),
                             "epoch": e, "batch": b, "delay": round(rng.uniform(0.0, 0.15), 3)}
    acts.sort(key=lambda a: (a["epoch"], a["batch"]))
    runs = [first]
    follow = {"name": "run2", "version": 1, "nb_worker": rng.randint(0, 3), "epochs": rng.randint(1, 3),
              "actions": [], "on_mismatch": "error", "kill": None, "after": "run1"}
    if first["kill"] is not None or "second-run" in faults:
        runs.append(follow)
    elif "new-version" in faults:
        runs.append({**follow, "version": 2, "on_mismatch": "regenerate"})
    if "concurrent-run" in faults:
        runs.append({**follow, "name": "run-c", "after": None, "epochs": rng.randint(1, s["epochs"])})
    return runs


def loader_settings(s: dict, run: dict, prefix: str, rotation_dir: str, ctl: str) -> dict:
    """Keyword arguments of ``CachedLoader`` for `run` of scenario `s` (the dataset class aside)."""
    kwargs: dict[str, Any] = {
        "dataset_params": {"n": s["n"], "version": run["version"], "ctl": ctl, "delay": s["delay"]},
        "batch_size": s["batch_size"], "nb_worker": run["nb_worker"], "seed": s["loader_seed"],
        "max_queue_size": 4, "timeout": s["timeout"] if run["nb_worker"] else None,
    }
    if s["mode"] == "cache":
        kwargs["cache_setting"] = {"prefix": prefix, "update_frequency": s["K"] if s["K"] else math.inf,
                                   "backend": s["backend"],
                                   # drawn True: refresh wherever it can run ("auto"); True would refuse
                                   # the settings where it cannot (memory backend, K=inf, no workers)
                                   "background_refresh": "auto" if s["background_refresh"] else False,
                                   "on_budget_exceeded": s["policy"], "on_mismatch": run["on_mismatch"]}
    else:
        setting = {"medium": s["medium"], "rotation": s["rotation"], "size": s["size"]}
        if s["medium"] == "disk":
            setting["prefix"] = rotation_dir
        kwargs["rotation_setting"] = setting
    return kwargs


def describe(s: dict) -> str:
    """One line: the settings and faults of scenario `s`."""
    what = (f"cache {s['backend']} K={s['K'] or 'inf'}{' refresh' if s['background_refresh'] else ''} "
            f"policy={s['policy']}" if s["mode"] == "cache"
            else f"rotation {s['medium']} R={s['rotation']} S={s['size']}")
    runs = " ".join(f"{r['name']}(w={r['nb_worker']},e={r['epochs']},v={r['version']})" for r in s["runs"])
    return (f"seed {s['seed']}: {what}, n={s['n']} bs={s['batch_size']} timeout={s['timeout']}; "
            f"faults {','.join(s['faults'])}; {runs}")
