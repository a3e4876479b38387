"""The cache controller: which generation each epoch uses, and the budget decisions around it.

Epoch plan (``docs/ARCHITECTURE.md``, "Epoch plan"): with
``update_frequency=K``, epoch ``e`` of this run uses generation
``base + e // K``, where ``base`` is the newest generation committed by an
earlier run with the same fingerprint (0 when there is none). A committed
generation is read; a missing one is generated and committed at the end of
its epoch. After a commit older generations are pruned (before writing, when
the budget has no room for two).
"""

from __future__ import annotations

import logging
import os
import sys
from typing import TYPE_CHECKING

from cachestore import GenerationInfo, Store, Writer
from cachestore.store import open_local as open_store
from cachestore.backends import get_backend
from cachestore.errors import (BudgetExceededError, CacheStoreError, CorruptSampleError,
                               FingerprintMismatchError, GenerationNotFoundError, NotAStoreError, StoreLockedError)
from cachestore.space.disk import format_size, read_only
from cachestore.space.room import fits, memory_room

from ..dataset import DatasetSource
from ..distributed import ConsumerLayout
from ..executors.base import Executor
from ..settings import BudgetPolicy, CacheSettings, EpochMode, MismatchPolicy
from .build import GenerationBuild, workers_can_write
from .fingerprint import class_path, dataset_fingerprint
from .mismatch import describe_mismatch, describe_params
from .read_order import ReadChoice, block_size, generation_order
from .view import Choice, StoreView

if TYPE_CHECKING:
    from .remote import RemoteTier

log = logging.getLogger(__name__)


class CacheController:
    """The store of one consumer and the decisions about its generations.

    Parameters
    ----------
    settings
        The parsed ``cache_setting``.
    store
        The consumer's open store (see :meth:`open`).
    num_samples
        Samples per generation (this consumer's part of the dataset).
    """

    def __init__(self, settings: CacheSettings, store: Store, num_samples: int) -> None:
        self.settings = settings
        self.store = store
        self.num_samples = num_samples
        latest = store.latest()
        self.base = latest if latest is not None else 0
        if latest is not None:
            log.info("reusing generation %d of %s", latest, store.path)
        self._sound: set[int] = set()  # generations opened once without damage
        self.damaged: dict[int, str] = {}  # generation -> why, for those found damaged and removed
        self.off = False  # caching gave up for this run (budget, policy "stream" or "rotate")
        self.refresh_off = False  # background refresh gave up for this run
        self.mine: set[int] = set()  # generations this run committed
        self.readonly = False  # the store is on a read-only file system: nothing is written
        self._choices: dict[int, ReadChoice] = {}  # how each generation's read epochs go
        self.remote: RemoteTier | None = None  # cache_setting["remote"] (loader.cache.remote)

    def disable(self) -> None:
        """Stop caching for the rest of this run (the budget ran out: policies ``"stream"``, ``"rotate"``)."""
        self.off = True

    def stop_refresh(self) -> None:
        """Stop background refreshes for the rest of this run: each generation is written during its epoch."""
        self.refresh_off = True

    def snapshot(self) -> dict:
        """The plan's state, as plain values (see :mod:`loader.state`)."""
        return {"base": self.base, "off": self.off, "refresh_off": self.refresh_off}

    def restore(self, snapshot: dict) -> None:
        """Continue the plan of the run `snapshot` was taken from."""
        self.base = int(snapshot["base"])
        self.off = bool(snapshot["off"])
        self.refresh_off = bool(snapshot["refresh_off"])

    @classmethod
    def open(cls, settings: CacheSettings, layout: ConsumerLayout, dataset: DatasetSource,
             batch_size: int) -> "CacheController":
        """Open (or create) this consumer's store, checking it was produced by this dataset."""
        fingerprint = dataset_fingerprint(dataset, layout.num_samples, layout.store_owner, settings.fingerprint)
        producer = {"dataset": class_path(dataset.dataset_class), "params": describe_params(dataset.params),
                    "update_frequency": settings.k_or_none, "batch_size": batch_size,
                    "consumer": list(layout.store_owner)}
        path = layout.store_path(settings.prefix)

        def open_it(fingerprint: dict | None) -> Store:
            return open_store(path, settings.backend, compression=settings.compression,
                              disk_budget=settings.disk_budget, allow_pickle=settings.allow_pickle,
                              fingerprint=fingerprint, producer=producer, verify=settings.verify,
                              trusted_uids=settings.trusted_uids, trusted_gids=settings.trusted_gids,
                              max_sample_bytes=settings.max_sample_bytes)

        if get_backend(settings.backend).persistent and read_only(path):
            return cls.open_read_only(settings, path, fingerprint, layout.per_store)
        try:
            store = open_it(fingerprint)
        except FingerprintMismatchError:
            with open_store(path, readonly=True) as old:
                what = describe_mismatch(old.fingerprint, fingerprint)
            if settings.on_mismatch is MismatchPolicy.ERROR:
                raise FingerprintMismatchError(
                    f"{path} holds samples of another dataset: {what}. Either give this dataset its own "
                    "prefix, or let it replace the old samples with cache_setting={..., 'on_mismatch': "
                    f"'regenerate'}} (or run `cachestore prune {path} --keep 0` once). If it is the same data "
                    "under another description, name it with cache_setting={..., 'fingerprint': '...'}") from None
            with open_it(None) as old:  # no fingerprint given: no check, nothing rewritten
                removed = [r for r in old.prune(keep=0) if r.generation is not None]
            log.warning("%s held samples of another dataset (%s): removed %d old generation(s); writing new "
                        "ones (on_mismatch='regenerate')", path, what, len(removed))
            store = open_it(fingerprint)
        # A run that only reads must not leave a killed writer's debris (a stale lock, staging of
        # another dataset, dead rotation windows) for ever: sweep it now. Generations and this
        # dataset's partial generations stay; a live writer's things are never touched.
        damaged = {g.id: g.damaged for g in store.generations() if g.damaged}
        swept = {r.generation for r in store.prune(keep=sys.maxsize) if r.kind == "damaged"}
        controller = cls(settings, store, layout.per_store)
        if settings.remote is not None:
            controller.open_remote(layout)
        for generation in sorted(g for g in swept & set(damaged) if g is not None):
            log.warning("generation %d of %s was damaged (%s): removed; it is written again when an epoch "
                        "needs it", generation, store.path, damaged[generation])
            controller.damaged[generation] = damaged[generation]
        return controller

    def open_remote(self, layout: ConsumerLayout) -> None:
        """Reach ``cache_setting["remote"]`` (imported only then); start from its newest generation when
        it is newer than this store's (fetched when an epoch needs it)."""
        from .remote import RemoteTier

        self.remote = RemoteTier.open(self.settings, self.store, layout)
        newest = self.remote.latest()
        if newest is not None and newest > (self.store.latest() or 0):
            self.base = newest

    @classmethod
    def open_read_only(cls, settings: CacheSettings, path: str, fingerprint: dict[str, object],
                       num_samples: int) -> CacheController:
        """The store at `path`, on a read-only file system: its committed generations are served, nothing
        is written (no sweep, no refresh, no new generation)."""
        try:
            store = open_store(path, readonly=True, fingerprint=fingerprint, verify=settings.verify,
                               trusted_uids=settings.trusted_uids, trusted_gids=settings.trusted_gids,
                               max_sample_bytes=settings.max_sample_bytes)
        except NotAStoreError:
            raise NotAStoreError(f"{path} is on a read-only file system and holds no cache: there is nothing to "
                                 "read and no room to write one. Give cache_setting['prefix'] a writable "
                                 "directory") from None
        log.info("%s is on a read-only file system: serving its committed generations, nothing is written", path)
        controller = cls(settings, store, num_samples)
        controller.readonly = True
        controller.stop_refresh()
        return controller

    # the plan ------------------------------------------------------------
    def generation_for(self, epoch: int) -> int:
        """The generation epoch `epoch` of this run uses."""
        return self.base + self.settings.generation_offset(epoch)

    def committed(self) -> dict[int, GenerationInfo]:
        """Committed generations by id."""
        return {g.id: g for g in self.store.generations() if g.committed}

    def look(self) -> StoreView:
        """The store as it is now: the one read of it an epoch's plan is decided from (see
        :mod:`loader.cache.view`). A file system remounted read-only is noticed here."""
        infos = self.store.generations()
        damaged = {g.id: g.damaged for g in infos if g.damaged and not g.committed}
        return StoreView({g.id: g for g in infos if g.committed}, {**self.damaged, **damaged},
                         self.readonly or self.went_read_only(), self.store.lock_holder())

    def decide(self, epoch: int, view: StoreView) -> Choice:
        """The generation epoch `epoch` uses, whether it is read or generated, and notes for its stats:
        decided from `view` alone (no I/O; :meth:`take` applies it).

        A committed generation that cannot be opened (damaged) is written
        again. When another run on the same prefix committed a newer
        generation, this run moves on to it rather than writing an old one again.
        An epoch before those this run has served (``set_epoch`` going back)
        whose generation this run replaced reads the generation that replaced
        it: no past generation is written again, and the run's later epochs
        keep their generations.
        """
        generation, base = self.generation_for(epoch), self.base
        got = view.fetched.get(generation)
        if got == "direct":
            return Choice(generation, EpochMode.READ, {"direct": generation}, base)
        committed = view.committed
        if generation in committed:
            problem = view.unreadable.get(generation)
            if problem is not None:
                return Choice(generation, EpochMode.GENERATE, {"damaged": problem}, base)
            notes = {"fetched": generation} if got == "fetched" else {}
            # A fetch checked every chunk as it landed: not opened again.
            return Choice(generation, EpochMode.READ, notes, base, check=not notes and generation not in self._sound)
        newer = [g for g in committed if g > generation]
        if newer and set(newer) <= self.mine:
            return Choice(min(newer), EpochMode.READ, {"went_back_to": min(newer)}, base)
        if newer:
            return Choice(max(newer), EpochMode.READ, {"moved_to": max(newer)}, base + max(newer) - generation)
        if view.read_only:
            return self._read_only_choice(epoch, generation, view)
        damaged = view.damaged.get(generation)
        if damaged is not None:
            return Choice(generation, EpochMode.GENERATE, {"damaged": damaged}, base)
        return Choice(generation, EpochMode.GENERATE, {}, base, fetch=self.remote is not None and got is None)

    def take(self, choice: Choice) -> None:
        """Go on with `choice` (its base: another run's newer generation moves the plan on)."""
        self.base = choice.base

    def went_read_only(self) -> bool:
        """Whether the store's file system was remounted read-only (or made unwritable) during the run:
        from then on its committed generations are served and nothing is written, as for a run opened there."""
        if self.readonly or not self.store.backend.persistent or not read_only(self.store.path):
            return self.readonly
        log.warning("%s became read-only during the run: serving its committed generations, nothing more is "
                    "written", self.store.path)
        self.readonly = True
        self.stop_refresh()
        return True

    def _read_only_choice(self, epoch: int, generation: int, view: StoreView) -> Choice:
        """On a read-only file system an epoch reads the newest committed generation: none can be written."""
        newest = view.latest
        if newest is None:
            raise CacheStoreError(f"epoch {epoch} needs generation {generation} of {self.store.path}, which holds "
                                  "none committed, and its file system is read-only: nothing can be written there. "
                                  "Give cache_setting['prefix'] a writable directory")
        return Choice(newest, EpochMode.READ, {"read_only": newest}, self.base)

    def read_choice(self, generation: int, view: StoreView) -> ReadChoice:
        """How the read epochs of `generation` go: their order, and whether they read with explicit I/O.

        ``read_order="auto"``: random when the generation fits the memory room
        (:mod:`cachestore.space.room`), block otherwise, said in one log line per
        generation. A generation that does not fit is read with explicit I/O
        where the backend can (``supports_streaming``, fixed layout).
        """
        choice = self._choices.get(generation)
        if choice is not None:
            return choice
        info = view.committed.get(generation)
        if info is None and self.remote is not None and generation in self.remote.direct:
            info = self.remote.info(generation)
        nbytes = info.nbytes if info is not None else 0
        record = (info.stored_bytes or info.nbytes) // max(1, info.num_samples) if info is not None else 0
        fitting = not self.store.backend.persistent or fits(nbytes)
        kind = generation_order(self.settings.read_order, fitting)
        if self.settings.read_order == "auto":
            log.info("generation %d of %s (%s) %s the memory room (%s): read in %s order", generation,
                     self.store.path, format_size(nbytes), "fits" if fitting else "does not fit",
                     format_size(memory_room()), kind)
        stream = (not fitting and self.store.backend.supports_streaming and info is not None
                  and info.layout == "fixed")
        choice = self._choices[generation] = ReadChoice(kind, block_size(record), stream)
        return choice

    def unreadable(self, generation: int) -> str | None:
        """Why committed `generation` cannot be opened (damage found only on open), or ``None``: opens it
        once per run (the step a :class:`Choice` with ``check`` asks for before the epoch is planned)."""
        if generation in self._sound:
            return None
        try:
            with self.store.reader(generation) as reader:
                held = len(reader)
        except CorruptSampleError as exc:
            return str(exc)
        except GenerationNotFoundError:
            return None  # pruned meanwhile: the next look at the catalog says what to do
        if held != self.num_samples:
            # A store written by hand (no fingerprint, adopted by this dataset) for other data.
            raise CacheStoreError(f"generation {generation} of {self.store.path} holds {held} samples, and this "
                                  f"loader serves {self.num_samples} from it: it was written for other data. Give "
                                  "the loader its own prefix, or remove that store (`cachestore prune "
                                  f"{self.store.path} --keep 0`)")
        self._sound.add(generation)
        return None

    # writing ---------------------------------------------------------------
    def open_build(self, generation: int, use_threading: bool, background: bool = False,
                   executor: Executor | None = None) -> GenerationBuild:
        """Open `generation` for writing (by `executor`'s workers when they can write this store).

        For its own epoch, room is made first when the budget cannot hold two
        generations. In the `background` (a refresh) nothing is removed, and a
        budget overrun only stops the refresh (policy ``"stream"``).
        """
        store = self.store
        committed = list(self.committed().values())
        removed: list[int] = []
        if committed and not background:
            newest = committed[-1]
            estimate = newest.nbytes if store.backend.persistent else newest.stored_bytes
            budget = store.budget()
            if budget.available is not None and estimate > budget.available:
                removed = [r.generation for r in store.prune(keep=0) if r.generation is not None]
                log.info("budget has no room for two generations: removed %d old one(s) before writing %d",
                         len(removed), generation)
        in_workers = workers_can_write(store.backend, use_threading, executor)
        # resume: a partial generation an interrupted attempt kept is completed, not started over -
        # where the samples it holds can be served from it: by this process (no workers), or by
        # workers that open the store. Workers that send records (Ray, an in-RAM store) would compute
        # them again to serve them, and serve other values than the generation then holds.
        resume = executor is None or in_workers
        writer: Writer
        try:
            if self.shares(resume):
                # GenerationCommitted: another process committed it meanwhile (the caller reads it).
                writer = store.join(generation, self.num_samples)
            else:
                writer = store.writer(generation, num_samples=self.num_samples, resume=resume)
        except StoreLockedError as exc:
            raise StoreLockedError(f"{exc}. Another loader with the same cache prefix is writing it"
                                   f"{'' if self.settings.shared else ' (cache_setting shared=False)'}; "
                                   "give each run its own prefix or wait for it") from None
        policy = BudgetPolicy.STREAM if background else self.settings.policy
        build = GenerationBuild(writer, policy, in_workers)
        build.made_room = removed
        return build

    def shares(self, readable_staging: bool = True) -> bool:
        """Whether generations are written together with the other processes that write them (ranks of a
        node, concurrent jobs: :mod:`cachestore.write.shared`): ``cache_setting["shared"]``, a backend that can
        (memmap), and writers that read back what others wrote (`readable_staging`: not Ray's actors)."""
        return (self.settings.shared and self.store.backend.supports_shared_write and readable_staging
                and self.store.fingerprint is not None)

    def commit(self, build: GenerationBuild | Writer, epoch: int, background: bool = False, prune: bool = True,
               stream: bool = False) -> GenerationInfo | None:
        """Commit a finished generation, publish it to the remote, then prune older generations: the one
        commit of every generation the loader writes (a map-style build, a stream's writer, each in its own
        epoch or in the background). ``None`` when it is written together with other processes and is
        incomplete (they, or the next to join, finish it) or another commits it.

        Parameters
        ----------
        build
            The generation's build, or a stream's writer (no sample count: the stream's end said it).
        epoch
            The epoch that wrote it (recorded with it).
        background, stream
            Recorded with it: written by a background refresh; from a stream.
        prune
            Prune older generations now (a stream's background refresh prunes when the epochs of the older
            one are over: ``loader.epochs.kinds.stream_refresh``).
        """
        extra: dict = {"epochs": [epoch], "update_frequency": self.settings.k_or_none}
        if background:
            extra["background"] = True
        if stream:
            extra["stream"] = True
        from_parts = isinstance(build, GenerationBuild) and build.from_parts
        info = self._commit_build(build, extra) if isinstance(build, GenerationBuild) else build.commit(extra=extra)
        if info is None:
            return None
        self.mine.add(info.id)
        if self.remote is not None and not from_parts:
            self.remote.publish(info.id)
        elif self.remote is not None:
            self.remote.prune()  # completed on the remote from its parts: older generations may go
        removed = self.store.prune(keep=1) if prune else []
        log.info("committed generation %d%s (%d samples, %d bytes%s); pruned %d old item(s)", info.id,
                 " of a stream" if stream else "", info.num_samples, info.nbytes,
                 ", computed in the background" if background else "", len(removed))
        return info

    def _commit_build(self, build: GenerationBuild, extra: dict) -> GenerationInfo | None:
        """`build` committed, or ``None`` where the processes writing it together commit it (said why)."""
        complete = build.shared and build.complete()  # before leaving: the area may go with the commit
        info = build.commit(extra)
        if (info is None and build.shared and not os.path.lexists(build.writer.token.path)
                and build.generation not in self.committed()):
            log.warning("the staging area of generation %d of %s was removed during the epoch (was the cache "
                        "directory removed?): its samples were served, and it is written again when an epoch "
                        "needs it", build.generation, self.store.path)
            return None
        if info is None and self.remote is not None and build.from_parts:
            self.remote.wait_committed(build.generation)  # the node's first rank assembles it from the parts
        if info is None:
            log.info("generation %d of %s: this process's part is written; %s", build.generation, self.store.path,
                     "another process writing it commits it" if complete
                     else "the rest is left to the processes still writing it (or the next one)")
        return info

    # background refresh -----------------------------------------------------
    def decide_refresh(self, stream_ranks: bool = False) -> None:
        """Stop background refreshes for good where the settings turned them off (decided once, at
        construction: :func:`loader.cache.refresh.decide_refresh`); `stream_ranks`: the node's ranks
        write a stream's generations together."""
        if self.settings.background_refresh is False:
            self.stop_refresh()
        elif stream_ranks:
            # Their rendezvous is per epoch (loader.cache.stream_ranks): no rank writes the next one alone.
            log.info("background refresh is off: the node's ranks write each generation of their streams "
                     "together, during its own epoch")
            self.stop_refresh()
        elif self.remote is not None and self.remote.parts:
            # Known only once the remote answered: the nodes compute each generation in parts,
            # together, during its own epoch (no node can compute the next one alone in the background).
            log.info("background refresh is off: the nodes compute each generation in parts during its own "
                     "epoch")
            self.stop_refresh()

    def refresh_target(self, read_generation: int) -> int | None:
        """The generation to compute in the background while `read_generation` is read, if any.

        Raises
        ------
        BudgetExceededError
            ``background_refresh=True`` and the budget has no room for a second generation.
        """
        if self.refresh_off or self.went_read_only():
            return None
        generations = self.committed()
        nxt = read_generation + 1
        if nxt in generations:
            return None
        budget = self.store.budget()
        current = generations.get(read_generation)
        if budget.available is not None and current is not None and current.nbytes > budget.available:
            why = (f"background refresh needs room for a second generation (about {current.nbytes} bytes, "
                   f"{budget.available} available in {self.store.path})")
            if self.settings.background_refresh is True:
                raise BudgetExceededError(f"{why}; raise disk_budget, free space, or use background_refresh="
                                          "'auto' to write each generation during its own epoch instead")
            log.info("%s: generation %d will be written during its own epoch instead", why, nxt)
            self.stop_refresh()
            return None
        return nxt
