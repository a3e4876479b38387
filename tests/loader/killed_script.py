"""A training process that the test kills while a batch is in flight.

Usage: ``python killed_script.py PREFIX MARKER_DIR [START_METHOD]``. Writes ``pids.txt``
(its own pid, then its workers') into MARKER_DIR once the first batch
arrived, then asks for the next batch, which a worker computes forever
(see :class:`tests.loader.faulty_datasets.HangingDataset`).
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", ".."))

from loader import CachedLoader  # noqa: E402
from tests.loader.faulty_datasets import HangingDataset  # noqa: E402


def main() -> None:
    prefix, marker_dir = sys.argv[1], sys.argv[2]
    method = sys.argv[3] if len(sys.argv) > 3 else None
    loader = CachedLoader(HangingDataset, {"n": 40, "hang_at": 6, "marker_dir": marker_dir}, batch_size=4,
                          nb_worker=2, shuffle=False, max_queue_size=4, start_method=method,
                          cache_setting={"prefix": prefix, "update_frequency": 2})
    it = iter(loader)
    next(it)
    tmp = os.path.join(marker_dir, "pids.tmp")
    with open(tmp, "w") as f:
        f.write("\n".join(str(pid) for pid in [os.getpid(), *loader.worker_pids()]))
    os.rename(tmp, os.path.join(marker_dir, "pids.txt"))
    for _ in it:  # the batch holding sample 6 never comes
        pass


if __name__ == "__main__":
    main()
