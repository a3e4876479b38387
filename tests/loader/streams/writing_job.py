"""A job that iterates a stream into a cache (run by test_stream_jobs.py).

usage: python -m tests.loader.streams.writing_job PREFIX LOG [K]
Serves epochs 0 .. K (update_frequency K: epoch K writes the second generation); prints ``writing <e>``
after the first batch of the last epoch, then waits for a line on stdin before it goes on.
"""

from __future__ import annotations

import math
import sys

from loader import CachedLoader

from .stream_datasets import Counting


def main() -> None:
    prefix, log = sys.argv[1], sys.argv[2]
    k = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    # Its epoch K writes the second generation (not a background refresh during the epochs before).
    cache = {"prefix": prefix, "update_frequency": k or math.inf, "background_refresh": False}
    with CachedLoader(Counting(50, log), batch_size=5, num_workers=1, cache_setting=cache) as loader:
        for epoch in range(k + 1):
            for b, _batch in enumerate(loader):
                if b == 0 and epoch == k:
                    print("writing", epoch, flush=True)
                    sys.stdin.readline()
        print("committed", loader.epoch_stats[-1].committed, flush=True)


if __name__ == "__main__":
    main()
