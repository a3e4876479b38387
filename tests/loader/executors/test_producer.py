"""The producer (a worker's, or the training process's) against shared staging areas that change under it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from cachestore import BudgetExceededError, open_store
from cachestore.backends import memmap_staging
from cachestore.backends.staging import mark_committing, members_path
from cachestore.guard.claims import CLAIMS_NAME, DONE_NAME
from cachestore.space.disk import remove_paths
from loader.executors import messages as m
from loader.executors.producer import BatchProducer

from ...fullfs import fill, free, mounted_tmpfs
from ..datasets import ArangeDataset


def generate_task(spec, indices: list[int]) -> m.Task:
    return m.Task(seq=0, part=0, epoch=0, indices=np.array(indices), write=m.WritePart(spec),
                  positions=np.array(indices))


def test_a_batch_is_served_from_an_area_whose_committer_died_half_way(tmp_path):
    # A member killed inside its commit once the claim files were gone leaves the area marked: another
    # process's next task computes its batch (and writes nothing there) instead of failing.
    store = open_store(tmp_path / "s", "memmap", fingerprint={"data": 1})
    writer = store.join(0, 8)
    spec = writer.shard_spec()
    area = writer.path
    mark_committing(area)
    for name in (CLAIMS_NAME, DONE_NAME):
        (area / name).unlink()
    producer = BatchProducer(ArangeDataset(8), None, "w0", allow_pickle=False)
    try:
        out = producer.compute(generate_task(spec, [4, 5, 6]))
        assert out.batch["y"].tolist() == [4, 5, 6] and out.written == 0
    finally:
        producer.close_shard()
        writer.abort()
        store.close()


def test_a_batch_is_read_from_the_generation_another_process_committed(tmp_path):
    # The area was committed (renamed) by another member before this task opened it: read, not computed.
    store = open_store(tmp_path / "s", "memmap", fingerprint={"data": 1})
    first = store.join(0, 8)
    spec = first.shard_spec()
    try:
        for i in range(8):
            first.put(i, {"x": np.full(2, 100.0 + i), "y": i})
        first.commit()
        producer = BatchProducer(ArangeDataset(8, shape=(2,)), None, "w0", allow_pickle=False)
        out = producer.produce(generate_task(spec, [1, 2]))
        assert out.batch["x"][:, 0].tolist() == [101.0, 102.0]  # the stored values, not the dataset's
        producer.close_shard()
    finally:
        store.close()


def _remove_area(area: Path) -> None:
    """What a member's commit that failed half way (a full disk) leaves: no area, no members file."""
    remove_paths([str(area)])
    members_path(area).unlink()


def test_samples_of_an_area_removed_under_a_member_are_computed(tmp_path):
    # Another member's commit failed on a full disk and removed the area: samples this producer found
    # done there are computed, not read from a generation that was never committed.
    store = open_store(tmp_path / "s", "memmap", fingerprint={"data": 1})
    writer = store.join(0, 8)
    for i in range(4):
        writer.put(i, {"x": np.full(4, 100.0 + i, dtype=np.float32), "y": i})
    producer = BatchProducer(ArangeDataset(8), None, "w0", allow_pickle=False)
    try:
        out = producer.compute(generate_task(writer.shard_spec(), [0]))
        assert out.batch["x"][:, 0].tolist() == [100.0] and out.staged == 1  # read back from the area
        _remove_area(writer.path)
        out = producer.compute(generate_task(writer.shard_spec(), [1, 2, 5]))
        assert out.batch["y"].tolist() == [1, 2, 5] and out.batch["x"][:, 0].tolist() == [1.0, 2.0, 5.0]
        assert out.written == 0
    finally:
        producer.close_shard()
        writer.abort()
        store.close()


def test_a_record_file_that_vanishes_while_it_is_read_back_is_computed(tmp_path, monkeypatch):
    # The area is being removed (a failed commit) while this producer reads a sample back: an index file
    # listed a moment ago is gone when it is read.
    store = open_store(tmp_path / "s", "memmap", fingerprint={"data": 1})
    writer = store.join(0, 8)
    for i in range(4):
        writer.put(i, {"x": np.full(4, 100.0 + i, dtype=np.float32), "y": i})

    def vanished(path):
        raise FileNotFoundError(2, "No such file or directory", str(path))

    monkeypatch.setattr(memmap_staging, "read_rows", vanished)
    producer = BatchProducer(ArangeDataset(8), None, "w0", allow_pickle=False)
    try:
        out = producer.compute(generate_task(writer.shard_spec(), [1, 2]))
        assert out.batch["y"].tolist() == [1, 2] and out.staged == 0
    finally:
        producer.close_shard()
        writer.abort()
        store.close()


def test_a_shard_that_met_a_full_disk_is_opened_again_for_the_next_task(tmp_path):
    # Policy "error": the task raises; the same generation's next task (another epoch, with room again)
    # writes through a new shard instead of the one the full disk closed.
    with mounted_tmpfs(tmp_path / "fs", "4m") as mount:
        store = open_store(mount / "s", "memmap", fingerprint={"data": 1})
        writer = store.join(0, 64)
        spec = writer.shard_spec()
        producer = BatchProducer(ArangeDataset(64, shape=(4096,)), None, "w0", allow_pickle=False)
        try:
            fill(mount)
            with pytest.raises(BudgetExceededError):
                producer.compute(generate_task(spec, [0, 1, 2]))
            free(mount)
            out = producer.compute(generate_task(spec, [0, 1, 2]))
            assert out.written == 3 and out.batch["y"].tolist() == [0, 1, 2]
        finally:
            producer.close_shard()
            writer.abort()
            store.close()
