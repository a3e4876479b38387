"""This process's connection to Ray, shared by the loaders that use it; ray imported only here, lazily.

``ray`` is an optional extra: nothing imports it until a loader with
``executor="ray"`` builds its executor.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any

import numpy as np

from ..errors import MissingDependencyError

log = logging.getLogger(__name__)

#: The install command named by the error when ray is missing.
INSTALL_HINT = 'pip install "cachestore[ray]"'


def import_ray() -> Any:
    """The ``ray`` module, or a :class:`~loader.errors.MissingDependencyError` naming the install command."""
    try:
        import ray
    except ModuleNotFoundError as exc:
        if exc.name != "ray":
            raise  # ray is there but broken: its own error says more
        raise MissingDependencyError(f"executor='ray' needs Ray, which is not installed: {INSTALL_HINT}") from None
    return ray


class RayConnection:
    """This process's connection to Ray, shared by the loaders that use it.

    Ray has one driver connection per process, so this is per process too (the
    module holds the one instance). A connection that existed before the first
    loader is borrowed and never closed; one the loaders opened - to a cluster,
    or to a Ray instance started for them - is closed by the last loader that
    uses it.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._users = 0  # loaders using a connection this class opened
        self._ours = False

    def acquire(self, ray: Any, address: str | None, init_options: dict[str, object], cpus_needed: float) -> bool:
        """Connect if needed; return whether the caller must :meth:`release` the connection."""
        with self._lock:
            if ray.is_initialized():
                if not self._ours:
                    if address is not None:
                        log.info("this process is already connected to Ray: executor_options['address'] %r is "
                                 "not used", address)
                    return False
                self._users += 1
                return True
            options = dict(init_options)
            if address is None:
                # A Ray just for this loader: on this machine only, no dashboard, and enough logical CPUs
                # that every actor can be placed here whatever the machine's core count.
                options.setdefault("_node_ip_address", "127.0.0.1")
                options.setdefault("include_dashboard", False)
                options.setdefault("num_cpus", max(os.cpu_count() or 1, int(np.ceil(cpus_needed))))
                ray.init(address="local", **options)
                log.info("started a local Ray instance for the loader")
            else:
                ray.init(address=address, **options)
            self._ours = True
            self._users += 1
            return True

    def release(self, ray: Any) -> None:
        """One loader less; the last one closes the connection (and a Ray instance it started)."""
        with self._lock:
            self._users = max(0, self._users - 1)
            if self._users == 0 and self._ours:
                self._ours = False
                if ray.is_initialized():
                    ray.shutdown()


CONNECTION = RayConnection()
