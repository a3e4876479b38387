"""Reader leases: a process that reads a published generation says so, and prune keeps it.

A lease is a small object ``<store>/readers/<generation>/<host>-<pid>-<hex>``, written when a
reader (a fetch, a direct reader) opens the generation, written again when it is older
than a third of :data:`LEASE_SECONDS`, and removed when it closes. ``prune`` keeps every
generation with a lease younger than :data:`LEASE_SECONDS` (by the server's clock of its
last write): a reader that died stops renewing its lease, which then runs out.
"""

from __future__ import annotations

import json
import os
import secrets
import socket
import threading
import time
from typing import TYPE_CHECKING

from . import layout
from .errors import RemoteError

if TYPE_CHECKING:
    from .base import RemoteBase

LEASE_SECONDS = 15 * 60.0


class ReaderLease:
    """This process's lease on one generation (see the module docstring)."""

    def __init__(self, remote: "RemoteBase", generation: int) -> None:
        self.remote = remote
        self.generation = generation
        name = f"{socket.gethostname()[:32]}-{os.getpid()}-{secrets.token_hex(4)}"
        name = "".join(c if c.isalnum() or c in "-_." else "_" for c in name)
        self.key = f"{layout.readers_prefix(remote.key, generation)}/{name}"
        self._written = 0.0
        self._lock = threading.Lock()
        self.renew(force=True)

    def renew(self, force: bool = False) -> None:
        """Write the lease again when a third of its time has passed (cheap to call on every read)."""
        now = time.monotonic()
        if not force and now - self._written < LEASE_SECONDS / 3:
            return
        with self._lock:
            if not force and now - self._written < LEASE_SECONDS / 3:
                return
            self._written = now
        body = json.dumps({"pid": os.getpid(), "host": socket.gethostname()[:64], "time": time.time()}).encode()
        try:
            self.remote.client.put(self.key, body)
        except RemoteError:
            pass  # a lease is a courtesy to prune: reading goes on without it

    def release(self) -> None:
        try:
            self.remote.client.delete([self.key])
        except RemoteError:
            pass  # it runs out by itself

    def __enter__(self) -> "ReaderLease":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def leased_generations(remote: "RemoteBase", now: float | None = None) -> set[int]:
    """Generations with a lease younger than :data:`LEASE_SECONDS`."""
    now = time.time() if now is None else now
    out = set()
    for info in remote.client.list_objects(layout.readers_prefix(remote.key)):
        parts = info.key.split("/")
        if len(parts) >= 2 and parts[-2].isdigit() and now - info.modified < LEASE_SECONDS:
            out.add(int(parts[-2]))
    return out
