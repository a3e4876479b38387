"""Workers that computed a generation hold their own copies of the dataset's pages; once the run
will not compute again they are retired, and fresh forks read the cached epochs where workers read
(docs/ARCHITECTURE.md, "Memory with many workers")."""

from __future__ import annotations

import itertools
import math

import psutil
import pytest

from loader import CachedLoader

from ...datasets import ObjectIndex

pytestmark = pytest.mark.timeout(120)

#: 20,000 paths of 8 KB: about 160 MB of objects in the training process, far more than a worker's own
#: private memory (10-20 MB, more in a test process that ran others).
N, WIDTH = 20_000, 8000


def private_bytes(pids: list[int]) -> int:
    """The summed USS of processes `pids`: pages none of the others (the training process) shares."""
    return sum(psutil.Process(pid).memory_full_info().uss for pid in pids)


def labels(loader: CachedLoader) -> list[int]:
    return sorted(y for batch in loader for y in batch["x"][:, 1].tolist())


def test_cached_epochs_read_with_workers_that_hold_no_copy_of_the_dataset(no_leaks, monkeypatch):
    # The workers read the first cached epoch: threads may not gather (as for lmdb, or a custom collate).
    monkeypatch.setattr("loader.epochs.reads.threads.usable", lambda reader, producer: False)
    dataset = ObjectIndex(N, WIDTH)
    with CachedLoader(dataset, batch_size=64, nb_worker=2, start_method="fork",
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": math.inf,
                                     "fingerprint": "object-index"}) as loader:
        it = iter(loader)
        served = [y for batch in itertools.islice(it, len(loader) - 1) for y in batch["x"][:, 1].tolist()]
        computing = loader.worker_pids()
        assert private_bytes(computing) > N * WIDTH * 2 // 5  # together, a copy of what they read
        served += [y for batch in it for y in batch["x"][:, 1].tolist()]
        assert sorted(served) == list(range(N)) and loader.epoch_stats[0].mode == "generate"
        assert loader.worker_pids() == []  # retired as the epoch ended
        assert not any(psutil.pid_exists(pid) and psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
                       for pid in computing)
        assert labels(loader) == list(range(N))  # a cached epoch: the training process probes, forks read
        assert loader.epoch_stats[1].mode == "read" and loader.epoch_stats[1].extra["gather"] == "workers"
        readers = loader.worker_pids()
        assert len(readers) == 2 and not set(readers) & set(computing)
        assert private_bytes(readers) < N * WIDTH // 4


def test_workers_stay_where_later_epochs_compute_again(no_leaks):
    with CachedLoader(ObjectIndex(200, 10), batch_size=16, nb_worker=2, start_method="fork",
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": 2}) as loader:
        assert labels(loader) == list(range(200))
        computing = loader.worker_pids()
        assert labels(loader) == list(range(200))
        assert loader.epoch_stats[1].mode == "read" and loader.worker_pids() == computing
