"""How large a loader's state is, and how long loading it takes, for a dataset of 10 million samples.

A state holds where the run is, never the samples or the order (``docs/ARCHITECTURE.md``, "Resuming"):
its size does not grow with the dataset, and ``load_state_dict()`` checks it without computing the
epoch's order (that waits for the next ``iter()``). Measured mid-epoch (a few batches into a shuffled
epoch) without a cache, with a cache (its generate epoch), and over a stream with its own state; each
time the state's size as pickle and as JSON, and ``load_state_dict()`` into a new loader, the best of
`repeats` in milliseconds (targets: under 64 KiB, under 100 ms).

``python -m benchmarks.state_size [--samples N] [--out FILE.md]`` (not part of ``python -m benchmarks``).
"""

from __future__ import annotations

import argparse
import json
import pickle
import tempfile
import time
from typing import Any

import numpy as np

from loader import CachedLoader

TARGET_BYTES = 64 << 10
TARGET_MS = 100.0


class Synthetic:
    """`n` samples computed on demand: sample i is eight int64 equal to i."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> np.ndarray:
        return np.full(8, i, dtype=np.int64)


class Positioned:
    """A stream of `n` samples that keeps its position (torchdata's ``Stateful``)."""

    def __init__(self, n: int) -> None:
        self.n, self.at = n, 0

    def __iter__(self) -> Any:
        while self.at < self.n:
            self.at += 1
            yield np.full(8, self.at - 1, dtype=np.int64)

    def state_dict(self) -> dict:
        return {"at": self.at}

    def load_state_dict(self, state: dict) -> None:
        self.at = state["at"]


def measure(build: Any, batches: int, repeats: int) -> dict:
    with build() as loader:
        it = iter(loader)
        for _ in range(batches):
            next(it)
        state = loader.state_dict()
    times = []
    for _ in range(repeats):
        with build() as fresh:
            start = time.perf_counter()
            fresh.load_state_dict(state)
            times.append((time.perf_counter() - start) * 1e3)
    return {"pickle_bytes": len(pickle.dumps(state)), "json_bytes": len(json.dumps(state)),
            "load_ms": min(times), "epoch": state["epoch"], "batches_served": state["batches_served"]}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--out", default=None, help="also write the table (Markdown) here")
    args = parser.parse_args(argv)
    n = args.samples
    root = tempfile.mkdtemp(prefix="state-size-")
    cases = {
        "map, no cache, shuffled": lambda: CachedLoader(Synthetic(n), batch_size=256, num_workers=0, shuffle=True,
                                                        seed=1),
        "map, cache (generate epoch)": lambda: CachedLoader(Synthetic(n), batch_size=256, num_workers=0,
                                                            shuffle=True, seed=1,
                                                            cache_setting={"prefix": f"{root}/cache"}),
        "stream with its own state": lambda: CachedLoader(Positioned(n), batch_size=256, num_workers=0, seed=1),
    }
    lines = [f"State of a loader over {n:,} samples, taken after 5 batches (best of {args.repeats} loads)", "",
             "| case | pickle bytes | JSON bytes | load_state_dict() ms | under 64 KiB and 100 ms |",
             "|---|---|---|---|---|"]
    for name, build in cases.items():
        r = measure(build, 5, args.repeats)
        ok = r["pickle_bytes"] < TARGET_BYTES and r["json_bytes"] < TARGET_BYTES and r["load_ms"] < TARGET_MS
        lines.append(f"| {name} | {r['pickle_bytes']} | {r['json_bytes']} | {r['load_ms']:.2f} | {'yes' if ok else 'NO'} |")
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
