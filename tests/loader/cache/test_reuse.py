"""A committed store read by other loaders: torch's DataLoader, and processes beside a live writer."""

from __future__ import annotations

import multiprocessing as mp

import numpy as np
import pytest
import torch.utils.data as tud

from cachestore import open_store
from loader import CachedLoader

from ...marks import covering, long
from ..datasets import ArangeDataset
from .committing import reader_process, writer_process

pytestmark = pytest.mark.timeout(120)


@covering("context,backend", ["spawn", "fork"], ["memmap", "lmdb"])
def test_torch_dataloader_reads_what_cachedloader_served(tmp_path, backend, context):
    prefix = str(tmp_path / "cache")
    served = {}
    with CachedLoader(ArangeDataset, {"n": 37, "shape": (3, 5), "augment": True}, batch_size=8, nb_worker=2,
                      cache_setting={"prefix": prefix, "update_frequency": 4, "backend": backend}) as loader:
        for batch in loader:
            for y, x in zip(batch["y"].tolist(), batch["x"]):
                served[y] = np.array(x)
    reader = open_store(prefix).reader()
    assert len(reader) == 37
    dl = tud.DataLoader(reader, batch_size=5, shuffle=True, num_workers=2, multiprocessing_context=context)
    seen = 0
    for batch in dl:
        for y, x in zip(batch["y"].tolist(), batch["x"]):
            assert np.array_equal(x.numpy(), served[y]), f"sample {y} differs from what the loader served"
            seen += 1
    assert seen == 37


@pytest.mark.parametrize("backend", ["memmap", pytest.param("lmdb", marks=long)])
def test_readers_in_other_processes_while_the_writer_keeps_committing(tmp_path, backend):
    path = str(tmp_path / "store")
    store = open_store(path, backend)
    with store.writer(0, num_samples=64) as w:
        for i in range(64):
            w.put(i, {"x": np.full(256, i, np.int64), "g": 0})
    ctx = mp.get_context("spawn")
    committed, stop, results = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=reader_process, args=(path, committed, results, stop)) for _ in range(2)]
    writer = ctx.Process(target=writer_process, args=(path, 6, committed, stop))
    for p in readers + [writer]:
        p.start()
    try:
        outcomes = [results.get(timeout=90) for _ in readers]
    finally:
        stop.set()
        for p in readers + [writer]:
            p.join(30)
            if p.is_alive():
                p.kill()
    assert all(kind == "ok" for kind, _ in outcomes), outcomes
    assert sum(n for _, n in outcomes) > 0
    assert writer.exitcode == 0
    assert not open_store(path).verify()
