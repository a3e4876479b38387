"""A training process killed in the middle of a stream's generate epoch (run by test_stream_faults.py).

usage: python -m tests.loader.streams.killed_stream PREFIX WORKERS
Prints ``served <k>`` after each batch (and the worker pids first), flushing, so the test kills it mid-stream.
"""

from __future__ import annotations

import sys

from loader import CachedLoader

from .stream_datasets import Counting


def main() -> None:
    prefix, workers = sys.argv[1], int(sys.argv[2])
    loader = CachedLoader(Counting(400), batch_size=4, num_workers=workers, shuffle=True,
                          cache_setting={"prefix": prefix, "stream_buffer": 16})
    it = iter(loader)
    for k, _batch in enumerate(it):
        if k == 0:
            print("workers", " ".join(map(str, (p.pid for p in it._workers))), flush=True)  # type: ignore[attr-defined]
        print("served", k, flush=True)
        if k >= 5:
            sys.stdin.readline()  # wait here for the kill


if __name__ == "__main__":
    main()
