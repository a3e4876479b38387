"""Run under ``torchrun --nproc_per_node=2``: each rank caches its own stream into the node's store.

Usage: ``torchrun ... ranks_script.py OUT_DIR --sizes 30,20 [--epochs E] [--workers W] [--k K]
[--fail-rank R --fail-after N] [--break-rank R --break-after B] [--stop-after B] [--resume]
[--prefix P] [--remote URL]``.
Every rank builds the same :class:`RankStream` (one fingerprint for the node's store); inside
``__iter__`` it takes its rank's samples, ``rank * 1000 + k``, split between its workers. Each rank
writes ``rank<r>.json`` (``rank<r>-resumed.json`` with ``--resume``): per epoch the ids it served,
its batches, the stream's iterations so far, what the epoch computed and ``len(loader)`` after it;
or the error it stopped with."""

from __future__ import annotations

import argparse
import json
import os
import pickle
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
import torch.distributed as dist
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "..", ".."))

from loader import CachedLoader  # noqa: E402


def this_rank() -> int:
    """The rank, as a stream in a worker finds it (torch.distributed where it is initialised, else torchrun's)."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ["RANK"])


class RankStream(IterableDataset):
    """Rank r yields ``sizes[r]`` samples ``r * 1000 + k``, worker w of W every W-th; each ``__iter__``
    appends a line to ``<log>-<rank>``; rank `fail_rank` raises ``LookupError`` after `fail_after` samples."""

    def __init__(self, sizes: list[int], log: str, fail_rank: int = -1, fail_after: int = 0) -> None:
        self.sizes, self.log, self.fail_rank, self.fail_after = sizes, log, fail_rank, fail_after

    def __iter__(self) -> Iterator[dict]:
        rank, info = this_rank(), get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        with open(f"{self.log}-{rank}", "a") as f:
            f.write(f"{os.getpid()} {worker}\n")
        for k in range(worker, self.sizes[rank], workers):
            if rank == self.fail_rank and k >= self.fail_after:
                raise LookupError(f"rank {rank} lost its shard at sample {k}")
            yield {"id": rank * 1000 + k, "x": np.full((4,), k, dtype=np.float32)}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--sizes", default="30,20")
    parser.add_argument("--epochs", type=int, default=4)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--fail-rank", type=int, default=-1)
    parser.add_argument("--fail-after", type=int, default=0)
    parser.add_argument("--k", type=int, default=0, help="update_frequency (0: never)")
    parser.add_argument("--break-rank", type=int, default=-1, help="this rank's loop breaks off epoch 0 ...")
    parser.add_argument("--break-after", type=int, default=0, help="... after this many batches")
    parser.add_argument("--stop-after", type=int, default=0, help="each rank saves its state after this many "
                        "batches of epoch 0 and the job stops")
    parser.add_argument("--resume", action="store_true", help="each rank loads the state it saved")
    parser.add_argument("--prefix", default=None, help="the cache's prefix (default: OUT/cache)")
    parser.add_argument("--remote", default=None, help="cache_setting['remote']")
    args = parser.parse_args()
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    result: dict = {"rank": rank, "epochs": [], "batches": [], "iterations": [], "computed": [], "len": []}
    loader: CachedLoader | None = None
    try:
        stream = RankStream([int(n) for n in args.sizes.split(",")], os.path.join(args.out, "iterations"),
                            args.fail_rank, args.fail_after)
        with CachedLoader(stream, batch_size=4, num_workers=args.workers, shuffle=True, seed=5, timeout=60,
                          cache_setting={"prefix": args.prefix or os.path.join(args.out, "cache"),
                                         **({"update_frequency": args.k} if args.k else {}),
                                         **({"remote": args.remote} if args.remote else {})}) as loader:
            if args.resume:
                loader.load_state_dict(pickle.loads(Path(args.out, f"state{rank}.pkl").read_bytes()))
            serve(loader, args, rank, result)
    except Exception as exc:
        result["error"] = f"{type(exc).__name__}: {exc}"
        stats = loader.epoch_stats if loader is not None else []
        result["computed"].append(stats[-1].computed if stats else None)
        raise
    finally:
        Path(args.out, f"rank{rank}{'-resumed' if args.resume else ''}.json").write_text(json.dumps(result))
        dist.barrier()  # torchrun stops every rank once one exits: each has said how it ended first
        dist.destroy_process_group()


def serve(loader: CachedLoader, args: argparse.Namespace, rank: int, result: dict) -> None:
    """The epochs, recorded into `result` (see the module docstring)."""
    log = Path(args.out, f"iterations-{rank}")
    for _ in range(args.epochs):
        served: list[int] = []
        batches = 0
        for batch in loader:
            served += batch["id"].tolist()
            batches += 1
            if rank == args.break_rank and loader.epoch == 0 and batches == args.break_after:
                break
            if loader.epoch == 0 and batches == args.stop_after:
                Path(args.out, f"state{rank}.pkl").write_bytes(pickle.dumps(loader.state_dict()))
                result["epochs"].append(served)
                return
        result["epochs"].append(served)
        result["batches"].append(batches)
        result["computed"].append(loader.epoch_stats[-1].computed)
        result["iterations"].append(len(log.read_text().splitlines()))
        try:
            result["len"].append(len(loader))
        except TypeError:  # nothing committed: a stream without len() has none yet (torch's error)
            result["len"].append(None)


if __name__ == "__main__":
    main()
