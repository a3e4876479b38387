"""torch's ``get_worker_info()`` inside the loader's workers: processes, threads and Ray actors.

Code written for torch's ``DataLoader`` asks ``torch.utils.data.get_worker_info()``
in ``worker_init_fn`` or ``__getitem__`` (``info.dataset.handle = open(...)``,
a shard per ``info.id``): it must answer there with torch's own ``WorkerInfo``
(``id``, ``num_workers``, ``seed``, ``dataset``) and ``None`` in the training
process. torch keeps it in a module global, set once per worker process; so
does this module for a worker process or actor.

Two differences from torch's workers:

- A worker builds its dataset at its first use (a worker that only reads the
  store never builds it, see :mod:`loader.executors.process.worker`): the
  ``dataset`` of the info is that worker's dataset, built when first looked at.
- Worker threads share the process, hence torch's global: the first thread
  worker makes ``get_worker_info`` read a thread-local first (its code object
  is replaced, so every reference to the function, ``from torch.utils.data
  import get_worker_info`` included, answers per thread; in a thread with no
  info it returns torch's global as before).

torch is never imported here: the info is installed once torch is in the
process (imported by the dataset's module, ``worker_init_fn``, or the
training script a worker was forked from); :meth:`WorkerIdentity.install`
is called again at each of those points and does nothing once done.
"""

from __future__ import annotations

import sys
import threading
from typing import Any, Callable

#: The name, in torch's worker module, of the thread-local that thread workers' infos live in.
_THREAD_SLOT = "_cachestore_thread_worker_info"
_PATCH_LOCK = threading.Lock()


def _thread_aware_get_worker_info() -> Any:
    """Replacement code of torch's ``get_worker_info``: a worker thread's info, else torch's global."""
    local = globals().get("_cachestore_thread_worker_info")
    info = getattr(local, "info", None) if local is not None else None
    return info if info is not None else globals()["_worker_info"]


def _lazy_info_class(base: type) -> type:
    """A subclass of torch's ``WorkerInfo`` whose ``dataset`` is built when first read."""

    class LazyWorkerInfo(base):  # type: ignore[misc]
        __slots__ = ("_dataset_of",)

        def __getattribute__(self, name: str) -> Any:
            if name == "dataset":
                return object.__getattribute__(self, "_dataset_of")()
            return object.__getattribute__(self, name)

        def __repr__(self) -> str:
            return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, seed={self.seed}, "
                    f"dataset={object.__getattribute__(self, '_dataset_of')!r})")

    LazyWorkerInfo.__qualname__ = LazyWorkerInfo.__name__ = "WorkerInfo"
    return LazyWorkerInfo


_LAZY_CLASSES: dict[type, type] = {}


class WorkerIdentity:
    """One worker's answer to ``get_worker_info()``, installed once torch is in the process.

    Parameters
    ----------
    worker_id, num_workers, seed
        torch's fields (`seed`: the seed this worker's torch generator got).
    dataset
        Returns this worker's dataset (the copy its tasks run on), building it at the first call.
    thread
        The worker is a thread of the training process (its info is thread-local).
    """

    def __init__(self, worker_id: int, num_workers: int, seed: int, dataset: Callable[[], Any],
                 thread: bool) -> None:
        self.worker_id, self.num_workers, self.seed = worker_id, num_workers, seed
        self.dataset = dataset
        self.thread = thread
        self.installed = False

    def install(self) -> None:
        """Make ``get_worker_info()`` answer with this worker's info, if torch is imported (idempotent)."""
        if self.installed:
            return
        module = sys.modules.get("torch.utils.data._utils.worker")
        info_class = getattr(module, "WorkerInfo", None)
        if module is None or info_class is None:
            return  # not yet: called again once the dataset or worker_init_fn may have imported torch
        lazy = _LAZY_CLASSES.get(info_class)
        if lazy is None:
            lazy = _LAZY_CLASSES[info_class] = _lazy_info_class(info_class)
        info = lazy(id=self.worker_id, num_workers=self.num_workers, seed=self.seed, dataset=None)
        object.__setattr__(info, "_dataset_of", self.dataset)
        if self.thread:
            _thread_local(module).info = info
        else:
            module._worker_info = info  # type: ignore[attr-defined]
        self.installed = True

    def uninstall(self) -> None:
        """A worker thread that ends: its thread-local info goes with it (a process's goes with the process)."""
        module = sys.modules.get("torch.utils.data._utils.worker")
        local = getattr(module, _THREAD_SLOT, None)
        if self.thread and local is not None:
            local.info = None
        self.installed = False


def _thread_local(module: Any) -> threading.local:
    """The thread-local of worker threads' infos in torch's worker `module`, patched in at the first call."""
    with _PATCH_LOCK:
        local = getattr(module, _THREAD_SLOT, None)
        if local is None:
            local = threading.local()
            setattr(module, _THREAD_SLOT, local)
            function = getattr(module, "get_worker_info", None)
            if function is not None and not function.__code__.co_freevars:
                # Its globals are torch's module's: the replacement reads the slot and _worker_info there.
                function.__code__ = _thread_aware_get_worker_info.__code__
        assert isinstance(local, threading.local)
        return local
