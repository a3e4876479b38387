"""The dataset fingerprint hashes parameters by value, and says in words what changed."""

from __future__ import annotations

import dataclasses
import functools
import threading
import unittest
from pathlib import Path

import numpy as np
import pytest
import torch

from cachestore import CacheStoreError, FingerprintError, FingerprintMismatchError
from loader.dataset import DatasetSource
from loader.cache.fingerprint import dataset_fingerprint, params_hash
from loader.cache.mismatch import describe_mismatch

from ..datasets import ArangeDataset


class Transform:
    """An object with the default repr (its state does not show in it)."""

    def __init__(self, scale: float, table: np.ndarray | None = None) -> None:
        self.scale = scale
        self.table = table


@dataclasses.dataclass
class Config:
    size: int
    mean: tuple = (0.5, 0.5)


def fp(params: dict, **kw) -> dict:
    return dataset_fingerprint(DatasetSource(ArangeDataset, params), kw.pop("length", 100),
                               kw.pop("partition", (0, 1)), **kw)


def test_one_changed_element_of_a_large_array_changes_the_fingerprint():
    # repr() elides the middle of a large array: this used to give the same fingerprint.
    table = np.arange(100_000, dtype=np.float32)
    changed = table.copy()
    changed[50_000] += 1
    assert repr(table) == repr(changed)
    assert fp({"table": table}) != fp({"table": changed})
    assert fp({"table": table}) == fp({"table": table.copy()})


@pytest.mark.parametrize("a, b", [
    (np.zeros(4, np.float32), np.zeros(4, np.float64)),  # dtype
    (np.zeros((2, 2)), np.zeros(4)),  # shape
    (np.arange(6).reshape(2, 3).T, np.arange(6).reshape(3, 2)),  # values (a transposed view)
    (1, 1.0), (1, True), ("1", 1), ([1, 2], (1, 2)), (b"ab", "ab"), (None, 0), (0.0, -0.0),
    ({"a": 1}, {"a": 2}), ({"a": 1}, {"b": 1}), ({1, 2}, {1, 3}),
    (Transform(2.0), Transform(3.0)),  # default repr: equal; state: different
    (Transform(1.0, np.zeros(3)), Transform(1.0, np.ones(3))),
    (Config(3), Config(4)), (Config(3), Config(3, (0.4, 0.5))),
    (torch.zeros(3), torch.ones(3)), (torch.zeros(3), torch.zeros(3, dtype=torch.float64)),
    (torch.zeros(2, 2, dtype=torch.bfloat16), torch.ones(2, 2, dtype=torch.bfloat16)),
    (Path("/data/a"), Path("/data/b")),
    (functools.partial(round, ndigits=1), functools.partial(round, ndigits=2)),
    (lambda x: x * 2, lambda x: x * 3),
], ids=lambda v: type(v).__name__)
def test_different_values_give_different_hashes(a, b):
    assert params_hash({"p": a}) != params_hash({"p": b})


@pytest.mark.parametrize("make", [
    lambda: {"b": np.arange(5), "a": [1, 2.5, "x", None, b"y", (True,)]},
    lambda: {"t": Transform(0.5, np.eye(3)), "c": Config(2)},
    lambda: {"s": {3, 1, 2}, "f": frozenset({"a"}), "nested": {"k": {"m": [np.float32(1.5)]}}},
    lambda: {"tensor": torch.arange(6.0).reshape(2, 3).t(), "path": Path("/x")},
    lambda: {"objects": np.array([1, "a", None], dtype=object)},
])
def test_equal_values_give_equal_hashes_in_every_run(make):
    # Fresh objects at other addresses, dict keys in another order: the same value, the same hash.
    first, second = make(), make()
    reordered = dict(reversed(list(second.items())))
    assert params_hash(first) == params_hash(reordered)


def test_cycles_are_hashed_not_followed_forever():
    a, b = [1], [1]
    a.append(a)
    b.append(b)
    assert params_hash({"x": a}) == params_hash({"x": b})
    shared = np.zeros(3)
    assert params_hash({"x": [shared, shared]}) == params_hash({"x": [np.zeros(3), np.zeros(3)]})


@pytest.mark.parametrize("bad, name", [
    (threading.Lock(), "lock"),
    ((i for i in range(3)), "generator"),
    (Transform(1.0, table=open(__file__)), "TextIOWrapper"),
])
def test_what_cannot_be_hashed_by_value_asks_for_an_explicit_fingerprint(bad, name):
    with pytest.raises(FingerprintError, match=r"params\['obj'\].*" + name) as info:
        fp({"obj": bad})
    assert "cache_setting={'fingerprint'" in str(info.value)
    assert isinstance(info.value, (CacheStoreError, TypeError))
    if isinstance(bad, Transform):
        bad.table.close()


def test_an_explicit_fingerprint_replaces_the_computed_identity():
    lock = threading.Lock()  # cannot be hashed by value: the user string stands for it
    explicit = fp({"obj": lock}, fingerprint="imagenet-2026-11")
    assert explicit == {"fingerprint": "imagenet-2026-11", "length": 100, "partition": [0, 1]}
    assert fp({"obj": 1}, fingerprint="imagenet-2026-11") == explicit
    assert fp({}, fingerprint="imagenet-2026-11", length=90) != explicit  # the length still counts
    for bad in ("", 3):
        with pytest.raises(TypeError):
            fp({}, fingerprint=bad)


def test_fingerprint_keys_are_the_documented_ones():
    assert list(fp({"n": 1})) == ["dataset", "params_sha256", "length", "source_sha256", "partition"]
    assert fp({"n": 1})["dataset"].endswith("ArangeDataset")


def test_describe_mismatch_names_each_changed_part():
    stored = fp({"n": 1})
    assert describe_mismatch(stored, dict(stored)) == "nothing differs"
    words = describe_mismatch(stored, fp({"n": 2}, length=120, partition=(1, 2)))
    assert "the dataset parameters changed" in words
    assert "the length changed (stored 100, now 120)" in words
    assert "the partition [consumer_index, nb_consumer] changed (stored [0, 1], now [1, 2])" in words
    assert "class" not in words and "source" not in words
    assert "the dataset class changed" in describe_mismatch({**stored, "dataset": "old.Name"}, stored)
    assert "the dataset's code (its class's source, or what its methods use) changed" in describe_mismatch({**stored, "source_sha256": "0"}, stored)
    explicit = fp({"n": 1}, fingerprint="v2")
    assert "explicit fingerprint (cache_setting['fingerprint']) changed (stored 'v1', now 'v2')" in \
        describe_mismatch(fp({"n": 1}, fingerprint="v1"), explicit)
    words = describe_mismatch(stored, explicit)
    assert "explicit cache_setting['fingerprint']" in words and "parameters" not in words
    assert describe_mismatch(None, stored) == "the store records no fingerprint to compare"


STDIN_SCRIPT = """
import numpy as np
from loader import CachedLoader

class Doubled:
    def __len__(self):
        return 6
    def __getitem__(self, i):
        return np.full(2, i * FACTOR)

with CachedLoader(Doubled, batch_size=3, nb_worker=0, shuffle=False,
                  cache_setting={{"prefix": {prefix!r}}}) as loader:
    print([b.tolist() for b in loader])
"""


def test_a_class_without_a_source_file_is_fingerprinted_by_its_code(tmp_path):
    """A class piped to ``python -`` has no file: its edited ``__getitem__`` must not be served old values."""
    import subprocess
    import sys

    def run(factor: int) -> subprocess.CompletedProcess:
        code = STDIN_SCRIPT.format(prefix=str(tmp_path / "c")).replace("FACTOR", str(factor))
        return subprocess.run([sys.executable, "-"], input=code, capture_output=True, text=True, timeout=60,
                              cwd=Path(__file__).resolve().parents[3])

    first = run(2)
    assert first.returncode == 0, first.stderr
    assert run(2).stdout == first.stdout  # the same code reuses its cache
    edited = run(3)
    assert edited.returncode != 0 and "FingerprintMismatchError" in edited.stderr, edited.stdout
    assert "source" in edited.stderr


# ---------------------------------------------------------------------------- a dataset instance
def _instance(table: np.ndarray, transform) -> DatasetSource:
    from ..datasets import TableDataset

    return DatasetSource.of(TableDataset(table, transform), None)


def test_an_instance_is_fingerprinted_by_its_state():
    from ..datasets import Compose, Scale

    table = np.arange(1000, dtype=np.float32).reshape(100, 10)
    first = dataset_fingerprint(_instance(table, Compose([Scale(2.0), lambda x: x + 1])), 100, (0, 1))
    again = dataset_fingerprint(_instance(table.copy(), Compose([Scale(2.0), lambda x: x + 1])), 100, (0, 1))
    assert first == again and "state_sha256" in first and "params_sha256" not in first
    changed = table.copy()
    changed[50, 5] += 1
    for other in (_instance(changed, Compose([Scale(2.0), lambda x: x + 1])),  # one array element
                  _instance(table, Compose([Scale(3.0), lambda x: x + 1])),  # a transform's state
                  _instance(table, Compose([Scale(2.0), lambda x: x + 2]))):  # a lambda's code
        theirs = dataset_fingerprint(other, 100, (0, 1))
        assert theirs["state_sha256"] != first["state_sha256"]
        assert describe_mismatch(first, theirs) == "the dataset's state (its attributes, or what its functions use) changed"


def test_an_attribute_that_cannot_be_hashed_is_named():
    from ..datasets import Compose, Scale

    lock = threading.Lock()
    source = _instance(np.zeros(3), Compose([Scale(1.0), abs, functools.partial(lambda x, l: x, l=lock)]))
    with pytest.raises(FingerprintError) as info:
        dataset_fingerprint(source, 3, (0, 1))
    message = str(info.value)
    assert "dataset.transform.transforms[2]" in message and "cache_setting={'fingerprint'" in message


def test_a_changed_instance_is_refused_by_its_cache(tmp_path):
    from loader import CachedLoader

    from ..datasets import Compose, Scale, TableDataset

    table = np.arange(40, dtype=np.float32).reshape(20, 2)
    setting = {"prefix": str(tmp_path / "c")}
    with CachedLoader(TableDataset(table, Compose([Scale(2.0)])), batch_size=5, nb_worker=0,
                      cache_setting=setting) as loader:
        assert sum(len(b) for b in loader) == 20
    with CachedLoader(TableDataset(table.copy(), Compose([Scale(2.0)])), batch_size=5, nb_worker=0,
                      cache_setting=setting) as loader:
        assert loader.epoch_stats == [] and next(iter(loader)).shape == (5, 2)
        assert loader.epoch_stats[0].mode == "read"  # the same state: the cache is reused
    table[3, 1] = -1
    with CachedLoader(TableDataset(table, Compose([Scale(2.0)])), batch_size=5, nb_worker=0,
                      cache_setting=setting) as loader:
        with pytest.raises(FingerprintMismatchError, match="state"):
            iter(loader)  # fingerprinted at the first iter(), with the dataset as it is then


def test_dataset_params_with_an_instance_is_a_type_error():
    from loader import CachedLoader

    from ..datasets import TableDataset

    with pytest.raises(TypeError, match="instance"):
        CachedLoader(TableDataset(np.zeros(4)), {"table": np.zeros(4)}, batch_size=2, nb_worker=0)


def _shared_state() -> list:
    import multiprocessing as mp

    return [mp.Value("i", 0), mp.Value("i", 0, lock=False), mp.Array("d", 3), mp.RawArray("i", 2), mp.Lock(),
            mp.RLock(), mp.Semaphore(2), mp.BoundedSemaphore(), mp.Event(), mp.Condition(), mp.Barrier(2),
            mp.Queue(), mp.JoinableQueue(), mp.SimpleQueue()]


def test_multiprocessing_shared_state_is_fingerprinted_by_what_it_is_not_by_its_value():
    import multiprocessing as mp

    hashes = [params_hash({"obj": obj}) for obj in _shared_state()]
    assert len(set(hashes)) == len(hashes), "each kind of primitive and each shared type is told apart"
    counter = mp.Value("i", 0)
    before = params_hash({"count": counter})
    counter.value = 6  # what the workers do while the loader runs
    assert params_hash({"count": counter}) == before == params_hash({"count": mp.Value("i", 41)})
    assert params_hash({"count": mp.Value("d", 0.0)}) != before, "the element type is part of it"
    assert params_hash({"table": mp.Array("d", 3)}) != params_hash({"table": mp.Array("d", 4)}), "so is the length"
    assert params_hash({"s": mp.Semaphore(1)}) == params_hash({"s": mp.Semaphore(5)})
    assert params_hash({"lock": mp.get_context("spawn").Lock()}) == params_hash({"lock": mp.Lock()})


@pytest.mark.timeout(60)
def test_a_managers_proxies_count_by_what_they_stand_for_not_their_address():
    import multiprocessing as mp

    with mp.Manager() as first, mp.Manager() as second:
        a, b = first.dict(), second.dict()
        before = params_hash({"shared": a})
        a["seen"] = 3  # what workers do while the loader runs
        assert params_hash({"shared": a}) == before == params_hash({"shared": b}), "another manager, another run"
        assert params_hash({"shared": first.list()}) != before
        assert params_hash({"shared": first.Value("i", 0)}) != before


def test_a_threads_lock_still_asks_for_an_explicit_fingerprint():
    # No process shares it: a dataset that holds one keeps what pickle cannot send, as before.
    with pytest.raises(FingerprintError, match="lock"):
        params_hash({"lock": threading.Lock()})


class Node:
    """A value of a graph whose parts are shared (and, with `up`, point back at their parent)."""

    def __init__(self, child: object, up: bool) -> None:
        self.left = child
        self.right = child
        if up and isinstance(child, Node):
            child.up = self


def _ladder(levels: int, leaf: int, up: bool) -> Node:
    node: object = leaf
    for _ in range(levels):
        node = Node(node, up)
    return node  # type: ignore[return-value]


@pytest.mark.timeout(20)  # walked once per path, 50 levels are 2**50 walks: a hang, not a slow test
@pytest.mark.parametrize("up", [False, True], ids=["shared", "shared-and-cyclic"])
def test_a_graph_of_shared_values_is_hashed_once_per_value(up):
    first = params_hash({"g": _ladder(50, 1, up)})
    assert params_hash({"g": _ladder(50, 1, up)}) == first
    assert params_hash({"g": _ladder(50, 2, up)}) != first, "the deepest value still counts"


@pytest.mark.timeout(20)
def test_a_dataset_holding_the_test_session_is_refused_at_once_naming_the_attribute(request):
    # torch's test_splits_indexing_type: the dataset keeps the running test (here pytest's request),
    # which reaches the whole session: its shared parts made the walk endless; now it ends at the
    # first attribute that is no data (an open stream, a thread's lock).
    source = _instance(np.zeros(3), None)
    source.instance.test_object = request
    with pytest.raises(FingerprintError, match=r"dataset\.test_object\.") as info:
        dataset_fingerprint(source, 3, (0, 1))
    assert "cache_setting={'fingerprint'" in str(info.value)


class CheckingDataset:
    """A dataset that asserts through the test that made it (torch's test_splits_indexing_type)."""

    def __init__(self, test: unittest.TestCase, data: list) -> None:
        self.test_object = test
        self.data = data

    def __getitem__(self, key: int) -> int:
        self.test_object.assertEqual(type(key), int)
        return self.data[key]

    def __len__(self) -> int:
        return len(self.data)


class TestADatasetHoldingItsRunningTestCase(unittest.TestCase):
    """Run by pytest as a unittest case: its state reaches pytest's session (streams, locks)."""

    def test_it_is_fingerprinted_by_its_class_and_test_name(self):
        def of(test: unittest.TestCase, data: list) -> dict:
            return dataset_fingerprint(DatasetSource.of(CheckingDataset(test, data), None), 3, (0, 1))

        first = of(self, [1, 2, 3])
        self.assertEqual(of(self, [1, 2, 3]), first)
        self.assertNotEqual(of(self, [1, 2, 4]), first)  # the data still counts
        self.assertNotEqual(of(TestADatasetHoldingItsRunningTestCase("test_it_is_cached_and_read_back"), [1, 2, 3]),
                            first)

    def test_it_is_cached_and_read_back(self):
        import tempfile

        from torch.utils.data import random_split

        from loader import CachedLoader

        with tempfile.TemporaryDirectory() as tmp:
            for mode in ("generate", "read"):
                dataset = random_split(CheckingDataset(self, [1, 2, 3, 4, 5]), [5], torch.Generator().manual_seed(0))[0]
                with CachedLoader(dataset, batch_size=2, num_workers=0,
                                  cache_setting={"prefix": f"{tmp}/c"}) as loader:
                    self.assertEqual(sorted(int(x) for b in loader for x in b), [1, 2, 3, 4, 5])
                    self.assertEqual(loader.epoch_stats[0].mode, mode)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_are_hashed_by_their_components():
    def nested(last: float, layout=torch.strided):
        return torch.nested.nested_tensor([torch.arange(5.0), torch.tensor([0.0, 1.0, last])], layout=layout)

    first = params_hash({"t": nested(2.0)})
    assert params_hash({"t": nested(2.0)}) == first
    assert params_hash({"t": nested(3.0)}) != first, "a value of a component"
    assert params_hash({"t": nested(2.0, torch.jagged)}) != first, "the layout"
    assert params_hash({"t": list(nested(2.0).unbind())}) != first, "a list of its components is another value"
