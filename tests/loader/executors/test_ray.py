"""executor="ray": samples computed by Ray actors on another node of a real two-node Ray cluster.

One cluster per module (a head node and a "producer" node with a custom resource, both on
127.0.0.1): Ray takes seconds to start. Each loader connects to it by address and disconnects when
it closes, so every test starts from a process without a Ray connection.
"""

from __future__ import annotations

import collections
import os
import subprocess
import sys
import textwrap
import time
import traceback
from types import SimpleNamespace

import numpy as np
import psutil
import pytest

from loader.errors import WorkerError
from loader.errors import WorkerTimeoutError
from loader import CachedLoader

from ...marks import long
from ..conftest import leftovers, my_segments
from ..datasets import ArangeDataset, HangDataset, KillSelfDataset
from ..ray_datasets import NodeRecordingDataset, read_nodes

# One pytest process runs them all under pytest-xdist (make test): the module's cluster starts once.
pytestmark = [pytest.mark.timeout(300), pytest.mark.xdist_group("ray")]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
#: Ray stays on this machine: no usage reports, and "127.0.0.1" is not rewritten to the machine's
#: network address (Ray does that unless clusters are disabled). Ray reads these when it is
#: imported, so they are set here, before any test imports it; they concern Ray only.
RAY_ENV = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_USAGE_STATS_ENABLED": "0"}
assert "ray" not in sys.modules, "ray was imported before its settings were set"
os.environ.update(RAY_ENV)
#: Small nodes: the machine is shared.
NODE = {"node_ip_address": "127.0.0.1", "object_store_memory": 100 << 20, "include_dashboard": False}
PRODUCER = {"producer": 2}


@pytest.fixture(scope="module")
def cluster():
    """A head node without the producer resource and a node that has it, stopped afterwards."""
    pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        # Actors import the test datasets by module path; Ray's worker processes inherit this.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        # On a loaded machine a worker process may take longer than Ray's default to register, and the
        # raylet then kills it and starts another, which can keep an actor from starting within start_timeout.
        mp.setenv("RAY_worker_register_timeout_seconds", "600")
        head = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 1})
        try:
            producer = head.add_node(**{k: v for k, v in NODE.items() if k != "include_dashboard"}, num_cpus=2,
                                     resources=PRODUCER)
            yield SimpleNamespace(address=head.address, head_node=head.head_node.node_id,
                                  producer_node=producer.node_id)
        finally:
            head.shutdown()


def ray_options(cluster, **extra) -> dict:
    options = {"address": cluster.address, "num_workers": 2,
               # Generous: on a loaded machine the actors of the test before may take a while to go.
               "actor_options": {"num_cpus": 1, "resources": {"producer": 1}}, "start_timeout": 180}
    options.update(extra)
    return options


def assert_released(root) -> None:
    import ray

    assert not ray.is_initialized(), "the loader opened the connection: it must close it"
    assert not my_segments(), f"shared memory left behind: {my_segments()}"
    assert not leftovers(str(root)), f"files left behind: {leftovers(str(root))}"


def wait_gone(pids: set[int]) -> None:
    """The actor processes (on this machine, in this test) exit once the loader has closed."""
    procs = []
    for pid in pids:
        try:
            procs.append(psutil.Process(pid))
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=30)
    assert not alive, f"Ray actors left running: {alive}"


def test_every_sample_is_computed_on_the_producer_node_and_cached(cluster, tmp_path):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    params = {"node_dir": str(nodes), "n": 40}
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": False}
    with CachedLoader(NodeRecordingDataset, params, batch_size=4, seed=0, cache_setting=cache, executor="ray",
                      executor_options=ray_options(cluster)) as loader:
        assert loader.nb_worker == 2 and loader.executor == "ray"
        epochs = [[int(y) for batch in loader for y in batch["y"]] for _ in range(3)]
        modes = [s.mode for s in loader.epoch_stats]
        actor_pids = {w.pid for w in loader._res.executor.workers}
        # Batches are the right samples: x is filled with the index.
        for batch in loader:
            assert np.array_equal(batch["x"][:, 0], batch["y"].astype(np.float32))
            assert batch["x"].flags.writeable
    assert modes == ["generate", "read", "generate"]
    assert all(sorted(e) == list(range(40)) for e in epochs), "each sample exactly once per epoch"
    calls = read_nodes(str(nodes))
    # Generations 0 and 1 computed (epochs 0 and 2); the read epochs called nothing.
    assert sorted(i for i, _, _ in calls) == sorted(list(range(40)) * 2)
    assert {node for _, node, _ in calls} == {cluster.producer_node}, "a sample was computed off the producer node"
    assert {pid for _, _, pid in calls} <= actor_pids and os.getpid() not in actor_pids
    assert_released(tmp_path)
    wait_gone(actor_pids)

    # Another run reuses the newest generation: nothing is computed.
    with CachedLoader(NodeRecordingDataset, params, batch_size=4, seed=0, cache_setting=cache, executor="ray",
                      executor_options=ray_options(cluster)) as loader:
        assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(40))
        assert loader.epoch_stats[0].mode == "read" and loader.epoch_stats[0].generation == 1
    assert len(read_nodes(str(nodes))) == 80
    assert_released(tmp_path)


@long
def test_rotation_and_background_refresh_compute_on_actors(cluster, tmp_path):
    nodes = tmp_path / "nodes"
    nodes.mkdir()
    params = {"node_dir": str(nodes), "n": 24}
    rotation = {"medium": "memory", "rotation": 2, "size": 8}
    with CachedLoader(NodeRecordingDataset, params, batch_size=4, seed=0, rotation_setting=rotation,
                      executor="ray", executor_options=ray_options(cluster)) as loader:
        served = [int(y) for batch in loader for y in batch["y"]]
    assert sorted(served) == sorted(list(range(24)) * 2), "each sample served R=2 times"
    assert sorted(i for i, _, _ in read_nodes(str(nodes))) == list(range(24)), "each sample computed once"

    for name in os.listdir(nodes):
        os.unlink(nodes / name)
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": True}
    with CachedLoader(NodeRecordingDataset, params, batch_size=4, seed=0, cache_setting=cache, executor="ray",
                      executor_options=ray_options(cluster)) as loader:
        for _ in range(3):
            assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(24))
        stats = loader.epoch_stats
        generations = [g.id for g in loader.store.generations() if g.committed]
    # Epoch 1 read generation 0 here while the actors computed generation 1, which epoch 2 reads.
    assert [s.mode for s in stats] == ["generate", "read", "read"]
    assert [s.generation for s in stats] == [0, 0, 1] and generations == [1]
    # Generations 0 and 1 computed, and perhaps part of 2 (epoch 2 starts refreshing it).
    counts = collections.Counter(i for i, _, _ in read_nodes(str(nodes)))
    assert sorted(counts) == list(range(24)) and set(counts.values()) <= {2, 3}
    assert {node for _, node, _ in read_nodes(str(nodes))} == {cluster.producer_node}
    assert_released(tmp_path)


def test_killed_actor_is_replaced_and_its_batches_rerun(cluster, tmp_path):
    import ray

    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 3}
    with CachedLoader(ArangeDataset, {"n": 48, "delay": 0.02}, batch_size=4, seed=0, max_queue_size=4,
                      cache_setting=cache, executor="ray", executor_options=ray_options(cluster)) as loader:
        seen, values = [], {}
        for step, batch in enumerate(loader):
            if step == 2:
                executor = loader._res.executor  # started at the first iter()
                killed = executor.workers[0]
                ray.kill(killed.actor, no_restart=True)
            for y, x in zip(batch["y"].tolist(), batch["x"]):
                seen.append(y)
                values[y] = np.array(x)
        assert executor.restarts == 1, "the death was seen during the epoch"
        assert executor.workers[0] is not killed and executor.workers[0].shard_id != killed.shard_id
        assert sorted(seen) == list(range(48)), "every index exactly once despite the death"
        assert loader.epoch_stats[0].committed and loader.epoch_stats[0].written == 48
        for batch in loader:
            for y, x in zip(batch["y"].tolist(), batch["x"]):
                assert np.array_equal(x, values[y])
        assert loader.epoch_stats[1].mode == "read"
        assert not loader.store.verify()
    assert_released(tmp_path)


def test_broken_off_epochs_give_every_slot_back(cluster, tmp_path):
    cache = {"prefix": str(tmp_path / "c")}
    with CachedLoader(ArangeDataset, {"n": 40, "delay": 0.005}, batch_size=4, seed=0, max_queue_size=4,
                      cache_setting=cache, executor="ray", executor_options=ray_options(cluster)) as loader:
        for _ in loader:
            break  # a generate epoch broken off: nothing committed, its late results dropped
        assert not [g for g in loader.store.generations() if g.committed]
        assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(40))
        assert loader.epoch_stats[1].committed
        for _ in loader:
            break  # a read epoch broken off with reads still queued here
        assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(40))
        assert [s.mode for s in loader.epoch_stats] == ["generate", "generate", "read", "read"]
        slots = loader._res.slots
        assert len(slots._free) == len(slots._names), "a slot stayed lent to a task of an abandoned epoch"
    assert_released(tmp_path)


@long
def test_repeated_actor_deaths_end_in_clear_error(cluster, tmp_path):
    options = ray_options(cluster, num_workers=1)
    with CachedLoader(KillSelfDataset, {"kill_at": 5, "n": 12}, batch_size=4, max_worker_restarts=1,
                      executor="ray", executor_options=options) as loader:
        with pytest.raises(WorkerError, match="2 actor deaths, more than max_worker_restarts=1"):
            list(loader)
    assert_released(tmp_path)


@long
def test_dataset_exception_keeps_its_type_index_and_traceback(cluster, tmp_path):
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2}
    loader = CachedLoader(ArangeDataset, {"n": 40, "fail_at": 17}, batch_size=4, cache_setting=cache,
                          executor="ray", executor_options=ray_options(cluster))
    try:
        with pytest.raises(KeyError) as info:
            list(loader)
        # The dataset's own message; where it happened and the worker's traceback are notes.
        text = "".join(traceback.format_exception(info.value))
        assert info.value.sample_index == 17 and "sample 17 is broken" in str(info.value)
        assert "__getitem__" in text and "sample 17" in text
        # New actors for the next epoch: the same error again, not a hang or a dead executor.
        with pytest.raises(KeyError, match="sample 17"):
            list(loader)
        assert not [g for g in loader.store.generations() if g.committed]
    finally:
        loader.close()
    assert_released(tmp_path)


@long
def test_timeout_names_the_stuck_actor_and_its_indices(cluster, tmp_path):
    # Long enough for the actors to start on a loaded machine: the clock counts start-up too.
    loader = CachedLoader(HangDataset, {"n": 32, "hang_at": 9}, batch_size=4, shuffle=False, timeout=10,
                          executor="ray", executor_options=ray_options(cluster))
    try:
        with pytest.raises(WorkerTimeoutError) as info:
            list(loader)
        assert 9 in info.value.indices and "ray stack" in str(info.value)
    finally:
        loader.close()
    assert_released(tmp_path)


@long
def test_state_dict_resumes_mid_epoch_with_ray(cluster, tmp_path):
    def build():
        return CachedLoader(ArangeDataset, {"n": 30}, batch_size=4, seed=3, executor="ray",
                            executor_options=ray_options(cluster),
                            cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2})

    def ys(it, count=None):
        out = []
        for batch in it:
            out.append(batch["y"].tolist())
            if count is not None and len(out) == count:
                break
        return out

    with build() as golden:
        expected = ys(golden) + ys(golden)
    for path in (tmp_path / "c").iterdir():  # a fresh cache for the interrupted run
        if path.is_dir():
            import shutil

            shutil.rmtree(path)
    (tmp_path / "c" / "store.json").unlink()
    with build() as first:
        served = ys(iter(first), count=3)
        state = first.state_dict()
    with build() as second:
        second.load_state_dict(state)
        served += ys(second) + ys(second)
    assert served == expected
    assert_released(tmp_path)


@long
def test_cached_epoch_is_read_locally_with_the_cluster_gone(tmp_path):
    """A cluster of its own: this test stops it between two epochs."""
    ray = pytest.importorskip("ray")
    from ray.cluster_utils import Cluster

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p))
        own = Cluster(initialize_head=True, head_node_args={**NODE, "num_cpus": 2, "resources": PRODUCER})
        try:
            cache = {"prefix": str(tmp_path / "c")}
            loader = CachedLoader(ArangeDataset, {"n": 24}, batch_size=4, seed=0, cache_setting=cache,
                                  executor="ray", executor_options=ray_options(own))
            with loader:
                first = {int(y): np.array(x) for batch in loader for y, x in zip(batch["y"], batch["x"])}
                assert loader.epoch_stats[0].committed
                ray.shutdown()  # the driver leaves first: Ray forbids removing the node it is connected to
                own.shutdown()
                second = {int(y): np.array(x) for batch in loader for y, x in zip(batch["y"], batch["x"])}
                assert loader.epoch_stats[1].mode == "read" and loader.epoch_stats[1].computed == 0
        finally:
            own.shutdown()
    assert sorted(second) == list(range(24))
    assert all(np.array_equal(second[i], first[i]) for i in first)
    assert_released(tmp_path)


def test_existing_connection_is_left_open_and_actors_terminated(cluster, tmp_path):
    import ray

    ray.init(address=cluster.address)
    try:
        options = ray_options(cluster)
        del options["address"]  # the process's connection is used
        with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, executor="ray", executor_options=options) as loader:
            assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(8))
            actors = loader._res.executor.actors
        assert ray.is_initialized()
        # ray.kill is asynchronous: a call that raced it may still be answered (seen once under
        # load), but within the deadline every actor must be gone.
        deadline = time.monotonic() + 30
        for actor in actors:
            with pytest.raises(ray.exceptions.RayActorError):
                while time.monotonic() < deadline:
                    ray.get(actor.ready.remote(), timeout=max(0.1, deadline - time.monotonic()))
    finally:
        ray.shutdown()


@long
def test_without_address_a_local_ray_is_started_and_stopped(tmp_path):
    """In a process of its own: one process that uses two Ray instances in turn is not what Ray expects."""
    pytest.importorskip("ray")
    done = run_python("""
        import psutil, ray
        from loader import CachedLoader
        from tests.loader.datasets import ArangeDataset
        options = {"num_workers": 1, "init_options": {"object_store_memory": 100 << 20}, "start_timeout": 60}
        with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, executor="ray", executor_options=options) as loader:
            assert sorted(int(y) for batch in loader for y in batch["y"]) == list(range(8))
            assert ray.is_initialized()
            started = [p.pid for p in psutil.Process().children(recursive=True)]
        assert not ray.is_initialized(), "the loader started Ray: it must stop it"
        gone, alive = psutil.wait_procs([psutil.Process(p) for p in started if psutil.pid_exists(p)], timeout=30)
        assert started and not alive, f"Ray processes left running: {alive}"
        print("stopped", len(started))
    """, timeout=90)
    assert done.returncode == 0 and "stopped" in done.stdout, done.stderr[-3000:]


def test_an_actor_no_node_can_place_is_reported(cluster, tmp_path):
    options = ray_options(cluster, actor_options={"resources": {"no-such-resource": 1}}, start_timeout=1)
    with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, executor="ray", executor_options=options) as loader:
        with pytest.raises(WorkerError, match="did not start loader actor 0 .*no-such-resource"):
            list(loader)
    assert_released(tmp_path)


@pytest.mark.parametrize("asked, available, fit", [
    ({"num_cpus": 0.5}, {"CPU": 6.0, "memory": 1e9}, True),  # room now: the actor was slow to start
    ({"num_cpus": 0.5}, {"memory": 1e9}, False),  # the CPUs are taken
    ({"num_gpus": 1, "resources": {"producer": 1}}, {"GPU": 1.0, "producer": 0.5}, False),
    ({}, {}, True),
])
def test_an_actor_not_started_in_time_is_told_apart_from_one_no_node_can_place(asked, available, fit):
    from loader.executors.ray_options import fits

    assert fits(asked, available) is fit


@pytest.mark.parametrize("kwargs, match", [
    ({"executor": "dask"}, "executor must be one of"),
    ({"executor_options": {"num_workers": 2}}, "apply to executor='ray' only"),
    ({"executor": "ray", "executor_options": {"adress": "auto"}}, "unknown key.*'adress'"),
    ({"executor": "ray", "executor_options": {"address": 6379}}, "address"),
    ({"executor": "ray", "use_threading": True}, "use_threading"),
    ({"executor": "ray", "gpu_indices": [0]}, "num_gpus"),
    ({"executor": "ray", "nb_worker": 0}, "at least one actor"),
    ({"executor": "ray", "nb_worker": 2, "executor_options": {"num_workers": 3}}, "disagree"),
    ({"executor": "ray", "executor_options": {"num_workers": 0}}, "num_workers"),
    ({"executor": "ray", "executor_options": {"actor_options": {"lifetime": "detached"}}}, "'lifetime'"),
    ({"executor": "ray", "executor_options": {"actor_options": {"resources": {"producer": -1}}}}, "resources"),
    ({"executor": "ray", "executor_options": {"actor_options": []}}, "must be a dict"),
    ({"executor": "ray", "executor_options": {"init_options": {"address": "auto"}}}, "'address'"),
    ({"executor": "ray", "executor_options": {"start_timeout": 0}}, "start_timeout"),
])
def test_executor_arguments_are_validated(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CachedLoader(ArangeDataset, {"n": 4}, batch_size=2, **kwargs)


def run_python(code: str, timeout: float = 60) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)}
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def test_importing_the_packages_never_imports_ray():
    done = run_python("""
        import sys
        import cachestore, loader
        from loader import CachedLoader
        from tests.loader.datasets import ArangeDataset
        with CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, nb_worker=0) as l:
            list(l)
        assert "ray" not in sys.modules, "ray was imported"
        print("no ray")
    """)
    assert done.returncode == 0 and "no ray" in done.stdout, done.stderr


def test_executor_ray_without_ray_installed_names_the_install_command():
    done = run_python("""
        import sys
        sys.modules["ray"] = None  # as if it were not installed
        from cachestore.errors import CacheStoreError
        from loader import CachedLoader
        from tests.loader.datasets import ArangeDataset
        try:
            next(iter(CachedLoader(ArangeDataset, {"n": 8}, batch_size=4, executor="ray")))  # starts at iter()
        except ImportError as exc:
            assert isinstance(exc, CacheStoreError)
            print("error:", exc)
    """)
    assert done.returncode == 0, done.stderr
    assert 'error: ' in done.stdout and 'pip install "cachestore[ray]"' in done.stdout, done.stdout


def test_actors_answer_get_worker_info_and_run_worker_init_fn_on_their_copy(cluster):
    from ..torch_datasets import WorkerInfoDataset, set_handle_from_worker_info

    with CachedLoader(WorkerInfoDataset(8), batch_size=2, shuffle=False, executor="ray",
                      worker_init_fn=set_handle_from_worker_info, executor_options=ray_options(cluster)) as loader:
        rows = [{k: int(v[i]) for k, v in b.items()} for b in loader for i in range(len(b["id"]))]
    assert rows and all(r["id"] in (0, 1) and r["num_workers"] == 2 and r["same"] and r["seed_ok"] for r in rows)
    assert all(r["handle"] == 100 + r["id"] for r in rows), rows


def test_actors_serve_a_stream_in_torchs_turn_and_cache_it(cluster, tmp_path):
    # A stream's copies live on the actors, as a map-style dataset's tasks run there: the same worker loop.
    from torch.utils.data import DataLoader

    from ..streams.stream_datasets import Counting

    def ids(batches) -> list[list[int]]:
        return [np.asarray(b["i"]).ravel().tolist() for b in batches]

    expected = ids(DataLoader(Counting(30), batch_size=4, num_workers=2))
    with CachedLoader(Counting(30), batch_size=4, executor="ray", executor_options=ray_options(cluster)) as loader:
        assert ids(loader) == expected
    with CachedLoader(Counting(30), batch_size=4, shuffle=True, executor="ray", executor_options=ray_options(cluster),
                      cache_setting={"prefix": str(tmp_path / "c"), "background_refresh": False}) as loader:
        epochs = [sorted(i for b in ids(loader) for i in b) for _ in range(2)]
        assert [s.mode.value for s in loader.epoch_stats] == ["generate", "read"]
    assert epochs == [list(range(30))] * 2
    assert_released(tmp_path)


def test_a_stream_actor_that_dies_fails_the_epoch_with_a_worker_error(cluster, tmp_path):
    from ..streams.stream_datasets import Dying

    with CachedLoader(Dying(40, after=3), batch_size=2, executor="ray", executor_options=ray_options(cluster)) as loader:
        with pytest.raises(WorkerError, match="exited unexpectedly"):
            list(loader)
    assert_released(tmp_path)
