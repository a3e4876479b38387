"""A training process that serves some batches of a generate epoch, says so, and waits to be killed.

python -m tests.loader.partial_script PREFIX CALLS_DIR SERVED.json --backend B --nb-worker W --stop-after N

After N batches it writes what it served (``[[index, value], ...]``, value being the mean of ``x``)
to SERVED.json, prints ``ready`` and blocks on stdin; the test SIGKILLs it there.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

from loader import CachedLoader

from .datasets import ArangeDataset

N, BATCH = 40, 4


def make_loader(prefix: str, calls_dir: str, backend: str, nb_worker: int) -> CachedLoader:
    return CachedLoader(ArangeDataset, {"n": N, "shape": [3], "counter_dir": calls_dir, "augment": True},
                        batch_size=BATCH, nb_worker=nb_worker, seed=7, max_queue_size=2,
                        cache_setting={"prefix": prefix, "backend": backend})


def served_values(batch: dict) -> list[list[float]]:
    x = np.asarray(batch["x"]).reshape(len(batch["y"]), -1).mean(axis=1)
    return [[int(i), round(float(v), 5)] for i, v in zip(batch["y"].tolist(), x)]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("calls_dir")
    parser.add_argument("served")
    parser.add_argument("--backend", default="memmap")
    parser.add_argument("--nb-worker", type=int, default=0)
    parser.add_argument("--stop-after", type=int, default=3)
    args = parser.parse_args()
    loader = make_loader(args.prefix, args.calls_dir, args.backend, args.nb_worker)
    served: list = []
    for step, batch in enumerate(loader):
        served += served_values(batch)
        if step + 1 == args.stop_after:
            break_point = os.path.join(os.path.dirname(args.served), "served.tmp")
            with open(break_point, "w") as f:
                json.dump(served, f)
            os.rename(break_point, args.served)
            print("ready", flush=True)
            sys.stdin.read()  # killed here, mid generate epoch, with its iterator alive
    raise SystemExit("not killed")  # pragma: no cover


if __name__ == "__main__":
    main()
