"""Run under ``torchrun --nproc_per_node=N``: one leg of a run whose number of ranks changes between legs.

Usage: ``torchrun ... elastic_script.py PREFIX OUT_DIR [--state FILE] [--steps K] [--epochs E] [--workers W]``.
Every rank builds the same cached loader on PREFIX (one store for the node), loads the state in FILE
(the last leg's, taken by its rank 0) before iterating, serves K steps (every rank one batch a step, in
lockstep as DDP steps are; to the end of epoch E-1 without ``--steps``), and writes
``OUT_DIR/rank<r>.json``: the batches it served with their epochs, and its state after them.
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
from tests.loader.datasets import ArangeDataset  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("prefix")
    parser.add_argument("out")
    parser.add_argument("--state")
    parser.add_argument("--steps", type=int, default=-1)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--workers", type=int, default=1)
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    loader = CachedLoader(ArangeDataset, {"n": 45}, batch_size=4, nb_worker=args.workers, seed=7,
                          cache_setting={"prefix": args.prefix, "update_frequency": 2})
    if args.state:
        with open(args.state) as f:
            loader.load_state_dict(json.load(f))
    served, left = [], args.steps
    with loader:
        while left != 0:
            it = iter(loader)
            epoch = loader.epoch
            if epoch >= args.epochs:
                break
            for batch in it:
                served.append([epoch, batch["y"].tolist()])
                dist.all_reduce(torch.tensor([1]))  # lockstep, as a DDP step would be
                left -= 1
                if left == 0:
                    break
        state = loader.state_dict()
    dist.barrier()
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, f"rank{rank}.json"), "w") as f:
        json.dump({"served": served, "state": state}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
