"""Where cached epochs gather: measured in the first read epochs of a store, generation and
batch size (four where threads may gather and beat the training process, two where they do not,
two where threads may not gather), then kept.

Which side wins depends on the machine, so these tests force it (a place made slower by a fixed
cost per batch, or the recorded choice) and check that every side serves the same batches.
"""

from __future__ import annotations

import time

import numpy as np
import pytest

from loader import CachedLoader
from loader.epochs.reads.main import MainReads
from loader.epochs.reads.placement import PROBE_BATCHES
from loader.epochs.reads.threads import ThreadReads

from ..datasets import ArangeDataset

pytestmark = pytest.mark.timeout(120)

N, BATCH = 96, 4  # 24 batches: enough to probe (2 * PROBE_BATCHES + 2)


def epoch_labels(loader) -> list[int]:
    labels = []
    for batch in loader:
        assert np.array_equal(np.asarray(batch["x"])[:, 0, 0], np.asarray(batch["y"], dtype=np.float32))
        labels += np.asarray(batch["y"]).tolist()
    return labels


def slowed(monkeypatch, path: type) -> None:
    """Make read path `path` cost 3 ms more per batch (a cost, not a synchronisation)."""
    original = path.batches

    def batches(self, plan, stats):
        for batch in original(self, plan, stats):
            time.sleep(0.003)
            yield batch
    monkeypatch.setattr(path, "batches", batches)


@pytest.mark.parametrize("shape", [(2, 2), (64, 64)])  # a small batch and one gathered into a slot
def test_the_first_read_epoch_probes_and_later_ones_keep_the_choice(tmp_path, shape, monkeypatch):
    slowed(monkeypatch, MainReads)  # the threads beat the training process: the workers are timed too
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}
    with CachedLoader(ArangeDataset, {"n": N, "shape": shape}, batch_size=BATCH, nb_worker=2, shuffle=True,
                      cache_setting=setting) as loader:
        epoch_labels(loader)  # generate
        allocated = []
        # The training process's gather timed (the threads serve the rest), the threads' timed, then the
        # workers' and the threads', twice.
        for _ in range(4):
            probe = epoch_labels(loader)
            stats = loader.epoch_stats[-1]
            assert sorted(probe) == list(range(N)) and stats.read == N and stats.batches == N // BATCH
            allocated.append(loader._runner.ctx.res.threads.buffers.allocated)
        assert [s.extra["gather"] for s in loader.epoch_stats[-4:-1]] == ["threads", "threads", "workers"]
        assert "gather_costs" not in loader.epoch_stats[-4].extra
        assert set(loader.epoch_stats[-3].extra["gather_costs"]) == {"main", "threads"}
        assert [s.extra.get("gather_split") for s in loader.epoch_stats[-4:]] == [
            None, None, ["workers", "threads"], ["threads", "workers"]]
        # The threads' buffers outlive the probe epochs: the later ones reuse the first's.
        assert 0 < allocated[0] and allocated[3] - allocated[0] <= allocated[0] // 2
        assert not any("gather_probed" in s.extra for s in loader.epoch_stats[-4:-1])
        # The second epoch was shared by the workers and the threads, half each, both timed.
        assert set(loader.epoch_stats[-2].extra["gather_costs"]) == {"main", "workers", "threads"}
        first = loader.epoch_stats[-1]
        assert first.extra["gather_probed"] and first.extra["gather"] in ("main", "threads", "workers")
        costs = first.extra["gather_costs"]
        assert set(costs) == {"main", "workers", "threads"} and min(costs.values()) > 0
        assert first.extra["gather"] == min(costs, key=costs.get)
        choice = first.extra["gather"]
        for place in ("main", "workers", "threads", choice):
            # The recorded choice is what later epochs follow: force each side in turn.
            key = next(iter(loader._runner.ctx.reads.placement.choices))
            loader._runner.ctx.reads.placement.choices[key] = (place, costs)
            labels = epoch_labels(loader)
            stats = loader.epoch_stats[-1]
            assert sorted(labels) == list(range(N)) and stats.read == N
            assert stats.extra["gather"] == place and "gather_probed" not in stats.extra


def test_a_gather_cheaper_here_than_the_threads_hand_off_starts_no_worker_to_read(tmp_path, monkeypatch):
    """The training process gathers faster than its threads hand batches over: it reads from the second
    read epoch on, and the workers that computed the generation, retired, are not replaced."""
    slowed(monkeypatch, ThreadReads)
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}
    with CachedLoader(ArangeDataset, {"n": N, "shape": (2, 2)}, batch_size=BATCH, nb_worker=2, shuffle=True,
                      start_method="fork", cache_setting=setting) as loader:
        assert sorted(epoch_labels(loader)) == list(range(N))  # generate
        assert loader.worker_pids() == []  # retired: the run writes no other generation
        for _ in range(2):  # the training process's gather timed, then the threads'
            assert sorted(epoch_labels(loader)) == list(range(N))
        probed = loader.epoch_stats[-1]
        assert probed.extra["gather"] == "main" and probed.extra["gather_probed"]
        costs = probed.extra["gather_costs"]
        assert set(costs) == {"main", "threads"} and costs["main"] <= costs["threads"]
        for _ in range(2):
            assert sorted(epoch_labels(loader)) == list(range(N))
            assert loader.epoch_stats[-1].extra["gather"] == "main"
        assert loader.worker_pids() == []


def test_a_short_epoch_is_read_without_a_verdict(tmp_path):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}
    n = BATCH * (2 * PROBE_BATCHES + 1)
    with CachedLoader(ArangeDataset, {"n": n, "shape": (2, 2)}, batch_size=BATCH, nb_worker=2, cache_setting=setting) as loader:
        for _ in range(3):
            assert sorted(epoch_labels(loader)) == list(range(n))
        stats = loader.epoch_stats[-1]
        # The threads read it (the workers where threads may not): no process is started for it.
        assert stats.extra["gather"] == "threads" and "gather_costs" not in stats.extra


def test_without_workers_the_training_process_gathers(tmp_path):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf")}
    with CachedLoader(ArangeDataset, {"n": 16, "shape": (64, 64)}, batch_size=4, nb_worker=0,
                      cache_setting=setting) as loader:
        for _ in range(3):
            assert sorted(epoch_labels(loader)) == list(range(16))
        assert loader.epoch_stats[-1].extra["gather"] == "main"


def test_where_threads_may_not_gather_two_epochs_decide(tmp_path):
    """lmdb's batch reads share its environment: the threads are not probed."""
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf"), "backend": "lmdb"}
    with CachedLoader(ArangeDataset, {"n": N, "shape": (64, 64)}, batch_size=BATCH, nb_worker=2,
                      cache_setting=setting) as loader:
        for _ in range(3):
            assert sorted(epoch_labels(loader)) == list(range(N))
        decided = loader.epoch_stats[-1]
        assert decided.extra["gather_probed"] and set(decided.extra["gather_costs"]) == {"main", "workers"}
        assert sorted(epoch_labels(loader)) == list(range(N))
        assert loader.epoch_stats[-1].extra["gather"] == decided.extra["gather"]


def test_an_in_ram_store_probes_the_training_process_and_its_threads(tmp_path):
    setting = {"prefix": str(tmp_path / "c"), "update_frequency": float("inf"), "backend": "memory"}
    with CachedLoader(ArangeDataset, {"n": N, "shape": (64, 64)}, batch_size=BATCH, nb_worker=2,
                      cache_setting=setting) as loader:
        for _ in range(3):  # generate, then the training process timed (its threads serve the rest), the threads
            assert sorted(epoch_labels(loader)) == list(range(N))
        probe, decided = loader.epoch_stats[-2:]
        assert probe.extra["gather"] == "threads" and "gather_probed" not in probe.extra
        assert decided.extra["gather_probed"] and set(decided.extra["gather_costs"]) == {"main", "threads"}
        assert decided.extra["gather"] == min(decided.extra["gather_costs"], key=decided.extra["gather_costs"].get)
        for place in ("main", "threads"):
            key = next(iter(loader._runner.ctx.reads.placement.choices))
            loader._runner.ctx.reads.placement.choices[key] = (place, {})
            assert sorted(epoch_labels(loader)) == list(range(N))
            assert loader.epoch_stats[-1].extra["gather"] == place and loader.epoch_stats[-1].read == N
