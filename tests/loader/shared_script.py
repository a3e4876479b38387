"""One job of a cooperation test: ``python -m tests.loader.shared_script CONFIG_JSON``.

Jobs started together on one prefix write its generations together. Each one
waits at a file barrier (every job's ``ready-<id>`` file) so they really run at
the same time, serves its epochs and writes what it served, and its epoch
stats, to ``<out>``.
"""

from __future__ import annotations

import json
import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loader import CachedLoader  # noqa: E402
from tests.loader.datasets import ArangeDataset, KillSelfDataset  # noqa: E402

BARRIER_TIMEOUT = 60.0


def barrier(directory: str, me: int, jobs: int) -> None:
    """Wait until all `jobs` jobs reached this point (each leaves a file), at most BARRIER_TIMEOUT."""
    open(os.path.join(directory, f"ready-{me}"), "w").close()
    deadline = time.monotonic() + BARRIER_TIMEOUT
    while sum(name.startswith("ready-") for name in os.listdir(directory)) < jobs:
        if time.monotonic() > deadline:
            raise TimeoutError("the other jobs never started")
        time.sleep(0.005)  # polling a directory: there is no event to wait on across unrelated processes


def run(config: dict) -> dict:
    params = {"n": config["n"], "counter_dir": config["calls"], "delay": config.get("delay", 0.0)}
    dataset: type = ArangeDataset
    if config.get("kill_at") is not None:
        dataset, params = KillSelfDataset, {**params, "kill_at": config["kill_at"]}
    cache = {"prefix": config["prefix"], "update_frequency": config.get("k", float("inf")),
             "fingerprint": "arange", "background_refresh": False}
    result: dict = {"epochs": [], "stats": []}
    with CachedLoader(dataset, params, batch_size=config["batch_size"], nb_worker=config["workers"],
                      seed=config["seed"], cache_setting=cache) as loader:
        if config.get("barrier"):
            barrier(config["barrier"], config["id"], config["jobs"])
        for _ in range(config.get("epochs", 2)):
            served = []
            for batch in loader:
                ys = batch["y"].tolist()
                assert all(float(x[0]) == y for x, y in zip(batch["x"], ys)), "a sample holds another's values"
                served.append(ys)
            result["epochs"].append(served)
            s = loader.epoch_stats[-1]
            result["stats"].append({"mode": str(s.mode), "generation": s.generation, "computed": s.computed,
                                    "read": s.read, "waited": s.waited, "written": s.written,
                                    "committed": s.committed})
    return result


def main() -> None:
    config = json.loads(sys.argv[1])
    result = run(config)
    with open(config["out"], "w") as f:
        json.dump(result, f)


if __name__ == "__main__":
    main()
