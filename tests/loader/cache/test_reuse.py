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


def _writer(path: str, generations: int, committed, stop) -> None:
    store = open_store(path)
    for g in range(1, generations + 1):
        with store.writer(g, num_samples=64) as w:
            for i in range(64):
                w.put(i, {"x": np.full(256, g * 1000 + i, np.int64), "g": g})
        store.prune(keep=2)
        committed.value = g
        if stop.is_set():
            break


def _reader(path: str, committed, results, stop) -> None:
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


@pytest.mark.parametrize("backend", ["memmap", pytest.param("lmdb", marks=long)])
def test_readers_in_other_processes_while_the_writer_keeps_committing(tmp_path, backend):
    path = str(tmp_path / "store")
    store = open_store(path, backend)
    with store.writer(0, num_samples=64) as w:
        for i in range(64):
            w.put(i, {"x": np.full(256, i, np.int64), "g": 0})
    ctx = mp.get_context("spawn")
    committed, stop, results = ctx.Value("i", 0), ctx.Event(), ctx.Queue()
    readers = [ctx.Process(target=_reader, args=(path, committed, results, stop)) for _ in range(2)]
    writer = ctx.Process(target=_writer, args=(path, 6, committed, stop))
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
