"""One cell of the feature matrix: a dataset kind, an executor, a way of caching, a topology, a resume.

Run in the test process (one consumer) or under ``torchrun --nproc_per_node=2`` (``python cell.py
OUT CONFIG_JSON PHASE``): each rank writes ``OUT/<phase>-rank<r>.json`` with what it served, per
epoch (the ids of its samples, and whether each value was the dataset's), what each epoch computed
and, where it stopped, its state (``OUT/state<r>.pkl``).

Datasets: :class:`MatrixMap` (sample i is ``{"id": i, "x": [i, i, i]}``) and :class:`MatrixStream`
(rank r yields ids ``r * 1000 + k``, ``k < n``, split between its workers). Both append each sample
they make to a file of ``calls`` (one per process), so a test counts what was computed anywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import sys
from pathlib import Path
from typing import Iterator

import numpy as np
from torch.utils.data import IterableDataset, get_worker_info

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loader import CachedLoader  # noqa: E402

#: Phases of a cell: the run (stopped where the config says), its resumed run, a second job on the remote.
PHASES = ("run", "resume", "second")


def _made(calls: str, ids: list[int]) -> None:
    with open(os.path.join(calls, f"calls-{os.getpid()}"), "a") as f:
        f.write("".join(f"{i}\n" for i in ids))


def computed(calls: str) -> int:
    """Samples made in every process so far."""
    return sum(len(p.read_text().split()) for p in Path(calls).glob("calls-*"))


def sample(i: int) -> dict:
    return {"id": i, "x": np.full((3,), i, dtype=np.float32)}


class MatrixMap:
    """A map-style dataset of `n` samples (see the module docstring)."""

    def __init__(self, n: int, calls: str) -> None:
        self.n, self.calls = n, calls

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> dict:
        _made(self.calls, [i])
        return sample(int(i))


def this_rank() -> int:
    return int(os.environ.get("RANK", "0"))


class MatrixStream(IterableDataset):
    """Each rank's own stream of `n` samples (see the module docstring)."""

    def __init__(self, n: int, calls: str) -> None:
        self.n, self.calls = n, calls

    def __iter__(self) -> Iterator[dict]:
        info, rank = get_worker_info(), this_rank()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        for k in range(worker, self.n, workers):
            _made(self.calls, [rank * 1000 + k])
            yield sample(rank * 1000 + k)


def build(config: dict, out: Path, phase: str) -> CachedLoader:
    """The cell's loader (its arguments from `config`; a second job has its own prefix)."""
    calls = out / "calls"  # the same in every phase: the path is part of the dataset's identity
    calls.mkdir(exist_ok=True)
    n = config["n"]
    dataset = MatrixStream(n, str(calls)) if config["kind"] == "stream" else MatrixMap(n, str(calls))
    kwargs: dict = {"batch_size": 4, "seed": 7, "timeout": 90}
    if config["kind"] == "map" or config["caching"] in ("cache", "remote"):
        kwargs["shuffle"] = True  # (torch refuses it for a stream; a cache makes it mean something)
    executor = config["executor"]
    kwargs["num_workers"] = 0 if executor == "none" else 2
    if executor == "threads":
        kwargs["use_threading"] = True
    if executor == "ray":
        kwargs["executor"] = "ray"
        kwargs["executor_options"] = {"address": config.get("ray_address"), "num_workers": 2, "start_timeout": 180,
                                      "actor_options": {"num_cpus": 0.5}}
    caching = config["caching"]
    prefix = str(out / ("cache-second" if phase == "second" else "cache"))
    if caching in ("cache", "remote"):
        kwargs["cache_setting"] = {"prefix": prefix, "update_frequency": 2,
                                   "background_refresh": "auto" if config.get("refresh", True) else False,
                                   **({"remote": config["remote"]} if caching == "remote" else {})}
    elif caching.startswith("rotation"):
        medium = caching.split("-")[1]
        kwargs["rotation_setting"] = {"medium": medium, "rotation": 2, "size": 8,
                                      **({"stream_samples": config.get("take", n)} if config["kind"] == "stream" else {}),
                                      **({"prefix": prefix} if medium == "disk" else {})}
    return CachedLoader(dataset, **kwargs)


def run(config: dict, out: Path, phase: str, rank: int = 0) -> dict:
    """Serve the cell's epochs (see the module docstring); what was served, as plain values."""
    result: dict = {"rank": rank, "epochs": [], "computed": [], "modes": [], "error": None, "pids": []}
    stop = config.get("stop") if phase == "run" else None
    try:
        with build(config, out, phase) as loader:
            first = 0
            if phase == "resume":
                source = 0 if config.get("state_from") == "rank0" else rank
                loader.load_state_dict(pickle.loads((out / f"state{source}.pkl").read_bytes()))
                first = loader.epoch
            for epoch in range(first, config["epochs"]):
                served: list[int] = []
                for k, batch in enumerate(loader, 1):
                    ids = [int(i) for i in batch["id"]]
                    if not all(np.array_equal(np.asarray(x), np.full((3,), i, dtype=np.float32))
                               for i, x in zip(ids, batch["x"])):
                        raise AssertionError(f"epoch {epoch}: a sample's values are not the dataset's: {ids}")
                    served += ids
                    if stop is not None and [epoch, k] == list(stop):
                        (out / f"state{rank}.pkl").write_bytes(pickle.dumps(loader.state_dict()))
                        result["epochs"].append(served)
                        result["pids"] = loader.worker_pids()
                        return result
                result["epochs"].append(served)
                result["computed"].append(loader.epoch_stats[-1].computed)
                result["modes"].append(loader.epoch_stats[-1].mode.value)
            result["pids"] = loader.worker_pids()
    except Exception as exc:
        import traceback
        result["error"] = f"{type(exc).__name__}: {exc}"
        result["traceback"] = traceback.format_exc()
    return result


def main() -> None:
    import torch.distributed as dist

    out, config, phase = Path(sys.argv[1]), json.loads(sys.argv[2]), sys.argv[3]
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    try:
        result = run(config, out, phase, rank)
        (out / f"{phase}-rank{rank}.json").write_text(json.dumps(result))
    finally:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
