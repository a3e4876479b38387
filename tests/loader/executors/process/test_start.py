"""How workers start: fork while nothing unsafe runs, spawn otherwise, a forkserver when asked; and what
a worker that only reads cached samples loads (not the dataset, nor torch)."""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import threading

import psutil
import pytest

from loader import CachedLoader
from loader.executors.process.start import fork_is_safe

from ...datasets import ArangeDataset
from ...torch_datasets import FailsInWorkers, TorchArange

pytestmark = pytest.mark.timeout(90)


def spawned(pid: int) -> bool:
    """Whether worker `pid` is a fresh interpreter (spawn), not a fork of the training process. Asked
    once it served a batch: a spawned child has the parent's command line until it execs."""
    return "spawn_main" in " ".join(psutil.Process(pid).cmdline())


def served(loader: CachedLoader) -> list[int]:
    return sorted(y for batch in loader for y in batch["y"].tolist())


def test_the_default_forks_the_first_workers_while_nothing_unsafe_runs(no_leaks):
    assert fork_is_safe() == (True, ""), "the test process runs nothing that makes a fork unsafe"
    with CachedLoader(ArangeDataset, {"n": 40}, batch_size=4, nb_worker=2,
                      cache_setting={"prefix": str(no_leaks / "c"), "update_frequency": 2}) as loader:
        assert loader.start_method == "auto"
        assert [served(loader) for _ in range(2)] == [list(range(40))] * 2
        pids = loader.worker_pids()
        assert len(pids) == 2 and not any(spawned(pid) for pid in pids)
        assert all(psutil.Process(pid).ppid() == os.getpid() for pid in pids)
        os.kill(pids[0], signal.SIGKILL)  # a replacement is spawned: it starts from the gather loop
        assert served(loader) == list(range(40))
        assert spawned(next(pid for pid in loader.worker_pids() if pid != pids[1]))


def test_a_second_loaders_workers_fork_while_the_first_ones_slots_are_mapped(no_leaks):
    # A training loader and a validation loader, both alive: torch forks both loaders' workers.
    with CachedLoader(ArangeDataset, {"n": 40}, batch_size=4, nb_worker=2) as train, \
            CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=2) as val:
        for _ in range(2):
            assert served(train) == list(range(40))
            assert served(val) == list(range(12))
            pids = train.worker_pids() + val.worker_pids()
            assert len(pids) == 4 and not any(spawned(pid) for pid in pids)
    assert fork_is_safe() == (True, "")


def _release_in_a_fork(res, conn) -> None:
    res.release()
    conn.send(res.executor is not None)


def test_a_forked_childs_copy_of_a_loaders_resources_releases_nothing(tmp_path):
    from loader.resources import Resources

    class Executor:
        def shutdown(self) -> None:
            (tmp_path / f"shut-down-by-{os.getpid()}").touch()

    res = Resources()
    res.executor = Executor()  # type: ignore[assignment]
    ctx = mp.get_context("fork")
    parent_end, child_end = ctx.Pipe()
    child = ctx.Process(target=_release_in_a_fork, args=(res, child_end))
    child.start()
    assert parent_end.poll(60) and parent_end.recv() is True, "the child's copy kept its executor"
    child.join(60)
    assert list(tmp_path.iterdir()) == []
    res.release()
    assert [p.name for p in tmp_path.iterdir()] == [f"shut-down-by-{os.getpid()}"]


def test_the_default_spawns_while_another_thread_runs(no_leaks):
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait)
    thread.start()
    try:
        assert fork_is_safe()[0] is False
        with CachedLoader(ArangeDataset, {"n": 12}, batch_size=4, nb_worker=2) as loader:
            assert served(loader) == list(range(12))
            assert all(spawned(pid) for pid in loader.worker_pids())
    finally:
        stop.set()
        thread.join()


@pytest.mark.parametrize("how", ["start_method", "multiprocessing_context"])
def test_a_forkserver_is_honoured_and_its_dead_workers_replaced(no_leaks, how):
    given = {"start_method": "forkserver"} if how == "start_method" else {
        "multiprocessing_context": mp.get_context("forkserver")}
    with CachedLoader(ArangeDataset, {"n": 40, "delay": 0.002}, batch_size=4, nb_worker=2, seed=0, **given) as loader:
        assert loader.start_method == "forkserver"
        epoch = iter(loader)  # the workers start here
        pids = loader.worker_pids()
        servers = {psutil.Process(pid).ppid() for pid in pids}
        assert len(servers) == 1 and servers != {os.getpid()}, "the workers are the forkserver's children"
        assert "forkserver" in " ".join(psutil.Process(servers.pop()).cmdline())
        seen = []
        for step, batch in enumerate(epoch):
            if step == 2:
                os.kill(pids[0], signal.SIGKILL)
            seen += batch["y"].tolist()
        assert sorted(seen) == list(range(40))
        assert pids[0] not in loader.worker_pids()


def test_workers_that_only_read_never_build_the_dataset_nor_import_torch(no_leaks, monkeypatch):
    # The workers read the first cached epoch: threads may not gather (as for lmdb, or a custom collate).
    monkeypatch.setattr("loader.epochs.reads.threads.usable", lambda reader, producer: False)
    prefix, calls = str(no_leaks / "c"), no_leaks / "calls"
    calls.mkdir()
    params = {"n": 256, "counter_dir": str(calls)}
    with CachedLoader(TorchArange, params, batch_size=8, nb_worker=0, cache_setting={"prefix": prefix}) as loader:
        assert served(loader) == list(range(256))  # generation 0 written, here
    built = sorted(p.name for p in calls.iterdir())
    assert built == [f"built-{os.getpid()}", f"calls-{os.getpid()}.txt"]
    # Spawned workers (a fork would share this process's torch): fresh interpreters.
    with CachedLoader(TorchArange, params, batch_size=8, nb_worker=2, start_method="spawn",
                      cache_setting={"prefix": prefix}) as loader:
        assert served(loader) == list(range(256))
        assert loader.epoch_stats[0].extra["gather"] == "workers", "the first read epoch has the workers gather"
        for pid in loader.worker_pids():
            with open(f"/proc/{pid}/maps") as maps:
                assert "libtorch" not in maps.read(), f"worker {pid} imported torch"
    assert sorted(p.name for p in calls.iterdir()) == built, "no worker built the dataset or called it"


def test_a_dataset_that_only_fails_in_workers_fails_when_they_build_it(no_leaks):
    with CachedLoader(FailsInWorkers, {"n": 8, "home": os.getpid()}, batch_size=2, nb_worker=2) as loader:
        with pytest.raises(OSError, match="not mounted") as info:
            list(loader)
        assert "while building its dataset" in "\n".join(getattr(info.value, "__notes__", []))


SCRIPT = """
import torch
from loader import CachedLoader

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 20
    def __getitem__(self, i):
        return torch.tensor([float(i * i)])

train = CachedLoader(Squares(), batch_size=4, num_workers=2, shuffle=True)
val = CachedLoader(Squares(), batch_size=4, num_workers=2)
for epoch in range(2):
    print("train", sum(len(b) for b in train), "val", sum(len(b) for b in val), flush=True)
"""

THREAD = """
import threading
stop = threading.Event()
threading.Thread(target=stop.wait, daemon=True).start()  # a logger's writer thread (TensorBoard, wandb)
"""
KILL = """
import os, signal
pid = train.worker_pids()[0]
os.kill(pid, signal.SIGKILL)
print("after a kill", sum(len(b) for b in train), all(p != pid for p in train.worker_pids()), flush=True)
"""


@pytest.mark.parametrize("extra", ["", "thread"])
def test_a_script_without_a_main_guard_runs_a_training_and_a_validation_loader(tmp_path, extra):
    # On Linux torch forks every worker, so its users' scripts rarely have `if __name__ == "__main__":`;
    # a spawned worker would run this script again, and fail: such a script's workers fork, even
    # beside another thread, and so does the replacement of a dead one.
    import subprocess
    import sys

    script = tmp_path / "train.py"
    script.write_text((THREAD if extra else "") + SCRIPT + KILL)
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split("\n")[:3] == ["train 20 val 20"] * 2 + ["after a kill 20 True"]
