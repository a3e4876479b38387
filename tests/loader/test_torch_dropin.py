"""Where torch's DataLoader and CachedLoader must serve the same: the cases torch's own tests found."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DistributedSampler

from loader import CachedLoader

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_uneven_distributed_sampler_without_a_cache_serves_no_duplicate(workers):
    # 9 samples on 4 replicas: the sampler pads each rank to 3 by wrapping around; drop_last drops the
    # padding in torch, which serves 8 distinct samples (each rank's first batch of 2).
    data = torch.arange(9)
    served = []
    for rank in range(4):
        sampler = DistributedSampler(data, num_replicas=4, rank=rank)
        with CachedLoader(data, batch_size=2, drop_last=True, sampler=sampler, nb_worker=workers,
                          device="cpu") as loader:
            for epoch in range(2):
                sampler.set_epoch(epoch)
                served.append([int(x) for batch in loader for x in batch])
    for epoch in range(2):
        every_rank = [x for part in served[epoch::2] for x in part]
        assert len(every_rank) == 8 and len(set(every_rank)) == 8, every_rank


@pytest.mark.parametrize("cached", [False, True], ids=["nocache", "cache"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_distributed_sampler_dropping_the_tail_serves_as_many_samples_on_every_rank(workers, cached, tmp_path):
    # 45 samples on 2 ranks with DistributedSampler(drop_last=True): torch serves 22 + 22 distinct
    # samples each epoch (its sampler drops the permutation's tail), never 23 + 22.
    data = torch.arange(45)
    cache = {"prefix": str(tmp_path / "c")} if cached else None
    samplers = [DistributedSampler(data, num_replicas=2, rank=r, drop_last=True) for r in range(2)]
    loaders = [CachedLoader(data, batch_size=4, sampler=s, nb_worker=workers, cache_setting=cache) for s in samplers]
    with loaders[0], loaders[1]:
        for loader, sampler in zip(loaders, samplers):
            assert len(loader) == len(torch.utils.data.DataLoader(data, batch_size=4, sampler=sampler)) == 6
        for epoch in range(3):
            for s in samplers:
                s.set_epoch(epoch)
            served = [[int(x) for batch in loader for x in batch] for loader in loaders]
            assert [len(part) for part in served] == [22, 22], served
            assert len(set(served[0] + served[1])) == 44, served


def test_a_state_of_a_distributed_sampler_dropping_the_tail_resumes_its_epoch(tmp_path):
    data = torch.arange(45)
    cache = {"prefix": str(tmp_path / "c")}

    def loader_of(rank: int) -> CachedLoader:
        sampler = DistributedSampler(data, num_replicas=2, rank=rank, drop_last=True, seed=4)
        return CachedLoader(data, batch_size=4, sampler=sampler, nb_worker=0, cache_setting=cache)

    first = [loader_of(r) for r in range(2)]
    with first[0], first[1]:
        for loader in first:
            list(loader)  # epoch 0 writes the cache
        whole = [[int(x) for batch in loader for x in batch] for loader in first]  # epoch 1, uninterrupted
    again = [loader_of(r) for r in range(2)]
    with again[0], again[1]:
        for loader in again:
            list(loader)
        head, states = [], []
        for loader in again:
            it = iter(loader)
            head.append([int(x) for _ in range(2) for x in next(it)])
            states.append(loader.state_dict())
    for rank in range(2):
        with loader_of(rank) as resumed:
            resumed.load_state_dict(states[rank])
            assert head[rank] + [int(x) for batch in resumed for x in batch] == whole[rank]


class EveryFifthFails:
    """Samples 3, 8, 13, ... raise NotImplementedError (torch's ErrorDataset raises for every one)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index % 5 == 3:
            raise NotImplementedError(f"sample {index} is broken")
        return index


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("cached", [False, True], ids=["nocache", "cache"])
def test_a_dataset_error_is_raised_for_its_batch_and_the_epoch_goes_on(workers, cached, tmp_path):
    cache = {"prefix": str(tmp_path / "c")} if cached else None
    with CachedLoader(EveryFifthFails(20), batch_size=2, nb_worker=workers, shuffle=False,
                      cache_setting=cache) as loader:
        for _ in range(2):  # a generate epoch with failures keeps its generation partial: the next computes
            it, served, errors = iter(loader), [], 0
            while True:
                try:
                    served.append([int(x) for x in next(it)])
                except NotImplementedError as exc:
                    errors += 1
                    assert exc.sample_index % 5 == 3
                except StopIteration:
                    break
            assert errors == 4
            assert served == [[0, 1], [4, 5], [6, 7], [10, 11], [14, 15], [16, 17]]


# Created in the default context (fork): multiprocessing refuses to hand them to a spawned process, as it
# does for torch's workers.
@pytest.mark.parametrize("start_method", ["fork", "auto"])
def test_a_dataset_holding_an_mp_value_reaches_the_workers_as_they_start(start_method):
    from .torch_datasets import SharedCounterDataset

    dataset = SharedCounterDataset(8)
    with CachedLoader(dataset, batch_size=2, nb_worker=2, shuffle=False, start_method=start_method) as loader:
        assert sorted(int(x) for b in loader for x in b) == list(range(8))
    assert dataset.count.value == 8, "the workers incremented the training process's shared value"


def test_a_dataset_holding_an_mp_value_is_cached_and_read_back(tmp_path):
    # Its Value and Semaphore are how the workers coordinate, not data: the fingerprint takes their
    # types (torch's SynchronizedSeedDataset), and the second epoch is read from the store.
    from .torch_datasets import SharedCounterDataset

    dataset = SharedCounterDataset(8)
    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": False}
    with CachedLoader(dataset, batch_size=2, nb_worker=2, shuffle=False, start_method="fork",
                      cache_setting=cache) as loader:
        for _ in range(2):
            assert [int(x) for b in loader for x in b] == list(range(8))
        assert [(s.computed, s.read) for s in loader.epoch_stats] == [(8, 0), (0, 8)]
    assert dataset.count.value == 8, "the read epoch called no __getitem__"


@pytest.mark.parametrize("workers", [0, 2])
def test_namedtuple_samples_read_from_the_store_collate_into_a_namedtuple_of_batches(tmp_path, workers):
    from .torch_datasets import Data, Labelled, NamedTupleDataset

    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": False}
    with CachedLoader(NamedTupleDataset(), batch_size=2, nb_worker=workers, shuffle=False, device="cpu",
                      cache_setting=cache) as loader:
        epochs = [list(loader) for _ in range(2)]
        assert [(s.computed, s.read) for s in loader.epoch_stats] == [(6, 0), (0, 6)]
    for batch in epochs[1]:
        assert type(batch) is Labelled and type(batch.data) is Data and isinstance(batch.data.positive, torch.Tensor)
    for computed, read in zip(*epochs):
        assert read.label == computed.label and torch.equal(read.random_tensor, computed.random_tensor)
        assert torch.equal(read.data.negative, computed.data.negative)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_are_cached_and_read_back(tmp_path):
    from .torch_datasets import NestedTensors, keep_samples

    cache = {"prefix": str(tmp_path / "c"), "update_frequency": 2, "background_refresh": False}
    with CachedLoader(NestedTensors(), batch_size=1, nb_worker=2, shuffle=False, collate_fn=keep_samples,
                      cache_setting=cache) as loader:
        epochs = [[batch[0] for batch in loader] for _ in range(2)]
        assert [(s.computed, s.read) for s in loader.epoch_stats] == [(6, 0), (0, 6)]
    for i, got in enumerate(epochs[1]):
        assert got.is_nested and [p.tolist() for p in got.unbind()] == [list(map(float, range(i + 1))), [0.0, 0.0]]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_nested_tensors_come_back_from_workers():
    dataset = [torch.nested.nested_tensor([torch.arange(float(i + 1))]) for i in range(6)]
    with CachedLoader(dataset, batch_size=1, nb_worker=2, shuffle=False, collate_fn=lambda samples: samples) as loader:
        served = [batch[0] for batch in loader]
    assert len(served) == 6
    for got, expected in zip(served, dataset):
        assert got.is_nested and torch.equal(got.unbind()[0], expected.unbind()[0])


def test_a_worker_timeout_is_torchs_runtime_error():
    from loader.errors import WorkerTimeoutError

    assert issubclass(WorkerTimeoutError, RuntimeError)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors is in prototype stage")
def test_the_default_collate_refuses_nested_tensors_in_torchs_words():
    dataset = [torch.nested.nested_tensor([torch.arange(3.0)]) for _ in range(2)]
    with CachedLoader(dataset, batch_size=1, nb_worker=0, device="cpu") as loader:
        with pytest.raises(RuntimeError, match="not currently supported by the default collate_fn"):
            list(loader)
    with CachedLoader(dataset, batch_size=None, nb_worker=0) as unbatched, \
            CachedLoader(dataset, batch_size=1, nb_worker=0) as batched:
        assert not unbatched._auto_collation and batched._auto_collation  # torch's attribute


@pytest.mark.timeout(60)
def test_a_convolution_after_fork_does_not_hang():
    from .torch_datasets import ConvDataset, threads_in_worker

    with CachedLoader(ConvDataset(), batch_size=1, nb_worker=1, start_method="fork", device="cpu",
                      worker_init_fn=threads_in_worker, timeout=30) as loader:
        assert [tuple(x.shape) for x in loader] == [(1, 1, 1, 23999)]


class ByLists:
    """``dataset[list]`` only, as torch's BulkLoadingDataset: a whole list of indices at once."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, indices: list[int]) -> torch.Tensor:
        assert isinstance(indices, list), indices
        return torch.as_tensor(indices) * 10


class ListsOf4:
    """A sampler that yields lists of 4 shuffled indices (torch's BulkLoadingSampler)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self):
        for part in torch.randperm(self.n).split(4):
            yield part.tolist()

    def __len__(self) -> int:
        return -(-self.n // 4)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_sampler_of_lists_without_batch_size_hands_each_list_to_the_dataset_whole(workers):
    with CachedLoader(ByLists(35), batch_size=None, sampler=ListsOf4(35), nb_worker=workers, device="cpu") as loader:
        assert not loader._auto_collation and len(loader) == 9
        for _ in range(2):
            served = list(loader)
            assert [len(x) for x in served] == [4] * 8 + [3]
            assert sorted(int(x) for batch in served for x in batch) == [10 * i for i in range(35)]


def test_a_sampler_of_lists_with_a_cache_is_served_uncached_and_says_why(tmp_path):
    # As torch serves it (its tests run with a cache too): every epoch computes, nothing is written.
    with CachedLoader(ByLists(10), batch_size=None, sampler=ListsOf4(10), nb_worker=0,
                      cache_setting={"prefix": str(tmp_path / "c")}) as loader:
        with pytest.warns(UserWarning, match="not one sample per index"):
            epochs = [sorted(int(x) for batch in loader for x in batch) for _ in range(2)]
        assert epochs == [[10 * i for i in range(10)]] * 2
        assert loader.store is not None and loader.store.latest() is None


class WhoComputes:
    """Samples ``(worker id, index)``, the id set by ``worker_init_fn`` on the worker's copy (torch's
    TestWorkerQueueDataset)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.worker_id = -1

    def __len__(self) -> int:
        return self.n

    def init(self, worker_id: int) -> None:
        self.worker_id = worker_id

    def __getitem__(self, index: int) -> tuple[int, int]:
        return self.worker_id, index


@pytest.mark.parametrize("workers", [2, 3])
def test_with_a_worker_init_fn_batches_go_to_the_workers_in_turn_whole(workers):
    dataset = WhoComputes(100)
    with CachedLoader(dataset, batch_size=8, shuffle=False, nb_worker=workers, worker_init_fn=dataset.init,
                      device="cpu") as loader:
        for _ in range(2):
            served = list(loader)
            assert len(served) == 13
            for i, (who, index) in enumerate(served):
                assert who.tolist() == [i % workers] * len(index)
                assert index.tolist() == list(range(8 * i, min(8 * i + 8, 100)))
