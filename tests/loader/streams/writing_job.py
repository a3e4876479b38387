"""A job that iterates a stream into a cache (run by test_stream_jobs.py).

usage: python -m tests.loader.streams.writing_job PREFIX LOG
Prints ``writing`` after its first batch, then waits for a line on stdin before it goes on.
"""

from __future__ import annotations

import sys

from loader import CachedLoader

from .stream_datasets import Counting


def main() -> None:
    prefix, log = sys.argv[1], sys.argv[2]
    with CachedLoader(Counting(50, log), batch_size=5, num_workers=1, cache_setting={"prefix": prefix}) as loader:
        for k, _batch in enumerate(loader):
            if k == 0:
                print("writing", flush=True)
                sys.stdin.readline()
        print("committed", loader.epoch_stats[0].committed, flush=True)


if __name__ == "__main__":
    main()
