"""This process's connection to Ray, shared by the loaders that use it; ray imported only here, lazily.

``ray`` is an optional extra: nothing imports it until a loader with
``executor="ray"`` builds its executor.
"""

from __future__ import annotations

import logging
import os
import socket
import threading
from typing import Any

import numpy as np

from ..errors import ClusterUnreachableError, MissingDependencyError

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


#: Seconds a cluster named by ``executor_options['address']`` may take to answer (at most ``start_timeout``).
CONNECT_TIMEOUT = 30.0


def _check_reachable(address: str, timeout: float) -> None:
    """Fail fast on a cluster address that cannot answer: ``ray.init`` retries such an address for
    minutes, deaf to the loader's timeouts."""
    if address == "auto":
        return  # ray finds the cluster of this machine itself, or says at once that there is none
    where = address.removeprefix("ray://")
    host, sep, port = where.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"executor_options['address'] must be 'auto', 'HOST:PORT' or 'ray://HOST:PORT', "
                         f"got {address!r}")
    try:
        socket.create_connection((host.strip("[]"), int(port)), timeout=timeout).close()
    except OSError as exc:
        why = "that name does not resolve" if isinstance(exc, socket.gaierror) else (
            f"nothing answered within {timeout:g} s" if isinstance(exc, TimeoutError) else exc.strerror or str(exc))
        raise ClusterUnreachableError(
            f"the Ray cluster at executor_options['address']={address!r} cannot be reached ({why}). Start it "
            "(`ray start --head`), fix the address, or leave the address out to start a local Ray for the "
            "loader") from None


def _init_within(ray: Any, address: str, options: dict[str, object], timeout: float) -> None:
    """``ray.init(address)``, given up after `timeout` seconds (an address that accepts connections
    but is no Ray cluster would otherwise keep it waiting)."""
    failure: list[BaseException] = []

    def connect() -> None:
        try:
            ray.init(address=address, **options)
        except BaseException as exc:  # handed to the caller below
            failure.append(exc)

    thread = threading.Thread(target=connect, name="cachestore-ray-connect", daemon=True)
    thread.start()
    thread.join(timeout)
    if thread.is_alive():
        raise ClusterUnreachableError(f"Ray did not connect to executor_options['address']={address!r} within "
                                      f"{timeout:g} s: is a Ray cluster (its GCS port) listening there?")
    if failure:
        raise failure[0]


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

    def acquire(self, ray: Any, address: str | None, init_options: dict[str, object], cpus_needed: float,
                timeout: float = CONNECT_TIMEOUT) -> bool:
        """Connect if needed; return whether the caller must :meth:`release` the connection.

        Raises
        ------
        ClusterUnreachableError
            `address` names a cluster that does not answer within `timeout` seconds.
        """
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
                _check_reachable(address, timeout)
                _init_within(ray, address, options, timeout)
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
