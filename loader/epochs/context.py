"""What every kind of epoch works with: the loader's parts, and what changes while it runs.

One :class:`EpochContext` per started loader, made by the runner
(:mod:`loader.epochs.runner`) and handed to each epoch's kind
(:mod:`loader.epochs.kinds`) and to the place that computes samples
(:mod:`loader.epochs.places`). It holds no epoch's state: that is the kind's; it
holds the work that lives across epochs (a background refresh, the builds of
broken-off epochs), registered in the loader's ``Resources.open_work`` for
its finalizer as an epoch registers its own (``docs/ARCHITECTURE.md``,
"Shutdown rules").
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

from cachestore import Store
from cachestore.errors import FingerprintError
from cachestore.format import codec, records

from ..cache.build import GenerationBuild
from ..cache import taken
from ..cache.controller import CacheController
from ..cache.fingerprint import state_hash
from ..cache.policy import rotation_fallback
from ..cache.refresh import BackgroundRefresh
from ..cache.stream_refresh import StreamRefresh
from ..datapipes import epoch_seed, is_datapipe, ranks
from ..distributed import ConsumerLayout
from ..executors.host import ExecutorHost, HostResources
from ..executors.positions import StreamAt
from ..executors.stream_turn import InlineStream, StreamTurn
from ..executors.producer import BatchProducer
from ..settings import BudgetPolicy, LoaderSettings, RotationSettings
from .reads.paths import ReadPaths, ThreadsResource
from .rotation import batch_sizes
from .stream_feed import StreamFeed
from .windows import DiskWindow, MemoryWindow, RotationWindow

if TYPE_CHECKING:  # imported only where a remote is asked for
    from ..cache.remote import RemoteTier

log = logging.getLogger(__name__)


def left_by_iteration(dataset: object) -> None:
    """This process's iteration of a stream left it so: its identity stays the one taken before
    (:mod:`loader.cache.taken`)."""
    try:
        taken.left(dataset, functools.partial(state_hash, dataset))
    except FingerprintError:
        pass  # not hashable by value: its identity is its class (loader.state)


class EpochResources(HostResources, ThreadsResource, Protocol):
    """What the epochs keep in the loader's resources (:class:`~loader.resources.Resources`, which the
    loader's finalizer releases, and which no room below the facade imports): the store, the rotation
    window and a stream's workers, besides what the rooms below keep there. What an epoch writes is its
    own, held in `open_work` for the finalizer."""

    store: Store | None
    window: RotationWindow | None
    remote: RemoteTier | None
    streams: StreamTurn | InlineStream | None  # a stream's workers, or its iterator in this process

    def stop_streams(self) -> None:
        """Stop what `open_work` runs over a stream's workers (its refresh), then `streams`."""


@dataclass
class RunState:
    """What changes while a loader runs (its settings never do)."""

    seed: int  # the settings', or a loaded state's
    rotation: RotationSettings | None  # the window epochs rotate through: the settings', or `fallback`
    fallback: RotationSettings | None = None  # the window on_budget_exceeded="rotate" switched to


class EpochContext:
    """The parts of one started loader that its epochs use (see the module docstring).

    Parameters
    ----------
    settings, layout, producer, res
        The loader's settings, its part of the data, its own producer and what it must release.
    cache
        The cache controller, ``None`` without a cache.
    """

    def __init__(self, settings: LoaderSettings, layout: ConsumerLayout, producer: BatchProducer, res: EpochResources,
                 cache: CacheController | None) -> None:
        self.settings = settings
        self.layout = layout
        self.producer = producer
        self.res = res
        self.cache = cache
        self.state = RunState(settings.seed, settings.rotation)
        self.indices = layout.partition(0)  # the dataset indices this consumer serves
        self.host = ExecutorHost(settings, producer, res)
        self.reads = ReadPaths(producer, res, settings.nb_worker, settings.batch_size)
        #: The next generation, computed by idle workers while this one is read (loader.cache.refresh).
        self.refresh: BackgroundRefresh | None = None
        #: A stream's next generation, written in the background (loader.epochs.kinds.stream_refresh).
        self.stream_refresh: StreamRefresh | None = None
        #: Builds of broken-off epochs, kept or committed once the workers finished the tasks that write
        #: into them (loader.cache.pending).
        self.pending: list[GenerationBuild] = []
        #: A generation this run will not write again was committed: the workers are retired as the epoch ends.
        self.retire_workers = False
        #: What ``len(loader)`` said of a stream not cached yet (torch warns when more batches come).
        self.stream_len_called: int | None = None
        #: A stateful stream's position after the latest batch served: ``(epoch, batches served, where)``.
        self.stream_at: tuple[int, int, StreamAt] | None = None
        #: Where rotation epochs over a stream left it (loader.epochs.kinds.stream.StreamFeed).
        self.stream_feed: StreamFeed | None = None

    def streams(self) -> StreamTurn | InlineStream:
        """The stream's workers (started at the first epoch that iterates it), or this process's iterator."""
        if self.res.streams is None:
            s = self.settings
            collate = self.producer.collate
            # A datapipe's shufflers get one seed per epoch, in every worker alike (loader.datapipes).
            pipe_seed = (functools.partial(epoch_seed, s.seed if s.seed_given else None)
                         if is_datapipe(s.dataset.dataset_class) else None)
            if s.nb_worker == 0:
                self.res.streams = InlineStream(self.producer.dataset, s.batch_size, s.drop_last, collate, pipe_seed,
                                                ranks(), functools.partial(left_by_iteration, self.producer.dataset))
            else:
                executor = self.host.make_executor(copies=True)
                self.res.streams = StreamTurn(executor, s.batch_size, s.drop_last,
                                              max(1, s.max_queue_size // executor.nb_worker), s.timeout, pipe_seed,
                                              ranks())
        streams: StreamTurn | InlineStream = self.res.streams
        return streams

    def kill_executor(self) -> None:
        """After a worker error: stop the workers now (the next epoch starts new ones), keep open builds."""
        self.host.kill()
        self.refresh = None
        self.pending.clear()  # kept with the other builds

    def drop_workers(self) -> None:
        """After an epoch that a worker error ended: stop every worker, a stream's too; the next epoch starts
        new ones, as torch's next ``iter()`` does (a stream's copies cannot be taken up where one died), and
        the slots lent to tasks that will never answer are retired then (``ExecutorHost.shrink_slots``)."""
        self.kill_executor()
        self.stream_refresh = None
        self.res.stop_streams()  # the refresh, then the workers it iterates the stream through

    # rotation ---------------------------------------------------------------
    def open_window(self) -> None:
        """The rotation window the epochs rotate through (the settings', or the budget's fallback)."""
        rotation = self.state.rotation
        assert rotation is not None
        slots = rotation.window(len(self.indices), self.settings.batch_size)
        allow_pickle = rotation.allow_pickle or self.settings.allow_pickle
        self.res.window = (DiskWindow(rotation.prefix, slots, allow_pickle) if rotation.medium == "disk"
                           and rotation.prefix else MemoryWindow(slots))

    def num_batches(self) -> int:
        """Batches per epoch (rotation serves each sample R times)."""
        s, rotation = self.settings, self.state.rotation
        if rotation is not None:
            return len(batch_sizes(len(self.indices), rotation.rotation, s.batch_size, s.drop_last))
        return self.layout.batches(s.batch_size, s.drop_last)

    def apply_policy(self, policy: BudgetPolicy) -> None:
        """Caching gave up (:mod:`loader.cache.policy`); ``"rotate"`` switches to a window that fits."""
        if policy is not BudgetPolicy.ROTATE:
            return
        assert self.cache is not None
        fallback = rotation_fallback(self.cache, self.sample_bytes(), len(self.indices))
        self.state.rotation = self.state.fallback = fallback
        self.open_window()
        rotation, window = self.state.rotation, self.res.window
        assert window is not None
        log.warning("the cache of %d samples does not fit the disk budget of %s: switching to %s rotation "
                    "(rotation=%d, window of %d samples%s); an epoch now serves %d batches",
                    len(self.indices), self.cache.store.path, rotation.medium, rotation.rotation, window.slots,
                    f" under {rotation.prefix}" if rotation.prefix else "", self.num_batches())

    def sample_bytes(self) -> int:
        """Bytes one sample takes as a record (one dataset call in this process)."""
        sample = self.producer.dataset[int(self.indices[0])] if len(self.indices) else None
        return len(records.encode_record(*codec.flatten(sample, allow_pickle=True)))
