"""What a benchmark run measures and at which sizes: the scenarios, their sizes, the shared constants.

Its own module so that a scenario run on its own (``python -m benchmarks.sweep``) reads the same
sizes as ``python -m benchmarks`` without importing the runner.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESULTS = Path(__file__).resolve().parent / "results"
# memory first: its baseline is then a training process with torch loaded and little else (the memory
# backend's throughput case leaves the heap fragmented: freed memory glibc does not hand back)
SCENARIOS = ["memcpy", "memory",
             # a dataset of a million Python objects, each run a process of its own (memory_objects.py): about
             # 2.5 minutes of a full run
             "memory_objects", "expensive", "rotation", "read_transform", "training_step", "setup_time", "throughput",
             "latency", "larger_than_memory",
             # several processes on one store (sweep.py, torchrun_node.py): about 2.5 minutes of a full run
             "sweep", "torchrun",
             # the remote tier against a local SeaweedFS (remote.py): about a minute of a full run
             "remote",
             # construction and first epoch against torch's (first_epoch.py): about a minute of a full run
             "first_epoch",
             # webdataset tar shards cached against webdataset's shuffle buffer (streams.py): about 2 minutes
             "streams"]

#: Sizes of a full run and of ``--quick``.
SIZES: dict[str, dict[str, Any]] = {
    "full": {"expensive": {"n": 1000, "repeats": 3}, "big_n": 10000, "small_n": 100000, "tp_repeats": 3,
             "rotation": {"n": 1000, "repeats": 3}, "read_transform": {"n": 1000, "repeats": 3},
             "memory": {"n": 1000, "epochs": 4, "k": 2, "cached_n": 4000, "repeats": 3},
             # 10 million objects: 6.8 GiB in the training process; a case whose generate epoch the machine's
             # memory cannot hold (torch's 8 workers copy about half of it each) is left out, saying why
             "memory_objects": {"sizes": [1_000_000, 10_000_000], "workers": [2, 8], "repeats": 1},
             "training_step": {"n": 640, "epochs": 10, "k": 5, "repeats": 3},
             "setup_time": {"n": 640, "repeats": 5},
             "first_batch_repeats": 3, "idle": {"epochs": 2, "repeats": 1},
             # stores of 2 GB read under a 512 MiB limit (why these: benchmarks/larger_than_memory.py)
             "larger_than_memory": {"limit_mib": 512, "store_mb": 2000, "budget_s": 15},
             "sweep": {"n": 600, "repeats": 2}, "torchrun": {"n": 800, "repeats": 2},
             "remote": {"mb": 256, "repeats": 3}, "first_epoch": {"n": 640, "repeats": 3},
             "streams": {"shards": 8, "per_shard": 1000, "epochs": 6, "buffer": 1000, "repeats": 2}},
    "quick": {"expensive": {"n": 300, "repeats": 2}, "big_n": 2000, "small_n": 20000, "tp_repeats": 3,
              "rotation": {"n": 300, "repeats": 2}, "read_transform": {"n": 300, "repeats": 1},
              "memory": {"n": 300, "epochs": 4, "k": 2, "cached_n": 2000, "repeats": 1},
              "memory_objects": {"sizes": [200_000], "workers": [2, 8], "repeats": 1},
              "training_step": {"n": 320, "epochs": 5, "k": 4, "repeats": 1},
              "setup_time": {"n": 384, "repeats": 3},
              "first_batch_repeats": 2, "idle": {"epochs": 1, "repeats": 1},
              "larger_than_memory": {"limit_mib": 384, "store_mb": 1250, "budget_s": 4},
              "sweep": {"n": 200, "repeats": 1}, "torchrun": {"n": 400, "repeats": 1},
              "remote": {"mb": 96, "repeats": 1}, "first_epoch": {"n": 320, "repeats": 2},
              "streams": {"shards": 8, "per_shard": 250, "epochs": 6, "buffer": 1000, "repeats": 1}},
}
COST, WORKERS, BATCH, TP_BATCH, STEP = 0.005, 2, 64, 256, 0.08
#: CPU seconds the set-up scenario's training process spends building its "model" (the set-up target: >= 1 s).
SETUP_GAP = 1.0
BACKENDS = ["memmap", "lmdb", "memory"]
