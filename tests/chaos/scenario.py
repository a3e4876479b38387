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

Ordinary accidents:

``double-sigint``     Ctrl-C (SIGINT to the run's process group) once, or twice in quick succession, in the
                      middle of an epoch: the run ends with KeyboardInterrupt; a new run on the prefix follows
``rm-prefix``         ``rm -rf`` of the cache prefix during an epoch (a read epoch may be refreshing the next
                      generation in the background)
``readonly-remount``  the prefix's tmpfs remounted read-only between the runs (a follow-up run only reads) or
                      between two epochs of a run
``prune-live``        ``cachestore prune PREFIX --keep 0`` (or ``Store.prune(keep=0)``) while an epoch reads

Streams: about half the scenarios of a persistent cache, the error policy and only faults a stream
takes (:data:`STREAM_FAULTS`) serve :class:`~tests.chaos.dataset.ChaosStream`, an iterable dataset
(``worker-kill`` then fails the epoch: a stream cannot be taken up where its worker died); half of
those with at most one worker an endless one, cached as its first ``n`` samples (``stream_samples``).
Drawn from generators of their own: the other draws of a seed stay what they were.

Cooperating processes (memmap, whose runs write a generation together):

``coop-kill-claim``   2-4 runs start together (a file barrier) with their own seeds, batch sizes and workers;
                      one is SIGKILLed (its whole process group) inside its k-th dataset call, holding claims
``coop-kill-commit``  the same, but the member that commits is SIGKILLed at a drawn step of the commit; a new run
                      on the prefix follows
``coop-disk-full``    the same runs on a small tmpfs that fills up (maybe freed later)
"""

from __future__ import annotations

import math
import random
import signal
from typing import Any

FAULTS = ("worker-kill", "hang", "raise", "train-sigkill", "train-sigterm", "disk-full", "bitflip", "second-run",
          "concurrent-run", "new-version", "double-sigint", "rm-prefix", "readonly-remount", "prune-live",
          "coop-kill-claim", "coop-kill-commit", "coop-disk-full")

#: The faults of the suite's first version (see :func:`draw`).
ORIGINAL = FAULTS[:10]

#: Relative weights of the faults when a scenario draws them.
WEIGHTS = {"worker-kill": 3, "hang": 2, "raise": 2, "train-sigkill": 2, "train-sigterm": 1, "disk-full": 2,
           "bitflip": 2, "second-run": 1, "concurrent-run": 2, "new-version": 1, "double-sigint": 2,
           "rm-prefix": 2, "readonly-remount": 2, "prune-live": 2, "coop-kill-claim": 5, "coop-kill-commit": 5,
           "coop-disk-full": 4}

#: Faults that end the first run with a signal (one per scenario), each followed by a new run.
KILLS = ("train-sigkill", "train-sigterm", "double-sigint")
#: Faults of cooperating runs (one per scenario; they include a concurrent run of their own).
COOP = ("coop-kill-claim", "coop-kill-commit", "coop-disk-full")
#: Steps of a shared commit (cachestore/write/shared.py) at which coop-kill-commit kills the committing member:
#: right after its record is marked ``committing``, after the copies the done map does not name are dropped,
#: just before the backend's commit (claim files gone), right after it (the generation is published, the
#: members' lock file not yet removed).
COMMIT_STAGES = ("marked", "canonical", "before-publish", "published")
#: Seconds per dataset call in cooperation scenarios: long enough for the runs' epochs to overlap.
COOP_DELAYS = (0.01, 0.03)

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
        out += ["bitflip", "new-version", "prune-live"]
    out += ["double-sigint"]
    if cache and persistent:
        out += ["rm-prefix", "readonly-remount"]
    if cache and s["backend"] == "memmap":
        out += list(COOP)
    return out


def draw(seed: int, kinds: tuple[str, ...] = FAULTS) -> dict:
    """The scenario of `seed` (see the module docstring), its faults drawn among `kinds`.

    :data:`ORIGINAL` draws exactly what every seed drew before the ordinary accidents and the
    cooperating processes joined the suite: the regression tests named after a seed of that time
    keep their scenario.
    """
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
    pool = [f for f in applicable(s) if f in kinds]
    faults: list[str] = []
    while len(faults) < nb_faults and len(faults) < len(pool):
        kind = rng.choices(pool, weights=[WEIGHTS[k] for k in pool])[0]
        if kind not in faults:
            faults.append(kind)
    # One kill at most (the first drawn): of the training process, or of a cooperating member.
    kill = next((f for f in faults if f in KILLS + COOP[:2]), None)
    faults = [f for f in faults if f not in KILLS + COOP[:2] or f == kill]
    # One set of cooperating runs at most; it is the concurrent run, and its disk fills or not.
    coop = next((f for f in faults if f in COOP), None)
    faults = [f for f in faults if f not in COOP or f == coop]
    if coop is not None:
        faults = [f for f in faults if f not in ("concurrent-run", "readonly-remount")
                  and not (f == "disk-full" and coop == "coop-disk-full")]
    # A read-only file system cannot be cleaned after a kill, nor take a new version.
    if "readonly-remount" in faults:
        faults = [f for f in faults if f not in KILLS + ("new-version",)]
    # One follow-up run at most: a kill's restart, a second run, or a new version, in that order.
    if any(f in KILLS for f in faults):
        faults = [f for f in faults if f not in ("second-run", "new-version")]
    if "second-run" in faults and "new-version" in faults:
        faults.remove("second-run")
    s["faults"] = faults
    s["tmpfs"] = any(f in faults for f in ("disk-full", "coop-disk-full", "readonly-remount"))
    if coop is not None:
        s["delay"] = rng.choice(COOP_DELAYS)
    s["timeout"] = rng.choice(HANG_TIMEOUTS) if "hang" in faults else rng.choice(PLAIN_TIMEOUTS)
    s["runs"] = _runs(s, rng)
    s["stream"] = is_stream_scenario(s)
    # An endless stream, cached as its first n samples (stream_samples): one iterator (at most one worker), so
    # that those are samples 0..n-1, each once.
    s["endless"] = s["stream"] and all(r["nb_worker"] <= 1 for r in s["runs"]) and \
        random.Random(s["seed"] * 7919 + 18).random() < 0.5
    if s["stream"]:
        s["background_refresh"] = False  # a stream's next generation is iterated in its own epoch
    return s


#: Faults a stream scenario may have: the others do not apply to a stream yet (a worker's death or hang fails
#: a stream's epoch; budget policies, rotation and cooperating runs are map-style only).
STREAM_FAULTS = frozenset({"raise", "train-sigkill", "train-sigterm", "disk-full", "second-run", "bitflip",
                           "double-sigint", "worker-kill"})


def is_stream_scenario(s: dict) -> bool:
    """Whether the dataset of scenario `s` is a stream (:class:`tests.chaos.dataset.ChaosStream`): drawn from a
    generator of its own, so that every seed's other draws stay what they were."""
    eligible = (s["mode"] == "cache" and s["backend"] != "memory" and s["policy"] == "error"
                and set(s["faults"]) <= STREAM_FAULTS)
    return eligible and random.Random(s["seed"] * 7919 + 17).random() < 0.5


def computing_epochs(s: dict) -> list[int]:
    """Epochs of the first run that call the dataset when nothing goes wrong (a cache generates at
    epoch 0 and every K epochs; a refresh computes during cached epochs too)."""
    epochs = range(s["epochs"])
    if s["mode"] != "cache" or (s["background_refresh"] and s["K"]):
        return list(epochs)
    return [e for e in epochs if e == 0 or (s["K"] and e % s["K"] == 0)]


def _point(s: dict, rng: random.Random, rotation: bool, epochs: int, first_epoch: int = 0,
           batch_size: int | None = None) -> tuple[int, int]:
    """A random moment: (epoch, batch after which it happens; -1 = before the epoch's first batch)."""
    epoch = rng.randrange(first_epoch, epochs)
    return epoch, rng.randrange(-1, batches_per_epoch({**s, "batch_size": batch_size or s["batch_size"]}, rotation))


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
        acts += _fill(s, rng, rotation, s["epochs"])
    for sig in ("sigkill", "sigterm"):
        if f"train-{sig}" in faults and first["kill"] is None:
            e, b = _point(s, rng, rotation, s["epochs"])
            first["kill"] = {"signal": int(signal.SIGKILL if sig == "sigkill" else signal.SIGTERM),
                             "epoch": e, "batch": b, "delay": round(rng.uniform(0.0, 0.15), 3)}
    if "double-sigint" in faults:
        e, b = _point(s, rng, rotation, s["epochs"])
        first["kill"] = {"signal": int(signal.SIGINT), "epoch": e, "batch": b,
                         "delay": round(rng.uniform(0.0, 0.15), 3),
                         "again": round(rng.uniform(0.01, 0.3), 3) if rng.random() < 0.6 else None}
    if "rm-prefix" in faults:
        e, b = _point(s, rng, rotation, s["epochs"])
        acts.append({"kind": "rm-prefix", "epoch": e, "batch": b})
    if "prune-live" in faults:
        e = rng.randrange(1, s["epochs"])
        b = rng.randrange(0, max(1, batches_per_epoch(s, rotation) - 1))
        acts.append({"kind": "prune", "epoch": e, "batch": b, "how": rng.choice(["cli", "library"])})
    remount_between_runs = False
    if "readonly-remount" in faults:
        if s["epochs"] >= 2 and rng.random() < 0.5:
            acts.append({"kind": "remount-ro", "epoch": rng.randrange(1, s["epochs"]), "batch": -1})
        else:
            remount_between_runs = True
    acts.sort(key=lambda a: (a["epoch"], a["batch"]))
    runs = [first]
    follow = {"name": "run2", "version": 1, "nb_worker": rng.randint(0, 3), "epochs": rng.randint(1, 3),
              "actions": [], "on_mismatch": "error", "kill": None, "after": "run1"}
    if first["kill"] is not None or "second-run" in faults or remount_between_runs:
        runs.append(follow)
    elif "new-version" in faults:
        runs.append({**follow, "version": 2, "on_mismatch": "regenerate"})
    if remount_between_runs:
        follow["setup"] = ["remount-ro"]  # done by the runner once run1 has ended
    if "concurrent-run" in faults:
        runs.append({**follow, "name": "run-c", "after": None, "epochs": rng.randint(1, s["epochs"])})
    coop = next((f for f in faults if f in COOP), None)
    if coop is not None:
        runs[1:1] = _cooperators(s, rng, first, coop)
        if coop == "coop-kill-commit" and not any(r["after"] for r in runs):
            runs.append(follow)  # it must find a sound generation, whatever the commit's kill left
    return runs


def _fill(s: dict, rng: random.Random, rotation: bool, epochs: int, batch_size: int | None = None) -> list[dict]:
    """The actions of a disk that fills up at a random moment, and maybe is freed later."""
    e, b = _point(s, rng, rotation, epochs, batch_size=batch_size)
    acts = [{"kind": "fill-disk", "epoch": e, "batch": b}]
    if e + 1 < epochs and rng.random() < 0.6:
        acts.append({"kind": "free-disk", "epoch": rng.randrange(e + 1, epochs), "batch": -1})
    return acts


def _cooperators(s: dict, rng: random.Random, first: dict, coop: str) -> list[dict]:
    """The runs that start together with `first` on its prefix (`first` joins their barrier), and the
    fault `coop` placed among them."""
    others = [{"name": f"coop{k}", "version": 1, "nb_worker": rng.randint(0, 2), "epochs": rng.randint(1, s["epochs"]),
               "actions": [], "on_mismatch": "error", "kill": None, "after": None,
               "batch_size": rng.randint(2, 8), "loader_seed": rng.randrange(1 << 16)}
              for k in range(1, rng.choices([1, 2, 3], weights=[3, 2, 1])[0] + 1)]
    group = [first] + others
    for run in group:
        run["barrier"] = len(group)
    if coop == "coop-kill-claim":
        # Inside the target's k-th dataset call (which holds the sample's claim), whichever sample it is: the
        # others compute part of every generation, so a moment in epochs would often find nothing to kill.
        target = rng.choice(group)
        target["kill"] = {"signal": int(signal.SIGKILL), "how": "claim",
                          "calls": rng.randint(1, max(1, s["n"] // (2 * len(group))))}
    elif coop == "coop-kill-commit":
        stage = rng.choice(COMMIT_STAGES)
        for run in group:  # whichever member commits first is killed (one kill: an armed file, renamed once)
            run["kill"] = {"signal": int(signal.SIGKILL), "how": "commit", "stage": stage}
    else:
        target = rng.choice(group)
        target["actions"] = sorted(target["actions"] + _fill(s, rng, False, target["epochs"],
                                                             target.get("batch_size")),
                                   key=lambda a: (a["epoch"], a["batch"]))
    return others


def loader_settings(s: dict, run: dict, prefix: str, rotation_dir: str, ctl: str) -> dict:
    """Keyword arguments of ``CachedLoader`` for `run` of scenario `s` (the dataset class aside)."""
    kwargs: dict[str, Any] = {
        "dataset_params": {"n": s["n"], "version": run["version"], "ctl": ctl, "delay": s["delay"]},
        "batch_size": run.get("batch_size", s["batch_size"]), "nb_worker": run["nb_worker"],
        "seed": run.get("loader_seed", s["loader_seed"]),
        "max_queue_size": 4, "timeout": s["timeout"] if run["nb_worker"] else None,
    }
    if s["mode"] == "cache":
        kwargs["cache_setting"] = {"prefix": prefix, "update_frequency": s["K"] if s["K"] else math.inf,
                                   "backend": s["backend"],
                                   # drawn True: refresh wherever it can run ("auto"); True would refuse
                                   # the settings where it cannot (memory backend, K=inf, no workers)
                                   "background_refresh": "auto" if s["background_refresh"] else False,
                                   "on_budget_exceeded": s["policy"], "on_mismatch": run["on_mismatch"]}
        if s.get("stream"):  # shuffled as map-style data is by default: a buffer first, a permutation after
            kwargs["cache_setting"]["stream_buffer"] = 8
            kwargs.update(shuffle=True, stream=True)
            if s.get("endless"):
                kwargs["cache_setting"]["stream_samples"] = s["n"]
                kwargs["dataset_params"]["endless"] = True
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
    if s.get("stream"):
        what += " endless stream" if s.get("endless") else " stream"
    runs = " ".join(f"{r['name']}(w={r['nb_worker']},e={r['epochs']},v={r['version']}"
                    + (f",bs={r['batch_size']}" if "batch_size" in r else "") + ")" for r in s["runs"])
    return (f"seed {s['seed']}: {what}, n={s['n']} bs={s['batch_size']} timeout={s['timeout']}; "
            f"faults {','.join(s['faults'])}; {runs}")
