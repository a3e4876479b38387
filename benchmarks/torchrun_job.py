"""One rank of the torchrun scenario: ``torchrun --standalone --nproc_per_node=4 -m benchmarks.torchrun_job CONFIG``.

:mod:`benchmarks.torchrun_node` launches it. Each rank builds a CachedLoader
over :class:`~benchmarks.counting.CountedExpensiveDataset` with the config's
``scope`` ("node": one store the node's ranks write together and split anew
every epoch; "rank": a store per rank, its part pinned), runs ``epochs``
epochs with an ``all_reduce`` per step (lockstep, as a DDP step would be)
and writes ``rank-<r>.json`` into the config's ``out`` directory: the indices
it served per epoch, each epoch's seconds and ``epoch_stats``.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time


def main(argv: list[str] | None = None) -> int:
    """Run this rank (torch.distributed's environment comes from torchrun); returns the exit status."""
    argv = sys.argv[1:] if argv is None else argv
    config = json.loads(argv[0])
    import torch
    import torch.distributed as dist

    from loader import CachedLoader

    from .counting import CountedExpensiveDataset, stats_dict, wait_children_idle, write_json

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    params = {"n": config["n"], "cost": config["cost"], "counter_dir": config["calls"]}
    cache = {"prefix": config["prefix"], "update_frequency": math.inf, "scope": config["scope"]}
    result: dict = {"rank": rank, "world": world, "scope": config["scope"], "epochs": [], "epoch_s": [],
                    "stats": []}
    try:
        t = time.perf_counter()
        with CachedLoader(CountedExpensiveDataset, params, batch_size=config["batch_size"],
                          nb_worker=config["workers"], seed=config["seed"], cache_setting=cache, progress=False,
                          # nb_worker=0 cannot interrupt the dataset (the loader logs that timeout is moot)
                          timeout=120.0 if config["workers"] > 0 else None) as loader:
            if config["workers"] > 0:
                wait_children_idle(config["workers"])
            result["startup_s"] = time.perf_counter() - t
            result["len"] = len(loader)
            dist.barrier()  # every rank starts its first epoch with its workers ready
            for _ in range(config["epochs"]):
                t = time.perf_counter()
                served: list[int] = []
                for batch in loader:
                    served += batch[1].tolist()
                    step = torch.tensor([len(batch[1])])
                    dist.all_reduce(step)  # lockstep: no rank runs ahead of the others
                result["epoch_s"].append(time.perf_counter() - t)
                result["epochs"].append(served)
                result["stats"].append(stats_dict(loader.epoch_stats[-1]))
        write_json(os.path.join(config["out"], f"rank-{rank}.json"), result)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
