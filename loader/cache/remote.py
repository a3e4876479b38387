"""The cache's remote tier: generations published to an object store, fetched instead of computed.

Imported only when ``cache_setting["remote"]`` is given (the loader runs without the
``remote`` extra otherwise). One :class:`RemoteTier` per cache controller:

* **At start** the remote is opened with ``start_timeout``. Unreachable: one warning and the
  run computes locally (``remote_required=True``: the :class:`~cachestore.remote.RemoteError`
  instead); each later commit tries it again, so what was computed is published once it
  answers. Reachable: a committed local generation the remote lacks is published now (a
  publish a kill or a stopped server cut short is finished).
* **Fetch instead of compute**: a generation the local store lacks and the remote holds is
  downloaded (verified) and read; the dataset is not called. Where the local budget cannot
  hold it, its epochs read the remote directly (block order: one ranged read per run).
* **Publish**: after a local commit, in the background; :meth:`RemoteTier.close` (the
  loader's ``close()``) waits for it, showing progress.
* **Parts** (several nodes, ``docs/ARCHITECTURE.md``, "The remote tier"): node k computes part
  k of each new generation into the node's shared staging area; its first rank then publishes
  the part, places the other nodes' parts into the area as they arrive, and commits. A part
  nobody published within ``part_timeout`` is claimed (a conditional create: one node) and
  computed by whoever claims it. The node's other ranks wait for that commit.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Callable

import numpy as np

from cachestore import Store
from cachestore import GenerationInfo
from cachestore.errors import BudgetExceededError, CacheStoreError, CorruptSampleError, StoreLockedError
from cachestore.remote import RemoteError, RemoteManifestError, RemoteStore, open_remote, redact
from cachestore.remote.parts import part_range, published_parts
from cachestore.remote.publish import PublishHandle

from ..distributed import ConsumerLayout
from ..progress import Progress
from ..settings import CacheSettings

if TYPE_CHECKING:
    from .build import GenerationBuild

log = logging.getLogger(__name__)

#: Seconds between looks at the remote (or the node's staging area) while parts are awaited.
PART_POLL = 0.2
#: Seconds an unreachable remote is given when a later commit tries it again.
RETRY_TIMEOUT = 3.0


class RemoteTier:
    """The remote of one cache controller (see the module docstring)."""

    def __init__(self, settings: CacheSettings, store: Store, layout: ConsumerLayout,
                 remote: RemoteStore | None) -> None:
        self.settings = settings
        self.store = store
        self.remote = remote
        self.where = redact(str(settings.remote))
        self.nodes, self.node = (layout.nodes, layout.node) if layout.whole else (1, 0)
        self.leader = layout.local_rank == 0  # of the node's ranks (a store of its own: its one rank)
        self.handles: list[PublishHandle] = []
        self.direct: set[int] = set()  # generations read from the remote directly

    @classmethod
    def open(cls, settings: CacheSettings, store: Store, layout: ConsumerLayout) -> RemoteTier:
        """The tier of `store`, its remote reached within ``start_timeout`` (or not: see the module docstring).

        Raises
        ------
        RemoteError
            ``remote_required=True`` and the remote did not answer within ``start_timeout``.
        """
        tier = cls(settings, store, layout, None)
        try:
            tier.remote = tier._connect(settings.start_timeout)
        except RemoteError as exc:
            if settings.remote_required:
                raise RemoteError(f"the cache's remote {tier.where} did not answer within {settings.start_timeout:g} "
                                  f"s (remote_required=True): {exc}") from None
            log.warning("the cache's remote %s cannot be reached (%s): computing locally; what is committed is "
                        "published once it answers", tier.where, exc)
            return tier
        tier.catch_up()
        return tier

    def _connect(self, timeout: float) -> RemoteStore:
        return open_remote(str(self.settings.remote), self.settings.storage_options, local=self.store,
                           start_timeout=timeout)

    @property
    def online(self) -> bool:
        return self.remote is not None

    @property
    def parts(self) -> bool:
        """Whether new generations are computed in parts, one per node (several nodes and a remote)."""
        return self.nodes > 1 and self.remote is not None

    def _retry(self) -> bool:
        """Try an unreachable remote again (briefly); whether it is reachable now."""
        if self.remote is None:
            try:
                self.remote = self._connect(RETRY_TIMEOUT)
                log.info("the cache's remote %s answers now", self.where)
            except RemoteError:
                return False
        return True

    # reading ---------------------------------------------------------------------
    def latest(self) -> int | None:
        """The newest complete generation on the remote (``None``: none, or unreachable)."""
        if self.remote is None:
            return None
        try:
            return self.remote.latest()
        except RemoteError as exc:
            log.warning("listing %s failed (%s): computing locally", self.where, exc)
            return None

    def published_length(self) -> int:
        """Samples in the newest complete generation on the remote (0: none, or unreachable)."""
        newest = self.latest()
        if newest is None or self.remote is None:
            return 0
        try:
            return self.remote.manifest(newest).num_samples
        except (RemoteError, CacheStoreError) as exc:
            log.warning("reading generation %d's manifest on %s failed (%s)", newest, self.where, exc)
            return 0

    def info(self, generation: int) -> GenerationInfo:
        """What the remote says of published `generation` (for reading it directly)."""
        assert self.remote is not None
        m = self.remote.manifest(generation)
        return GenerationInfo(id=generation, num_samples=m.num_samples, nbytes=m.nbytes, committed=True,
                              created=m.created, stored_bytes=m.nbytes)

    def fetch(self, generation: int) -> str | None:
        """Get `generation` from the remote instead of computing it: ``"fetched"`` (now committed locally),
        ``"direct"`` (too large for the local budget: its epochs read the remote), ``None`` (not there)."""
        if self.remote is None or generation not in self.remote.generation_ids():
            return None
        t0 = time.perf_counter()
        try:
            info = self.remote.fetch(self.store, generation)
        except BudgetExceededError as exc:
            log.info("generation %d of %s does not fit the local budget (%s): its epochs read it from the remote",
                     generation, self.where, exc)
            self.direct.add(generation)
            return "direct"
        except StoreLockedError:
            return "fetched" if self._committed_by_another(generation) else None
        except RemoteError as exc:
            log.warning("fetching generation %d from %s failed (%s): computing it", generation, self.where, exc)
            return None
        log.info("fetched generation %d (%d samples, %d bytes) from %s in %.1f s", generation, info.num_samples,
                 info.nbytes, self.where, time.perf_counter() - t0)
        return "fetched"

    def _committed_by_another(self, generation: int) -> bool:
        """Another process (a rank of this node) holds the store's writer: wait for it to commit `generation`."""
        deadline = time.monotonic() + self.settings.part_timeout
        while time.monotonic() < deadline:
            if any(g.id == generation and g.committed for g in self.store.generations()):
                return True
            if self.store.lock_holder() is None:
                return False
            time.sleep(PART_POLL)
        return False

    # publishing --------------------------------------------------------------------
    def publish(self, generation: int) -> None:
        """Publish committed `generation` in the background (tried again later when the remote is away): the
        process that committed it does, whichever rank of the node it is."""
        if not self._retry():
            return
        assert self.remote is not None
        if any(h.done() for h in self.handles):
            self.handles = [h for h in self.handles if not h.done()]
            self.prune()  # an earlier publish is out: older generations may go
        self.handles.append(self.remote.publish(self.store, generation))

    def prune(self) -> None:
        """Keep on the remote as many generations as the local store keeps (the newest), never one a node
        still reads (its lease): after a publish, or a generation completed from parts."""
        if self.remote is None:
            return
        try:
            removed = [r.generation for r in self.remote.prune(keep=1) if r.kind == "generation"]
        except (CacheStoreError, OSError) as exc:
            log.info("pruning %s failed (%s): the next publish tries again", self.where, exc)
            return
        if removed:
            log.info("removed generation(s) %s from %s (newer ones are published)", removed, self.where)

    def catch_up(self) -> None:
        """Publish the newest committed local generation when the remote lacks it (a run that computed
        while the remote was away, or whose publish was cut short)."""
        newest = self.store.latest()
        if newest is None or not self.leader or self.remote is None:
            return
        try:
            there = newest in self.remote.generation_ids()
        except RemoteError:
            return
        if not there:
            log.info("generation %d of %s is not on %s yet: publishing it", newest, self.store.path, self.where)
            self.publish(newest)  # the node's first rank only (catch_up checks): one publish per node

    def close(self, progress: bool | None = None) -> None:
        """Wait for the publishes still running, showing progress; one that fails is said, not raised
        (the next run, or ``cachestore push``, finishes it)."""
        handles, self.handles = [h for h in self.handles if h.thread is not None], []
        if any(not h.done() for h in handles):
            log.info("waiting for %d publish(es) to %s", sum(not h.done() for h in handles), self.where)
        published = False
        for handle in handles:
            bar = Progress(handle.total_bytes, f"publishing to {self.where}", enabled=progress, delay=1.0)
            try:
                while not handle.done():
                    try:
                        handle.wait(0.5)
                    except TimeoutError:
                        pass
                    bar.update(handle.done_bytes - bar.done)
                handle.wait(0)
                published = True
            except (CacheStoreError, OSError) as exc:
                log.warning("%s was not published (%s); the next run, or `cachestore push %s %s`, publishes it",
                            handle.what, exc, self.store.path, self.where)
            finally:
                bar.close()
        if published:
            self.prune()
        if self.remote is not None:
            self.remote.close()

    # parts -------------------------------------------------------------------------
    def claim_own(self, generation: int) -> None:
        """Say on the remote that this node computes its part of `generation` (its first rank does)."""
        if self.parts and self.leader:
            assert self.remote is not None
            try:
                self.remote.claim_part(generation, self.node, self.nodes)
            except RemoteError as exc:
                log.warning("claiming part %d of generation %d on %s failed: %s", self.node, generation, self.where,
                            exc)

    def own_part(self, num_samples: int) -> tuple[int, int]:
        """The positions ``(start, stop)`` this node computes of a new generation (all of them alone)."""
        return part_range(num_samples, self.node, self.nodes) if self.parts else (0, num_samples)

    def exchange(self, build: "GenerationBuild", compute: Callable[[np.ndarray], None]) -> None:
        """After this node computed its part into `build`'s area: publish it, place the others' parts
        there (computing those nobody publishes within ``part_timeout``), so the area is complete."""
        if not self.parts or not self.leader:
            return
        try:
            self._exchange(build, compute)
        except (RemoteError, RemoteManifestError, CorruptSampleError) as exc:
            # The remote went away, or holds a damaged part: this node computes what the area lacks, as
            # without a remote.
            n = len(build.have)
            missing = np.setdiff1d(np.arange(n, dtype=np.int64), build.writer.present()) if build.shared else \
                np.zeros(0, np.int64)
            log.warning("exchanging parts of generation %d through %s failed (%s): computing the %d samples this "
                        "node lacks", build.generation, self.where, exc, len(missing))
            if len(missing):
                compute(missing.astype(np.int64))

    def _exchange(self, build: "GenerationBuild", compute: Callable[[np.ndarray], None]) -> None:
        assert self.remote is not None
        g, n, area = build.generation, len(build.have), Path(build.writer.token.path)
        start, stop = part_range(n, self.node, self.nodes)
        timeout = self.settings.part_timeout
        _wait_done(build, start, stop, timeout)
        self.remote.publish_part(self.store, str(area), g, n, self.node, self.nodes)
        pending = set(range(self.nodes)) - {self.node}
        deadline = time.monotonic() + timeout
        while pending:
            found = sorted(published_parts(self.remote, g, self.nodes, sorted(pending)))
            if found:
                self.remote.fetch_parts(self.store, g, self.nodes, into=str(area), parts=found)
                pending -= set(found)
                continue
            if time.monotonic() > deadline:
                for part in sorted(pending):
                    if self.remote.claim_part(g, part, self.nodes, timeout=timeout) is None:
                        continue  # published meanwhile, or claimed by a node still in time
                    lo, hi = part_range(n, part, self.nodes)
                    log.warning("part %d of generation %d was not published within part_timeout=%g s: this node "
                                "computes it", part, g, timeout)
                    compute(np.arange(lo, hi, dtype=np.int64))
                    _wait_done(build, lo, hi, timeout)
                    self.remote.publish_part(self.store, str(area), g, n, part, self.nodes)
                    pending.discard(part)
            time.sleep(PART_POLL)  # other machines: no event to wait on

    def wait_committed(self, generation: int) -> None:
        """A rank of the node other than its first: wait until the first commits `generation`
        (assembled from every node's part), within twice ``part_timeout``."""
        if not self.parts or self.leader:
            return
        deadline = time.monotonic() + 2 * self.settings.part_timeout + 60
        while not any(g.id == generation and g.committed for g in self.store.generations()):
            if time.monotonic() > deadline:
                raise CacheStoreError(f"generation {generation} of {self.store.path} was not committed by the "
                                      "node's first rank in time (its parts come from the other nodes)")
            time.sleep(PART_POLL)


def published_length(settings: CacheSettings, fingerprint: dict[str, object]) -> int:
    """Samples in the newest generation ``cache_setting["remote"]`` holds for `fingerprint` (a stream's
    length before its loader started: 0 when there is none, or the remote cannot be reached)."""
    try:
        remote = open_remote(str(settings.remote), settings.storage_options, fingerprint=fingerprint,
                             backend=settings.backend, start_timeout=settings.start_timeout)
    except (RemoteError, CacheStoreError):
        return 0  # said once, by the tier the loader opens next (or raised there: remote_required)
    try:
        newest = remote.latest()
        return 0 if newest is None else remote.manifest(newest).num_samples
    except (RemoteError, CacheStoreError):
        return 0
    finally:
        remote.close()


def _wait_done(build: "GenerationBuild", start: int, stop: int, timeout: float) -> None:
    """Wait until samples ``start..stop-1`` are written into `build`'s staging area (by any of the node's
    ranks), within `timeout` seconds."""
    if not build.shared:
        return  # an area of one writer: its samples are in once the epoch's tasks are
    deadline = time.monotonic() + timeout
    while True:
        present = build.writer.present()
        if np.count_nonzero((present >= start) & (present < stop)) == stop - start:
            return
        if time.monotonic() > deadline:
            raise CacheStoreError(f"samples {start}..{stop - 1} of {build.writer.token.path} were not written "
                                  f"within {timeout:g} s")
        time.sleep(PART_POLL)
