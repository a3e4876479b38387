"""A dataset whose module imports torch, as most do: what a worker imports when it builds it shows."""

from __future__ import annotations

import collections
import os

import torch  # noqa: F401  the import whose cost a worker that only reads must not pay

from .datasets import ArangeDataset


class TorchArange(ArangeDataset):
    """:class:`ArangeDataset` that leaves a ``built-<pid>`` file in `counter_dir` each time it is built."""

    def __init__(self, n: int = 100, counter_dir: str | None = None) -> None:
        super().__init__(n, counter_dir=counter_dir)
        if counter_dir:
            open(os.path.join(counter_dir, f"built-{os.getpid()}"), "a").close()


class FailsInWorkers(ArangeDataset):
    """Builds in the process whose pid is `home` (the training process), and fails in every other."""

    def __init__(self, n: int = 10, home: int = 0) -> None:
        super().__init__(n)
        if os.getpid() != home:
            raise OSError("this machine's dataset files are not mounted in the worker")


class WorkerInfoDataset(torch.utils.data.Dataset):
    """Each sample says what ``get_worker_info()`` says where ``__getitem__`` runs, and what
    ``worker_init_fn`` left on the dataset copy it runs on (``handle``, ``opened_by``)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        info = torch.utils.data.get_worker_info()
        if info is None:
            return {"id": -1, "num_workers": 0, "seed_ok": 1, "same": 1, "handle": -1, "opened_by": -1}
        return {"id": info.id, "num_workers": info.num_workers, "seed_ok": int(info.seed == torch.initial_seed()),
                "same": int(info.dataset is self), "handle": getattr(self, "handle", -2),
                "opened_by": getattr(self, "opened_by", -2)}

    def open_files(self, worker_id: int) -> None:
        """A bound-method worker_init_fn: it must change the copy the worker's tasks run on."""
        self.opened_by = worker_id


def set_handle_from_worker_info(worker_id: int) -> None:
    """torch's documented worker_init_fn: set up the worker's copy through ``get_worker_info().dataset``."""
    info = torch.utils.data.get_worker_info()
    assert info is not None and info.id == worker_id
    info.dataset.handle = 100 + worker_id


def refuse_to_start(worker_id: int) -> None:
    """A ``worker_init_fn`` that fails, as one whose resources are missing does."""
    raise ValueError(f"this worker refuses to start ({worker_id})")


class SharedCounterDataset(torch.utils.data.Dataset):
    """Holds an ``mp.Value`` that every worker increments: multiprocessing hands it over only while a
    worker process starts (torch's SynchronizedDataset does the same with a Semaphore)."""

    def __init__(self, n: int = 8) -> None:
        import multiprocessing

        self.n = n
        self.count = multiprocessing.Value("i", 0, lock=True)
        self.barrier = multiprocessing.Semaphore(1)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        with self.barrier:
            with self.count.get_lock():
                self.count.value += 1
        return index


class ConvDataset(torch.utils.data.Dataset):
    """A convolution in ``__getitem__``: torch's intra-op pool, forked from a parent that used it, deadlocks."""

    def __init__(self) -> None:
        self.x = torch.ones(1, 1, 24000)
        self(self.x)  # the parent runs the pool once

    def __call__(self, x):
        return torch.nn.functional.conv1d(x, torch.ones(1, 1, 2))

    def __len__(self) -> int:
        return 1

    def __getitem__(self, index: int):
        return self(self.x)


def threads_in_worker(_: int) -> None:
    assert torch.get_num_threads() == 1, "torch's workers run one intra-op thread"


Data = collections.namedtuple("Data", ["positive", "negative"])
Labelled = collections.namedtuple("Labelled", ["data", "label", "random_tensor"])


class NamedTupleDataset(torch.utils.data.Dataset):
    """torch's NamedTupleDataset, with its namedtuples at module level (workers send them by name)."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int) -> Labelled:
        return Labelled(Data(positive=index, negative=-index), label=str(index),
                        random_tensor=torch.full((3,), float(index)))


class NestedTensors(torch.utils.data.Dataset):
    """Sample i: a nested tensor of two components, the first i + 1 long."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, index: int):
        return torch.nested.nested_tensor([torch.arange(float(index + 1)), torch.zeros(2)])


def keep_samples(samples: list) -> list:
    """A collate_fn that keeps the samples as they are (nested tensors have no default collate)."""
    return samples
