"""torch's get_worker_info() in the workers, and worker_init_fn against the dataset copy tasks run on."""

from __future__ import annotations

import pytest
import torch

from loader import CachedLoader

from ..marks import long
from .torch_datasets import WorkerInfoDataset, refuse_to_start, set_handle_from_worker_info

pytestmark = pytest.mark.timeout(120)


def served(loader) -> list[dict]:
    return [{k: int(v[i]) for k, v in batch.items()} for batch in loader for i in range(len(batch["id"]))]


# Spawned workers: test_worker_info_with_a_cache_in_generate_epochs in make test, all three in make check.
@pytest.mark.parametrize("workers", [
    pytest.param({"start_method": "spawn"}, marks=long), {"start_method": "fork"}, {"start_method": "auto"},
    {"use_threading": True},
], ids=["spawn", "fork", "auto", "threads"])
def test_worker_info_and_worker_init_fn_see_the_copy_tasks_run_on(workers, tmp_path):
    ds = WorkerInfoDataset(8)
    with CachedLoader(ds, batch_size=2, nb_worker=2, shuffle=False, worker_init_fn=set_handle_from_worker_info,
                      **workers) as loader:
        rows = served(loader)
    assert torch.utils.data.get_worker_info() is None, "the training process is no worker"
    assert {r["id"] for r in rows} <= {0, 1} and all(r["num_workers"] == 2 for r in rows)
    assert all(r["same"] for r in rows), "get_worker_info().dataset is the copy __getitem__ runs on"
    if "use_threading" in workers:  # threads share the training process's dataset: the last init's handle
        assert all(r["handle"] in (100, 101) for r in rows), rows
    else:
        assert all(r["handle"] == 100 + r["id"] for r in rows), rows
        assert all(r["seed_ok"] for r in rows), "WorkerInfo.seed is the seed of the worker's torch generator"
        assert not hasattr(ds, "handle"), "the training process's dataset is not the workers' copy"


@pytest.mark.parametrize("start_method", [pytest.param("spawn", marks=long), "auto"])
def test_a_bound_method_worker_init_fn_changes_the_copy_in_use(start_method):
    ds = WorkerInfoDataset(6)
    with CachedLoader(ds, batch_size=3, nb_worker=2, shuffle=False, worker_init_fn=ds.open_files,
                      start_method=start_method) as loader:
        rows = served(loader)
    assert all(r["opened_by"] == r["id"] for r in rows), rows
    assert not hasattr(ds, "opened_by")


def test_worker_info_is_none_without_workers():
    with CachedLoader(WorkerInfoDataset(4), batch_size=2, nb_worker=0, shuffle=False) as loader:
        assert all(r["id"] == -1 for r in served(loader))


def test_worker_info_with_a_cache_in_generate_epochs(tmp_path):
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2}
    with CachedLoader(WorkerInfoDataset(8), batch_size=2, nb_worker=2, shuffle=False, cache_setting=cache,
                      worker_init_fn=set_handle_from_worker_info, start_method="spawn") as loader:
        rows = served(loader)
    assert all(r["handle"] == 100 + r["id"] and r["id"] in (0, 1) for r in rows), rows


def test_the_iterator_names_its_workers_as_torchs_does():
    # torch's test of get_worker_info matches each sample's pid with `iter(loader)._workers`.
    with CachedLoader(WorkerInfoDataset(4), batch_size=2, nb_worker=2, shuffle=False, start_method="fork") as loader:
        it = iter(loader)
        next(it)
        assert sorted(w.pid for w in it._workers) == sorted(loader.worker_pids())


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stream", [False, True], ids=["map", "stream"])
def test_the_iterators_workers_are_processes_that_end_when_the_loader_goes(stream):
    # torch's test_iterable_style_dataset joins `iter(loader)._workers` once the loader is deleted, and
    # checks each ended with exit code 0: they are multiprocessing's processes, as torch's are.
    from .streams.stream_datasets import Counting

    dataset = Counting(8) if stream else WorkerInfoDataset(4)
    loader = CachedLoader(dataset, batch_size=2, nb_worker=2, start_method="fork")
    it = iter(loader)
    next(it)
    workers = it._workers
    assert len(workers) == 2 and sorted(w.pid for w in workers) == sorted(loader.worker_pids())
    del it, loader
    for w in workers:
        w.join(60)
        assert not w.is_alive() and w.exitcode == 0


@pytest.mark.parametrize("workers", [{"start_method": "fork"}, {"use_threading": True}], ids=["fork", "threads"])
def test_a_raising_worker_init_fn_raises_at_iter_and_leaves_no_worker(workers):
    import psutil

    before = {p.pid for p in psutil.Process().children(recursive=True)}
    loader = CachedLoader(WorkerInfoDataset(8), batch_size=2, nb_worker=2, worker_init_fn=refuse_to_start, **workers)
    with loader, pytest.raises(ValueError, match="this worker refuses to start") as caught:
        iter(loader)  # as torchdata's StatefulDataLoader: at iter(), not at the first batch
    assert caught.value.worker_id in (0, 1)
    assert {p.pid for p in psutil.Process().children(recursive=True)} - before == set()
