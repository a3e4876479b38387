"""What a loader owns and must release, in one place.

Kept apart from the loader on purpose: the ``weakref.finalize`` that releases
:class:`Resources` must not reference the loader, or the loader could never
be garbage-collected (see the shutdown note in :mod:`loader.executors.process.pool`
and ``docs/ARCHITECTURE.md``). Every room keeps its parts here; it sits with the
facade, above them all: each room names the part it keeps as a ``typing.Protocol``
of its own (:class:`~loader.executors.host.HostResources`,
:class:`~loader.cache.build.CacheResources`, :class:`~loader.epochs.context.EpochResources`)
and never imports this module. It names their types only: it imports none of them at run time.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from typing import TYPE_CHECKING, Any, Callable, Iterator

if TYPE_CHECKING:
    from types import FrameType

    from cachestore import Store

    from .cache.build import GenerationBuild
    from .cache.remote import RemoteTier
    from .epochs.reads.threads import GatherThreads
    from .epochs.windows import RotationWindow
    from .executors.base import Executor
    from .executors.process.slots import SlotPool


@contextlib.contextmanager
def interrupts_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) back until the block is done, in the main thread.

    A second Ctrl-C during a loader's clean-up used to cut it short: the
    generation being written was then dropped instead of kept. Held back, it
    arrives as soon as the clean-up (whose waits are all bounded) is done.
    """
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "pthread_sigmask"):
        yield
        return
    # The kernel may give the signal to any thread that does not block it (torch's, a timer's, the
    # user's), and Python then runs the handler in the main thread all the same: the handler itself is
    # swapped for one that notes the Ctrl-C, and the noted one is handed to the old handler at the end.
    handler = signal.getsignal(signal.SIGINT)
    noted: list[tuple[int, FrameType | None]] = []
    swapped = callable(handler)
    if swapped:
        signal.signal(signal.SIGINT, lambda signum, frame: noted.append((signum, frame)))
    previous = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, previous)  # a Ctrl-C held back is noted now
        if swapped:
            signal.signal(signal.SIGINT, handler)
            if noted and callable(handler):
                handler(*noted[0])


class Resources:
    """Everything that must be released: the shutdown path shared by close(), GC and exit."""

    def __init__(self) -> None:
        #: The process these belong to: a worker forked while the loader lives holds a copy of them,
        #: which must never stop this process's workers or keep its generations.
        self.owner = os.getpid()
        self.executor: Executor | None = None
        self.slots: SlotPool | None = None
        self.build: GenerationBuild | None = None  # the generation the current epoch writes
        self.background: GenerationBuild | None = None  # the generation a background refresh writes
        # Builds of broken-off epochs, kept once the workers finished the tasks that write into them.
        self.pending: list[GenerationBuild] = []
        self.store: Store | None = None
        self.remote: RemoteTier | None = None  # the cache's remote: its publishes are waited for at close
        self.window: RotationWindow | None = None
        self.threads: GatherThreads | None = None  # cached epochs gathered in this process (loader.epochs.reads.threads)
        self.streams: Any = None  # a stream's workers (loader.executors.stream_turn)
        self.stream_writer: Any = None  # the generation a stream's epoch writes: kept as a partial one
        self.stream_refresh: Any = None  # a stream's next generation written in the background: aborted

    def keep_builds(self) -> None:
        """Keep the generations being written as partial ones (an error, shutdown): the writers must be stopped.

        What they hold is not debris: the next attempt at the same generation,
        in this run or a later one with the same fingerprint, adopts and
        completes it (see ``docs/ARCHITECTURE.md``, "Resuming").
        """
        builds, self.pending = self.pending, []
        for name in ("build", "background"):
            build = getattr(self, name)
            setattr(self, name, None)
            if build is not None:
                builds.append(build)
        failed: BaseException | None = None
        for build in builds:  # each one, whatever happened to the one before
            try:
                build.keep()
            except BaseException as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    def keep_pending(self) -> None:
        """Keep the builds of broken-off epochs (their workers are done with them)."""
        pending, self.pending = self.pending, []
        for build in pending:
            build.keep()

    def stop_streams(self) -> None:
        """Stop a stream's background refresh, then its workers (the refresh iterates the stream through them)."""
        refresh, self.stream_refresh = self.stream_refresh, None
        streams, self.streams = self.streams, None
        try:
            if refresh is not None:
                refresh.stop()
        finally:
            if streams is not None:
                streams.close()

    def release(self) -> None:
        """Release everything (see the shutdown note in :mod:`loader.executors.process.pool`); nothing
        in a forked child, whose garbage collection may meet its copy of a loader."""
        if os.getpid() != self.owner:
            return
        with interrupts_deferred():
            self._release()

    def _release(self) -> None:
        # Order: stop the writers (workers) before keeping what they wrote into; before the store
        # closes, no gather thread may still read it. Every step runs even when one before it
        # failed (nothing may be left behind); the first failure is raised at the end.
        first: BaseException | None = None

        def step(take: str, release: Callable[[Any], None]) -> None:
            nonlocal first
            part = getattr(self, take)
            setattr(self, take, None)
            if part is None:
                return
            try:
                release(part)
            except BaseException as exc:
                first = first or exc

        step("executor", lambda executor: executor.shutdown())
        try:
            self.stop_streams()
        except BaseException as exc:
            first = first or exc
        step("stream_writer", lambda writer: writer.keep())
        try:
            self.keep_builds()
        except BaseException as exc:
            first = first or exc
        step("threads", lambda threads: threads.shutdown())
        step("slots", lambda slots: slots.close())
        step("window", lambda window: window.close())
        step("remote", lambda remote: remote.close())  # publishes read the store: before it closes
        step("store", lambda store: store.close())
        if first is not None:
            raise first
