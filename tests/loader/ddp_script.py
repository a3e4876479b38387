"""Run under ``torchrun --nproc_per_node=N``: one CachedLoader per rank, results to JSON.

Usage: ``torchrun ... ddp_script.py OUT_DIR [--fail-rank R] [--cache] [--scope node|rank] [--workers W]
[--epochs E] [--per-rank-params]``. Every rank gives the dataset the same parameters (a store shared
by the node's ranks needs one fingerprint), dataset calls logged per process into one directory;
with ``--per-rank-params`` each rank logs into a directory of its own, ``calls/rank<r>``, a
parameter that differs by rank.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loader import CachedLoader  # noqa: E402
from tests.loader.datasets import AlwaysFails, ArangeDataset, read_calls  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--cache", action="store_true")
    parser.add_argument("--scope", default=None, help="left out: the loader chooses")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--per-rank-params", action="store_true")
    parser.add_argument("--no-dist", action="store_true",
                        help="no process group: the ranks come from torchrun's environment, given by hand")
    args = parser.parse_args()
    synced = not args.no_dist
    if synced:
        dist.init_process_group("gloo")
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    ranks = {} if synced else {"nb_consumer": world, "consumer_index": rank}
    calls = os.path.join(args.out, "calls")
    if args.per_rank_params:  # a per-rank log directory: each rank's dataset has its own fingerprint
        calls = os.path.join(calls, f"rank{rank}")
    os.makedirs(calls, exist_ok=True)
    params = {"n": 45, "counter_dir": calls}
    # Write-through: the test counts dataset calls per epoch (a background refresh moves them earlier).
    cache = ({"prefix": os.path.join(args.out, "cache"), "update_frequency": 2, "background_refresh": False,
              **({"scope": args.scope} if args.scope else {})} if args.cache else None)
    dataset = AlwaysFails if rank == args.fail_rank else ArangeDataset
    loader = CachedLoader(dataset, params, batch_size=4, nb_worker=args.workers, seed=7, cache_setting=cache,
                          **ranks)
    result = {"rank": rank, "world": world, "len": len(loader), "epochs": [], "computed": [], "calls": [],
              "scope": loader.cache.scope if loader.cache is not None else None}
    with loader:
        for _ in range(args.epochs):
            served = []
            for batch in loader:
                served += batch["y"].tolist()
                if synced:
                    total = torch.tensor([len(batch["y"])])
                    dist.all_reduce(total)  # lockstep, as a DDP step would be
            result["epochs"].append(served)
            result["computed"].append(loader.epoch_stats[-1].computed)
            if synced:
                dist.barrier()  # every rank's epoch done: the call log holds the node's calls so far
            result["calls"].append(len(read_calls(calls)))
            if synced:
                dist.barrier()  # and no rank computes the next epoch's samples before every rank has counted
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    if synced:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
