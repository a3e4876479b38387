"""dataset_server and swift_loader users: their README snippets run with only the import line changed.

Signatures, positional order and documented defaults are those of the original projects
(github.com/viebboy/dataset_server ``dataset_server/apis.py`` and README;
github.com/viebboy/swift-loader ``swift_loader/interface.py`` and README).
"""

from __future__ import annotations

import inspect
import json
import logging
import math

import numpy as np
import pytest

from loader import CachedLoader
from loader.compat import base as compat_base
from loader.compat import AsyncDataLoader, DataLoader, SwiftLoader

from .. import compat_datasets
from ..compat_datasets import Dataset, SuitableDataset, broken_collate, tuple_collate

pytestmark = pytest.mark.timeout(90)

EMPTY = inspect.Parameter.empty


@pytest.fixture(autouse=True)
def fresh_explanations(monkeypatch):
    """Each test sees the once-per-process explanations afresh."""
    monkeypatch.setattr(compat_base, "_explained", set())


def run_snippet(source: str, **names) -> dict:
    namespace = {"__name__": "snippet", **names}
    exec(compile(source, "<readme snippet>", "exec"), namespace)
    return namespace


# ---------------------------------------------------------------------------- README snippets
# dataset_server README, "Usage": the placeholders filled in, the loop body given a line.
DATASET_SERVER_README = """
from loader.compat import DataLoader

params = {
    'param1': 300,  # some value for 1st positional argument
    'param2': 8,    # some value for 2nd positional argument
}

async_dataloader = DataLoader(
    dataset_class=SuitableDataset, #pass the dataset class here, not the object
    dataset_params=params, # keyword arguments used to construct dataset object here
    batch_size=128, # specify the batch size of the data loader here
    nb_worker=1, # specify the number of worker processes to load from the dataset
    shuffle=True, # whether to perform shuffling
)

# then use this data loader like any other loaders:
for samples in async_dataloader:
    # perform processing here with the samples
    seen.extend(samples[1].tolist())
"""


def test_dataset_server_readme_snippet(no_leaks):
    seen: list[int] = []
    ns = run_snippet(DATASET_SERVER_README, SuitableDataset=SuitableDataset, seen=seen)
    loader = ns["async_dataloader"]
    try:
        assert isinstance(loader, CachedLoader) and isinstance(loader, DataLoader)
        assert sorted(seen) == list(range(300)) and seen != list(range(300))  # every sample once, shuffled
        assert len(loader) == 3 and loader.nb_worker == 1
    finally:
        loader.close()


# swift_loader README "Quick Start" and the example in SwiftLoader's docstring. No GPU in the
# tests: device="cpu" where the docstring has "cuda:0" (batches still become torch tensors).
SWIFT_LOADER_README = """
from loader.compat import SwiftLoader

loader = SwiftLoader(
    dataset_class=Dataset,
    dataset_kwargs=dataset_kwargs, # keyword-arguments for dataset construction,
    batch_size=32, # integer defining batch size
    nb_consumer=nb_gpu, # should be the number of GPUs used for training
    worker_per_consumer=4, # number of child processes that loads & batch data for a consumer (a GPU)
    shuffle=True,
    **kwargs,
)

loader.start(consumer_index=0, device="cpu")
for batch in loader:
    # Process batch
    batches.append(batch)
loader.close()
"""


def test_swift_loader_readme_snippet(no_leaks):
    batches: list = []
    ns = run_snippet(SWIFT_LOADER_README, Dataset=Dataset, dataset_kwargs={"train": True, "n": 100}, nb_gpu=1,
                     kwargs={"seed_numer": 7, "data_queue_size": 4}, batches=batches)
    loader = ns["loader"]
    assert isinstance(loader, CachedLoader) and loader.seed == 7 and loader.max_queue_size == 4
    assert loader.nb_worker == 4
    labels = np.concatenate([target.numpy() for _, target in batches])
    assert sorted(labels.tolist()) == list(range(100))
    assert type(batches[0][0]).__module__.startswith("torch")


# The training loop of swift_loader's examples/fabric_example.py, on one consumer.
SWIFT_LOADER_FABRIC_LOOP = """
from loader.compat import SwiftLoader

train_loader = SwiftLoader(
    dataset_class=Dataset,
    dataset_kwargs={"train": True, "n": 64},
    batch_size=hparams["batch_size"],
    nb_consumer=nb_consumer,
    worker_per_consumer=hparams["worker_per_consumer"],
    shuffle=True,
)
train_loader.start(
    consumer_index=global_rank,
    device=device,
)
for epoch in range(1, hparams["epochs"] + 1):
    for batch_idx, (data, target) in enumerate(train_loader):
        log.append((epoch, batch_idx, len(data), len(train_loader.dataset), len(train_loader)))
train_loader.close()
"""


def test_swift_loader_fabric_example_loop(no_leaks):
    log: list = []
    run_snippet(SWIFT_LOADER_FABRIC_LOOP, Dataset=Dataset, hparams={"batch_size": 16, "worker_per_consumer": 1,
                                                                     "epochs": 2},
                nb_consumer=1, global_rank=0, device=None, log=log)
    assert [(e, i) for e, i, *_ in log] == [(e, i) for e in (1, 2) for i in range(4)]
    assert all(n == 16 and size == 64 and batches == 4 for _, _, n, size, batches in log)


# dataset_server examples/cifar10_example.py, test_cache_client(), without tqdm; run in a
# temporary directory (its prefix is relative).
ASYNC_DATALOADER_EXAMPLE = """
from loader.compat import AsyncDataLoader

cache_setting = {
    'side': 'client',
    'prefix': './data/train_cache',
    'update_frequency': 3,
}
dataloader = AsyncDataLoader(
    dataset_class=Dataset,
    dataset_params={'train': True},
    batch_size=64,
    nb_servers=1,
    start_port=50000,
    max_queue_size=128,
    nearby_shuffle=100,
    cache_setting=cache_setting,
)
print(f'data loader length: {len(dataloader)}')

for _ in range(6):
    for samples in dataloader:
        pass

stats = list(dataloader.epoch_stats)
dataloader.close()
"""


def test_async_dataloader_example(no_leaks, monkeypatch, caplog):
    monkeypatch.chdir(no_leaks)
    caplog.set_level(logging.INFO, logger="loader.compat")
    ns = run_snippet(ASYNC_DATALOADER_EXAMPLE, Dataset=Dataset)
    # Generation 1 is computed in the background during the cached epochs of generation 0 (the default).
    assert [s.mode for s in ns["stats"]] == ["generate", "read", "read", "read", "read", "read"]
    assert [s.generation for s in ns["stats"]] == [0, 0, 0, 1, 1, 1]
    assert all(s.samples == 200 for s in ns["stats"])
    assert (no_leaks / "data" / "train_cache").is_dir()
    said = caplog.text
    assert "start_port" in said and "cache_setting['side']" in said


# ---------------------------------------------------------------------------- signatures
DATALOADER_SIGNATURE = [
    ("dataset_class", EMPTY), ("dataset_params", EMPTY), ("batch_size", EMPTY), ("nb_worker", EMPTY),
    ("max_minibatch_length", None), ("max_queue_size", 20), ("prefetch_time", None), ("shuffle", False),
    ("device", None), ("pin_memory", False), ("gpu_indices", None), ("nearby_shuffle", 0),
    ("cache_setting", None), ("rotation_setting", None), ("use_threading", False), ("collate_fn", None),
]
ASYNC_SIGNATURE = [
    ("dataset_class", EMPTY), ("dataset_params", EMPTY), ("batch_size", EMPTY), ("nb_servers", EMPTY),
    ("start_port", 11111), ("max_queue_size", 20), ("shuffle", False), ("device", None), ("pin_memory", False),
    ("packet_size", 125000), ("wait_time", 10), ("retry_interval", 10), ("nb_retry", 10), ("gpu_indices", None),
    ("nearby_shuffle", 0), ("cache_setting", None), ("client_rotation_setting", None),
    ("server_rotation_setting", None),
]
SWIFT_POSITIONAL = [
    ("dataset_class", EMPTY), ("dataset_kwargs", EMPTY), ("batch_size", EMPTY), ("nb_consumer", EMPTY),
    ("worker_per_consumer", EMPTY), ("shuffle", True),
]
SWIFT_KEYWORDS = {
    "seed": None, "seed_numer": None, "data_queue_size": 10, "message_queue_size": 10, "collate_fn": None,
    "logger": None, "batch_encoder": None, "batch_decoder": None, "nearby_shuffle": None, "benchmark": True,
    "benchmark_file": None, "validate": True, "multithread": False, "max_nb_batch_on_device": 1,
    "max_buffer_size": None,
}


def _positional(cls: type) -> list[tuple[str, object]]:
    params = list(inspect.signature(cls).parameters.values())
    return [(p.name, p.default) for p in params if p.kind is inspect.Parameter.POSITIONAL_OR_KEYWORD]


@pytest.mark.parametrize("cls,expected", [(DataLoader, DATALOADER_SIGNATURE), (AsyncDataLoader, ASYNC_SIGNATURE),
                                          (SwiftLoader, SWIFT_POSITIONAL)])
def test_positional_order_names_and_defaults(cls, expected):
    assert _positional(cls) == expected


def test_swift_keywords_and_defaults():
    params = inspect.signature(SwiftLoader).parameters
    keywords = {p.name: p.default for p in params.values() if p.kind is inspect.Parameter.KEYWORD_ONLY}
    assert keywords == SWIFT_KEYWORDS


# ---------------------------------------------------------------------------- arguments land
def test_dataloader_positional_call_maps_each_argument(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loader.compat")
    with DataLoader(Dataset, {"n": 10}, 4, 0, 1 << 20, 7, 0.5, True, None, False, [0], 3, None,
                    {"medium": "memory", "rotation": 2}, True, tuple_collate) as loader:
        assert (loader.batch_size, loader.nb_worker, loader.max_queue_size, loader.prefetch_time) == (4, 0, 7, 0.5)
        assert loader.shuffle is True and loader.nearby_shuffle == 3 and loader.gpu_indices == [0]
        assert loader.rotation.rotation == 2 and loader.collate_fn is tuple_collate
        # dataset_server's meanings, not ours: no worker threads, no split of batches into tasks.
        assert loader.use_threading is False and loader.max_minibatch_length is None
        assert sum(len(y) for _, y in loader) == 20
    assert "use_threading is accepted and not needed" in caplog.text
    assert "max_minibatch_length is accepted and not needed" in caplog.text


def test_every_documented_argument_is_accepted_by_name(tmp_path):
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2}
    with DataLoader(dataset_class=Dataset, dataset_params={"n": 8}, batch_size=4, nb_worker=0,
                    max_minibatch_length=4096, max_queue_size=3, prefetch_time=0, shuffle=True, device="cpu",
                    pin_memory=True, gpu_indices=[0], nearby_shuffle=2, cache_setting=cache, rotation_setting=None,
                    use_threading=True, collate_fn=None) as loader:
        batches = list(loader)
        assert type(batches[0][0]).__module__.startswith("torch") and loader.store is not None
    with AsyncDataLoader(dataset_class=Dataset, dataset_params={"n": 8}, batch_size=4, nb_servers=0,
                         start_port=1, max_queue_size=3, shuffle=True, device="cpu", pin_memory=False,
                         packet_size=1, wait_time=0, retry_interval=1, nb_retry=1, gpu_indices=None,
                         nearby_shuffle=2, cache_setting={**cache, "side": "client"}, client_rotation_setting=None,
                         server_rotation_setting=None, client_wait_time=1, qt_threading=True) as loader:
        assert [s.mode for s in loader.epoch_stats] == [] and len(list(loader)) == 2
        assert loader.epoch_stats[0].mode == "read"  # the same dataset, prefix and params: reused


def test_dataloader_defaults_are_dataset_servers():
    with DataLoader(Dataset, {"n": 10}, 4, 0) as loader:
        assert loader.shuffle is False and loader.max_queue_size == 20 and loader.nearby_shuffle == 0
        assert [y.tolist() for _, y in loader] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9]]


def test_async_positional_call_maps_each_argument(tmp_path):
    with AsyncDataLoader(Dataset, {"n": 10}, 4, 0, 50000, 9, True, None, False, 4096, 0.25, 1, 2, None, 5,
                         {"side": "server", "prefix": str(tmp_path / "c"), "update_frequency": 2}) as loader:
        assert (loader.nb_worker, loader.max_queue_size, loader.prefetch_time) == (0, 9, 0.25)
        assert loader.shuffle is True and loader.nearby_shuffle == 5
        assert loader.cache.prefix == str(tmp_path / "c") and loader.cache.update_frequency == 2


def test_async_rotation_settings_become_one(tmp_path):
    server = {"rotation": 3, "min_rotation_size": 5, "max_rotation_size": 8, "medium": "disk",
              "prefix": str(tmp_path / "rot")}
    client = {"rotation": 2, "min_rotation_size": 1, "max_rotation_size": 4, "medium": "memory"}
    with AsyncDataLoader(Dataset, {"n": 12}, 4, 0, wait_time=0, server_rotation_setting=server) as loader:
        assert (loader.rotation.medium, loader.rotation.rotation, loader.rotation.size) == ("disk", 3, 8)
        assert sum(len(y) for _, y in loader) == 36
    with AsyncDataLoader(Dataset, {"n": 12}, 4, 0, wait_time=0, client_rotation_setting=client,
                         server_rotation_setting=server) as loader:
        assert loader.rotation.rotation == 6 and loader.rotation.size == 8
    with AsyncDataLoader(Dataset, {"n": 12}, 4, 0, wait_time=0, client_rotation_setting=client) as loader:
        assert (loader.rotation.medium, loader.rotation.rotation, loader.rotation.size) == ("memory", 2, 4)


def test_swift_positional_call_and_deferred_start():
    loader = SwiftLoader(Dataset, {"n": 10}, 4, 2, 0, False)
    assert isinstance(loader, CachedLoader)
    with pytest.raises(RuntimeError, match="start"):
        len(loader)
    with pytest.raises(RuntimeError, match="start"):
        iter(loader)
    loader.start(1)
    try:
        assert (loader.nb_consumer, loader.consumer_index, loader.nb_worker, loader.shuffle) == (2, 1, 0, False)
        assert loader.nearby_shuffle == 20  # swift_loader's default: 5 * batch_size
        assert [y.tolist() for _, y in loader] == [[5, 6, 7, 8], [9]]  # swift_loader's: the second run of 5
        with pytest.raises(RuntimeError, match="called already"):
            loader.start(0)
    finally:
        loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        iter(loader)
    unstarted = SwiftLoader(Dataset, {"n": 10}, 4, 2, 0, False)
    unstarted.close()
    with pytest.raises(RuntimeError, match="closed"):
        unstarted.start(0)  # nothing is started after close()


def test_swift_close_before_start_then_start_fails():
    loader = SwiftLoader(Dataset, {"n": 10}, 4, 1, 0)
    loader.close()
    loader.close()
    with pytest.raises(RuntimeError, match="closed"):
        loader.start(0)


def test_swift_every_documented_argument_is_accepted(tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="loader.compat")
    moved: list = []
    loader = SwiftLoader(
        dataset_class=Dataset, dataset_kwargs={"n": 10}, batch_size=4, nb_consumer=1, worker_per_consumer=0,
        shuffle=True, seed_numer=3, data_queue_size=5, message_queue_size=3, collate_fn=tuple_collate,
        logger={"path": str(tmp_path / "log" / "run.log"), "stdout": False, "level": "info"},
        batch_encoder=repr, batch_decoder=eval, nearby_shuffle=2, benchmark=True,
        benchmark_file=str(tmp_path / "bench.jsonl"), validate=True, multithread=True, max_nb_batch_on_device=2,
        max_buffer_size=4)
    loader.start(0, device=None, to_device=lambda b: moved.append(b) or b)
    with loader:
        assert (loader.seed, loader.max_queue_size, loader.nearby_shuffle, loader.collate_fn) == (3, 5, 2,
                                                                                                 tuple_collate)
        assert loader.use_threading is False
        assert sorted(i for _, y in loader for i in y.tolist()) == list(range(10))
    assert len(moved) == 3
    for name in ("message_queue_size", "batch_encoder", "batch_decoder", "multithread", "max_buffer_size"):
        assert f"SwiftLoader: {name} is accepted and not needed here" in caplog.text
    assert (tmp_path / "log" / "run_Dataloader-0.log").read_text().count("SwiftLoader started") == 1


def test_seed_and_seed_numer_are_one_argument():
    loader = SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, seed=5)
    loader.start(0)
    with loader:
        assert loader.seed == 5
    with pytest.raises(ValueError, match="seed_numer"):
        SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, seed=5, seed_numer=6)


def test_cached_loader_keywords_pass_through(tmp_path):
    loader = SwiftLoader(Dataset, {"n": 10}, 4, 1, 0,
                         cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": math.inf})
    loader.start(0)
    with loader:
        assert loader.cache.update_frequency == math.inf
        for _ in range(2):
            list(loader)
        assert [s.mode for s in loader.epoch_stats] == ["generate", "read"]
    with DataLoader(Dataset, {"n": 10}, 4, 0, shuffle=True, seed=11, drop_last=True) as loader:
        assert loader.seed == 11 and len(loader) == 2


@pytest.mark.parametrize("make", [
    lambda: DataLoader(Dataset, {"n": 4}, 2, 0, colour="red"),
    lambda: DataLoader(Dataset, {"n": 4}, 2, 0, worker_per_consumer=2),  # its name is nb_worker
    lambda: DataLoader(Dataset, {"n": 4}, 2, 0, None, 20, None, False, None, False, None, 0, None, None, False,
                       None, "one too many"),
    lambda: AsyncDataLoader(Dataset, {"n": 4}, 2, 0, bogus=1),
    lambda: AsyncDataLoader(Dataset, {"n": 4}, 2, 0, rotation_setting={"rotation": 2}),  # two of its own instead
    lambda: SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, seed_number=1),  # misspelt: swift_loader ignored it
    lambda: SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, nb_worker=2),  # its name is worker_per_consumer
    lambda: SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, True, 5),  # seed is keyword-only, as in **kwargs
])
def test_unknown_arguments_raise_type_error(make):
    with pytest.raises(TypeError):
        make()


def test_each_explanation_is_logged_once(caplog):
    caplog.set_level(logging.INFO, logger="loader.compat")
    for _ in range(3):
        SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, message_queue_size=50).close()
    assert caplog.text.count("message_queue_size is accepted and not needed") == 1


def test_defaults_explain_nothing(caplog):
    caplog.set_level(logging.INFO, logger="loader.compat")
    SwiftLoader(Dataset, {"n": 4}, 2, 1, 0).close()
    with DataLoader(Dataset, {"n": 4}, 2, 0):
        pass
    assert "not needed" not in caplog.text


# ---------------------------------------------------------------------------- validate
def test_validate_fails_at_construction_in_the_training_process(no_leaks):
    with pytest.raises(ValueError, match="cannot stack") as info:
        SwiftLoader(Dataset, {"n": 20}, 8, 1, 2, collate_fn=broken_collate)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert not notes or "validate=True: failed while collating samples 0..7" in notes
    # Nothing was started: the no_leaks fixture finds no worker process.


def test_validate_false_defers_the_check():
    calls: list = []
    loader = SwiftLoader(Dataset, {"n": 20}, 8, 1, 0, collate_fn=lambda s: calls.append(s), validate=False)
    loader.close()
    assert calls == []


def test_validate_reports_a_broken_dataset_constructor():
    with pytest.raises(TypeError):
        SwiftLoader(Dataset, {"no_such_argument": 1}, 8, 1, 0)


# ---------------------------------------------------------------------------- benchmark, logger, device
def test_benchmark_file_gets_one_json_line_per_epoch(tmp_path):
    bench = tmp_path / "out" / "bench.jsonl"
    loader = SwiftLoader(Dataset, {"n": 10}, 4, 1, 0, benchmark_file=str(bench),
                         cache_setting={"prefix": str(tmp_path / "c"), "update_frequency": 2})
    loader.start(0)
    with loader:
        for epoch in range(3):
            for _ in loader:
                pass
            assert len(bench.read_text().splitlines()) == epoch + 1  # written as the epoch ends
        for _ in loader:
            break  # a broken-off epoch is reported too, as not finished
    lines = [json.loads(line) for line in bench.read_text().splitlines()]
    assert [(d["epoch"], d["mode"], d["samples"], d["finished"]) for d in lines] == [
        (0, "generate", 10, True), (1, "read", 10, True), (2, "generate", 10, True), (3, "read", 4, False)]
    assert all(d["seconds"] >= 0 and "wait_seconds" in d for d in lines)


def test_an_abandoned_iterator_reports_only_its_own_epoch(tmp_path):
    bench = tmp_path / "bench.jsonl"
    loader = SwiftLoader(Dataset, {"n": 8}, 4, 1, 0, benchmark_file=str(bench))
    loader.start(0)
    with loader:
        abandoned = iter(loader)
        next(abandoned)
        list(loader)  # the next epoch stops the first one
        del abandoned
    lines = [json.loads(line) for line in bench.read_text().splitlines()]
    assert sorted((d["epoch"], d["finished"]) for d in lines) == [(0, False), (1, True)]


def test_benchmark_without_file_logs_and_can_be_off(caplog):
    caplog.set_level(logging.INFO, logger="loader.compat")
    for benchmark in (True, False):
        loader = SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, benchmark=benchmark)
        loader.start(0)
        with loader:
            list(loader)
    assert caplog.text.count("epoch 0 (compute): 2 batches, 4 samples") == 1


def test_logger_prefix_writes_json_lines_and_is_removed_at_close(tmp_path):
    ours = logging.getLogger("loader")
    handlers, level = list(ours.handlers), ours.level
    loader = SwiftLoader(Dataset, {"n": 4}, 2, 2, 0, logger=str(tmp_path / "logs" / "train"))
    loader.start(1)
    with loader:
        assert any(isinstance(h, logging.FileHandler) for h in ours.handlers)
        assert ours.getEffectiveLevel() == logging.DEBUG
        list(loader)
    assert ours.handlers == handlers and ours.level == level
    records = [json.loads(line) for line in (tmp_path / "logs" / "train_Dataloader-1.json").read_text().splitlines()]
    assert any(r["message"].startswith("SwiftLoader started: consumer 1 of 2") for r in records)
    assert all(set(r) >= {"time", "level", "logger", "message"} for r in records)


def test_logger_file_at_debug_does_not_flood_the_console(tmp_path):
    console: list[logging.LogRecord] = []

    class Console(logging.Handler):  # like basicConfig's handler: no level of its own
        def emit(self, record):
            if record.name.startswith(("loader", "cachestore")):
                console.append(record)

    root = logging.getLogger()
    handler, level = Console(), root.level
    root.addHandler(handler)
    root.setLevel(logging.WARNING)
    try:
        loader = SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, logger={"path": str(tmp_path / "run.log")})
        loader.start(0)
        with loader:
            list(loader)
            logging.getLogger("loader.compat").warning("a warning still reaches the console")
        assert [r.getMessage() for r in console] == ["a warning still reaches the console"]
        assert "SwiftLoader started" in (tmp_path / "run_Dataloader-0.log").read_text()
        assert logging.getLogger("loader").propagate is True
    finally:
        root.removeHandler(handler)
        root.setLevel(level)


def test_logger_instance_gets_our_records():
    got: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record):
            got.append(record.getMessage())

    target = logging.getLogger("user.training")
    target.setLevel(logging.INFO)
    handler = Collect()
    target.addHandler(handler)
    try:
        loader = SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, logger=target)
        loader.start(0)
        with loader:
            list(loader)
        assert any(m.startswith("SwiftLoader started") for m in got)
        assert any(m.startswith("epoch 0 (compute)") for m in got)  # benchmark=True logs there
        count = len(got)
        logging.getLogger("loader.compat").warning("after close")
        assert len(got) == count
    finally:
        target.removeHandler(handler)


@pytest.mark.parametrize("bad", [42, {"path": "x", "colour": "red"}, {"level": "LOUD"}])
def test_malformed_logger_fails_at_construction(bad):
    with pytest.raises((TypeError, ValueError)):
        SwiftLoader(Dataset, {"n": 4}, 2, 1, 0, logger=bad)


@pytest.mark.parametrize("on_device", [1, 3])
def test_max_nb_batch_on_device_moves_batches_ahead(on_device):
    moved: list[int] = []

    def to_device(batch):
        moved.append(int(batch[1][0]))
        return batch

    loader = SwiftLoader(Dataset, {"n": 20}, 2, 1, 0, False, max_nb_batch_on_device=on_device)
    loader.start(0, to_device=to_device)
    with loader:
        it = iter(loader)
        first = next(it)
        assert int(first[1][0]) == 0
        assert len(moved) == on_device  # the one in hand and on_device - 1 ahead of it
        rest = list(it)
    assert len(rest) == 9 and moved == list(range(0, 20, 2))


def test_compat_datasets_are_importable_by_module_path():
    # Workers build the dataset from its module path under spawn.
    assert SuitableDataset.__module__ == compat_datasets.__name__
