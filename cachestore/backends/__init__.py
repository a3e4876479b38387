"""Backend registry: name -> class, imported lazily.

``register_backend(name, cls_or_path)`` plugs in a third backend; a dotted
``"package.module:Class"`` path is imported on first use, so an optional
dependency is only needed by the stores that use it.
"""

from __future__ import annotations

import importlib
from typing import Union

from ..space.budget import Budget
from .base import Backend, GenerationInfo, ShardWriter
from .reading import GenerationData

_REGISTRY: dict[str, Union[str, type[Backend]]] = {
    "memmap": "cachestore.backends.memmap:MemmapBackend",
    "lmdb": "cachestore.backends.lmdb_backend:LmdbBackend",
    "memory": "cachestore.backends.memory:MemoryBackend",
}


def register_backend(name: str, backend: Union[str, type[Backend]]) -> None:
    """Make `backend` available as ``open_store(..., backend=name)``.

    The store and the loader judge it by its capability flags (:class:`Backend`), as the
    built-in ones. Each process has its own registry: register it in a module every process
    that opens the store imports (a loader's spawned workers import the dataset's module).

    Parameters
    ----------
    name
        The backend's name, as stored in the store metadata.
    backend
        A :class:`Backend` subclass, or ``"module:Class"`` to import lazily.
    """
    if not isinstance(name, str) or not name:
        raise ValueError("a backend name must be a non-empty string")
    if not isinstance(backend, str) and not (isinstance(backend, type) and issubclass(backend, Backend)):
        raise TypeError("register_backend expects a Backend subclass or a 'module:Class' string")
    _REGISTRY[name] = backend


def backend_origin(name: str) -> str | None:
    """Where the backend registered as `name` comes from, as ``"module:Class"``: what another process
    registers it by (:class:`cachestore.backends.spec.StoreSpec` carries it to workers). ``None`` for the
    built-in backends and unknown names."""
    entry = _REGISTRY.get(name)
    if entry is None or isinstance(entry, str) and entry.startswith("cachestore.backends."):
        return None
    if isinstance(entry, str):
        return entry
    if entry.__module__.startswith("cachestore.backends."):
        return None
    return f"{entry.__module__}:{entry.__qualname__}"


def available_backends() -> list[str]:
    """Names accepted by ``open_store(..., backend=...)``."""
    return sorted(_REGISTRY)


def get_backend(name: str, origin: str | None = None) -> type[Backend]:
    """The backend class registered as `name`; registered first from `origin` (``"module:Class"``,
    :func:`backend_origin` in the process that registered it) where this process has no `name`."""
    if origin is not None and name not in _REGISTRY:
        register_backend(name, origin)
    try:
        entry = _REGISTRY[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown backend {name!r}; available: {', '.join(available_backends())}") from None
    if isinstance(entry, str):
        module_name, _, attr = entry.partition(":")
        try:
            module = importlib.import_module(module_name)
        except ImportError as exc:
            raise ImportError(f"backend {name!r} needs {exc.name!r}, which is not installed "
                              f"(pip install {exc.name})") from exc
        entry = getattr(module, attr)
        _REGISTRY[name] = entry
    return entry


__all__ = ["Backend", "Budget", "GenerationData", "GenerationInfo", "ShardWriter",
           "register_backend", "available_backends", "backend_origin", "get_backend"]
