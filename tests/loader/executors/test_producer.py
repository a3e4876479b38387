"""The producer (a worker's, or the training process's) against shared staging areas that change under it."""

from __future__ import annotations

import numpy as np

from cachestore import open_store
from cachestore.backends.staging import mark_committing
from cachestore.claims import CLAIMS_NAME, DONE_NAME
from loader.executors import messages as m
from loader.executors.producer import BatchProducer

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
