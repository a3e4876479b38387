"""How worker processes start: the default start method, and what a starting worker must not run.

The default (``start_method="auto"``) forks a pool's first workers when nothing
unsafe has started in the training process yet (:func:`fork_is_safe`), as
torch's ``DataLoader`` forks its workers: a forked worker imports nothing
(numpy, torch and the dataset's module are there already) and shares the
training process's pages. A spawned worker imported them all again, about
0.3 s of CPU each without torch and 1.5 s more with it, on the first epoch's
clock. Every other start - a pool's first workers when threads run in the
training process or CUDA is initialised, a dead worker's replacement - is a
spawn: a fresh interpreter that inherits nothing of the training process;
except where a spawn would run the training script again (a script file
without an ``if __name__ == "__main__":`` guard, which torch users on Linux
seldom write: torch always forks): a spawned worker would fail there, or
train, so the worker forks, as torch's would (:func:`spawn_runs_the_script`).

Another loader's slots mapped here do not prevent a fork (a training script
iterates a validation loader while its training loader lives): the forked
workers keep those slots' pages while they live, as torch's keep the training
process's shared tensors. The copy of a loader a forked worker holds never
releases anything (:meth:`loader.resources.Resources.release` acts in its own
process only).

``"fork"``, ``"spawn"`` and ``"forkserver"`` (or their ``multiprocessing``
contexts) are honoured as given. A forkserver imports this package's worker,
the dataset's module and what the training script imported once
(:func:`forkserver_context`), then forks every worker from that clean server;
the server is ``multiprocessing``'s, one per process, and lives as long as the
training process. No global ``multiprocessing.set_start_method``: the contexts
are local.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import multiprocessing as mp
import multiprocessing.context
import multiprocessing.process
import os
import sys
import threading
import types
from typing import Iterator


#: Modules the forkserver imports once, before it forks workers (with the dataset's and ``__main__``).
WORKER_MODULE = "loader.executors.process.worker"


def fork_is_safe() -> tuple[bool, str]:
    """Whether this process can fork a worker now, and if not why.

    Unsafe: a thread other than this (main) one, whose locks a child would
    inherit held; CUDA initialised (a forked child cannot use it); Ray
    initialised (its native threads hold locks too); a system other than
    Linux. The store's locks are released with ``LOCK_UN``, so a descriptor a
    worker inherited never keeps one held.
    """
    if not sys.platform.startswith("linux"):
        return False, "not Linux"
    if threading.current_thread() is not threading.main_thread() or threading.active_count() > 1:
        return False, f"{threading.active_count()} threads run in the training process"
    torch_cuda = sys.modules.get("torch.cuda")
    if torch_cuda is not None and torch_cuda.is_initialized():
        return False, "CUDA is initialised in the training process"
    ray = sys.modules.get("ray")
    if ray is not None and getattr(ray, "is_initialized", lambda: False)():
        return False, "Ray is initialised in the training process (its threads)"
    return True, ""


def spawn_runs_the_script() -> bool:
    """Whether a spawned worker would run the training script's code again: the main module is a
    file whose source never names ``"__main__"`` (no guard). ``python -c``, notebooks and
    interactive sessions have no such file."""
    path = getattr(sys.modules.get("__main__"), "__file__", None)
    if not isinstance(path, str) or not path.endswith(".py"):
        return False
    return not _names_main(os.path.abspath(path))


@functools.lru_cache(maxsize=16)
def _names_main(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            return b"__main__" in f.read()
    except OSError:
        return True  # unreadable: nothing says it runs again


def forks(first: bool) -> bool:
    """Whether ``start_method="auto"`` forks this worker: one of a pool's `first` workers while forking
    is safe (:func:`fork_is_safe`), any worker where a spawn would run the script again
    (:func:`spawn_runs_the_script`); else it is spawned."""
    if not sys.platform.startswith("linux"):
        return False
    return (first and fork_is_safe()[0]) or spawn_runs_the_script()


def forkserver_context(dataset_module: str | None) -> multiprocessing.context.BaseContext:
    """The forkserver context, its server told to import once the worker, `dataset_module` and what the
    training script imported (only before it starts: a running server keeps what it imported).

    Each worker forked from the server still runs a training script given by path again, as
    ``__mp_main__`` (as under spawn): with its imports done in the server, that costs little.
    """
    ctx = mp.get_context("forkserver")
    preload = [WORKER_MODULE, *([dataset_module] if dataset_module else []), *_imported_by_main()]
    ctx.set_forkserver_preload([m for m in dict.fromkeys(preload) if m != "__main__"])
    return ctx


def _imported_by_main() -> list[str]:
    """The modules the main module imported (``import torch``, ``from x import y``), that are loaded here."""
    main = sys.modules.get("__main__")
    names = []
    for value in list(vars(main).values()) if main is not None else []:
        try:
            name = value.__name__ if isinstance(value, types.ModuleType) else getattr(value, "__module__", None)
        except Exception:  # a lazy proxy that fails when looked at: not worth preloading
            continue
        if isinstance(name, str) and name in sys.modules:
            names.append(name)
    return names


def method_for(method: str, dataset: object) -> str:
    """The start method of `dataset`'s workers: ``"auto"`` spawns them where the dataset says a forked
    process cannot read it (``survives_fork`` false: a remote store's reader whose client ran here), else
    `method` as given."""
    return "spawn" if method == "auto" and getattr(dataset, "survives_fork", True) is False else method


def context_for(method: str, first: bool, dataset_module: str | None) -> multiprocessing.context.BaseContext:
    """The context a worker starts with: `method` as given, or for ``"auto"`` fork or spawn (:func:`forks`)."""
    if method == "forkserver":
        return forkserver_context(dataset_module)
    if method != "auto":
        return mp.get_context(method)
    return mp.get_context("fork" if forks(first) else "spawn")


def start(proc: multiprocessing.process.BaseProcess, method: str) -> None:
    """Start worker process `proc` (of a `method` context).

    A fork freezes this process's objects for the child's garbage collector
    (``gc.freeze``, undone here right after): a collection in the child would
    otherwise write into the header of every object the training process holds
    and copy each page they lie in, and forked workers would end up holding a
    copy of the training process's heap.
    """
    if method != "fork":
        with main_file_hidden():
            proc.start()
        return
    gc.freeze()
    try:
        proc.start()
    finally:
        gc.unfreeze()


_MAIN_LOCK = threading.Lock()


@contextlib.contextmanager
def main_file_hidden() -> Iterator[None]:
    """While a worker starts, hide a main module's ``__file__`` that names no file (``<stdin>``).

    A spawned child (and the forkserver) runs the parent's main module again
    from its file, to find what was pickled by name there; a script piped to
    ``python -`` has the "file" ``<stdin>``, and every worker died trying to
    open it. Workers need nothing from the main module (what it defined reaches
    them by value, see :mod:`loader.executors.transport`), so that module is
    simply not run again.
    """
    main = sys.modules.get("__main__")
    path = getattr(main, "__file__", None)
    spec_name = getattr(getattr(main, "__spec__", None), "name", None)
    if main is None or path is None or spec_name is not None or os.path.isfile(
            os.path.join(getattr(multiprocessing.process, "ORIGINAL_DIR", None) or "", path)):
        yield
        return
    with _MAIN_LOCK:
        del main.__file__
        try:
            yield
        finally:
            main.__file__ = path
