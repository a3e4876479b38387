"""A writer that keeps committing generations and readers beside it, run in spawned processes.

A module of its own that imports only the store, not torch, so that each spawned process starts in a
fraction of a second (test_reuse.py imports torch, which a spawned child would import again).
"""

from __future__ import annotations

import numpy as np

from cachestore import open_store


def writer_process(path: str, generations: int, committed, stop) -> None:
    store = open_store(path)
    for g in range(1, generations + 1):
        with store.writer(g, num_samples=64) as w:
            for i in range(64):
                w.put(i, {"x": np.full(256, g * 1000 + i, np.int64), "g": g})
        store.prune(keep=2)
        committed.value = g
        if stop.is_set():
            break


def reader_process(path: str, committed, results, stop) -> None:
    store = open_store(path, readonly=True)
    checked = 0
    try:
        while (checked < 3 or committed.value < 6) and not stop.is_set():
            reader = store.reader()  # newest committed generation
            g = reader.generation
            for i in range(len(reader)):
                sample = reader[i]
                assert sample["g"] == g and (sample["x"] == g * 1000 + i).all()
            batch = reader.get_batch(np.arange(64)[::-1])
            assert (batch["x"][:, 0] == g * 1000 + np.arange(64)[::-1]).all()
            checked += 1
            reader.close()
        results.put(("ok", checked))
    except Exception as exc:  # reported to the test, which fails with it
        results.put(("error", repr(exc)))
