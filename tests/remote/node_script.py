"""One node of a job whose nodes share a remote: run under ``torchrun --nnodes=2`` (one per node), or
as a plain process with ``--node K --nodes M`` (no torchrun, no process group). Results to JSON.

Usage: ``node_script.py OUT_DIR PREFIX REMOTE_URL [--node K --nodes M] [--epochs E] [--workers W]
[--kill-at I] [--part-timeout S] [--n N]``. The endpoint and credentials come from the environment
(``AWS_ENDPOINT_URL``, ``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``). Dataset calls are logged per
process into ``OUT_DIR/calls-<node>``; ``--kill-at I``: the process kills itself (SIGKILL) when the
dataset is asked for sample I, before its part is published.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loader import CachedLoader  # noqa: E402
from tests.loader.datasets import ArangeDataset, KillSelfDataset, read_calls  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("prefix")
    parser.add_argument("remote")
    parser.add_argument("--node", type=int, default=None)
    parser.add_argument("--nodes", type=int, default=None)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--workers", type=int, default=0)
    parser.add_argument("--kill-at", type=int, default=None)
    parser.add_argument("--part-timeout", type=float, default=120.0)
    parser.add_argument("--n", type=int, default=48)
    parser.add_argument("--k", type=float, default=None)  # update_frequency (the default: never rewrite)
    parser.add_argument("--stop-after", type=int, default=None)  # batches of an epoch, then state-<rank>.json
    parser.add_argument("--stop-epoch", type=int, default=0)  # the epoch (of this run) --stop-after stops in
    parser.add_argument("--resume", action="store_true")  # from state-<rank>.json; writes node<rank>-resumed.json
    parser.add_argument("--resume-from", type=int, default=None)  # every rank resumes from state-<this>.json
    parser.add_argument("--start-timeout", type=float, default=20.0)
    parser.add_argument("--retry-timeout", type=float, default=None)
    args = parser.parse_args()
    synced = args.node is None
    if synced:
        import torch
        import torch.distributed as dist

        dist.init_process_group("gloo")
        rank = dist.get_rank()
        ranks: dict[str, int] = {}
        nodes: dict[str, int] = {}
    else:
        rank = args.node
        ranks = {"nb_consumer": args.nodes, "consumer_index": args.node}
        nodes = {"nb_node": args.nodes, "node_rank": args.node}
    calls = os.path.join(args.out, f"calls-{rank}")
    os.makedirs(calls, exist_ok=True)
    params: dict[str, object] = {"n": args.n, "counter_dir": calls}
    dataset: type = ArangeDataset
    if args.kill_at is not None:
        dataset, params["kill_at"] = KillSelfDataset, args.kill_at
    cache = {"prefix": args.prefix, "remote": args.remote, "fingerprint": "nodes-test", "part_timeout": args.part_timeout,
             "start_timeout": args.start_timeout, **nodes}
    if args.k is not None:
        cache["update_frequency"] = int(args.k)
    if args.retry_timeout is not None:  # the endpoint and credentials still come from the environment
        cache["storage_options"] = {"retry_timeout": args.retry_timeout, "max_retries": 2}
    loader = CachedLoader(dataset, params, batch_size=4, nb_worker=args.workers, seed=11, cache_setting=cache, **ranks)
    result: dict[str, object] = {"rank": rank, "len": len(loader), "epochs": [], "modes": [], "computed": []}
    state_file = os.path.join(args.out, f"state-{rank}.json")
    if args.resume or args.resume_from is not None:
        with open(os.path.join(args.out, f"state-{rank if args.resume_from is None else args.resume_from}.json")) as f:
            loader.load_state_dict(json.load(f))
    with loader:
        for epoch in range(args.epochs):
            served: list[int] = []
            for batch in loader:
                served += batch["y"].tolist()
                if synced:
                    dist.all_reduce(torch.tensor([len(batch["y"])]))  # lockstep, as a DDP step would be
                if args.stop_after is not None and epoch == args.stop_epoch and len(served) == args.stop_after * 4:
                    with open(state_file, "w") as f:
                        json.dump(loader.state_dict(), f)
                    break
            result["epochs"].append(served)  # type: ignore[attr-defined]
            result["modes"].append(loader.epoch_stats[-1].mode.value)  # type: ignore[attr-defined]
            result["computed"].append(loader.epoch_stats[-1].computed)  # type: ignore[attr-defined]
        result["store"] = loader.store.path if loader.store is not None else None
    result["calls"] = sorted(read_calls(calls))
    resumed = args.resume or args.resume_from is not None
    with open(os.path.join(args.out, f"node{rank}{'-resumed' if resumed else ''}.json"), "w") as f:
        json.dump(result, f)
    if synced:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
