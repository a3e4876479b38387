"""Checks of what the loader hands to its worker processes, run before any worker starts.

Workers start with ``spawn``: they are fresh interpreters that receive the
dataset class (and ``collate_fn``) by pickle, i.e. by module and qualified
name, and import it. Some classes cannot be found that way. Without these
checks the failure shows up late and says the wrong thing: a worker dies at
start-up and the hint is "put that code under ``if __name__ == '__main__'``"
(which does not help when the code already is), or ``Process.start`` raises a
raw ``PicklingError``.
"""

from __future__ import annotations

import inspect
import multiprocessing.process as mp_process
import os
import sys
from typing import Any

from .errors import NotImportableError

#: Start methods whose children get their arguments by pickle (``fork`` copies the parent instead).
PICKLING_START_METHODS = ("spawn", "forkserver")

def check_importable_by_workers(dataset_class: Any, *, nb_worker: int, use_threading: bool = False,
                                start_method: str = "spawn", collate_fn: Any = None) -> None:
    """Raise when worker processes could not import `dataset_class` or `collate_fn`.

    Call it from the loader's constructor, before any worker starts. Nothing
    is checked when no process receives them by pickle: ``nb_worker=0``,
    threads, or the ``fork`` start method.

    Parameters
    ----------
    dataset_class
        The loader's dataset class.
    nb_worker
        Number of worker processes.
    use_threading
        Workers are threads (they share the class object: nothing to import).
    start_method
        The workers' multiprocessing start method.
    collate_fn
        The loader's collate function, checked the same way when given.

    Raises
    ------
    NotImportableError
        Saying what is wrong (defined in ``python -c``, stdin, an interactive
        session, or inside a function) and what to do.
    """
    if nb_worker <= 0 or use_threading or start_method not in PICKLING_START_METHODS:
        return
    _check(dataset_class, "dataset class", "dataset_class")
    if collate_fn is not None:
        _check(collate_fn, "collate function", "collate_fn")


def _check(obj: Any, what: str, argument: str) -> None:
    module = getattr(obj, "__module__", None)
    qualname = getattr(obj, "__qualname__", None)
    if module is None or qualname is None:
        return  # an instance (a callable object): pickled by value, nothing to import by name
    name = f"{module}.{qualname}"
    fix = ("Move it into an importable module (a .py file on the path, e.g. datasets.py) and import it "
           "from there, or pass nb_worker=0 to compute in this process")
    if "<locals>" in qualname:
        raise NotImportableError(
            f"{what} {name} is defined inside a function: worker processes start with spawn and import "
            f"the {argument} by its module and name, which cannot reach a class or function local to "
            f"another function. {fix} (or define it at the top level of its module)."
        )
    if module == "__main__":
        if not _main_importable():
            raise NotImportableError(
                f"{what} {qualname} is defined in __main__ without a file (python -c, a script read from "
                "stdin, or an interactive session): worker processes start with spawn and re-import the "
                f"main module from its file to find the {argument}, and there is none. {fix}."
            )
    if not (inspect.isclass(obj) or inspect.isfunction(obj)):
        return  # a bound method or builtin pickles through its owner, not by its own name
    target: Any = sys.modules.get(module)
    for part in qualname.split("."):
        target = getattr(target, part, None)
    if target is not obj:
        raise NotImportableError(
            f"{what} {name} cannot be found under that name in module {module} (created dynamically, "
            f"or replaced after it was defined): worker processes import the {argument} by that name. "
            f"{fix}."
        )


def _main_importable() -> bool:
    """Whether a spawned child can re-create ``__main__`` (as ``multiprocessing.spawn`` does it).

    By module name when run with ``-m``, else from ``__file__`` - which must be
    a real file: a script read from stdin has ``__file__ == '<stdin>'``.
    """
    main = sys.modules.get("__main__")
    if getattr(getattr(main, "__spec__", None), "name", None) is not None:
        return True
    path = getattr(main, "__file__", None)
    if path is None:
        return False
    original_dir = getattr(mp_process, "ORIGINAL_DIR", None)  # where multiprocessing.spawn looks
    if not os.path.isabs(path) and original_dir is not None:
        path = os.path.join(original_dir, path)
    return os.path.isfile(path)
