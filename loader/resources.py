"""What a loader owns and must release, in one place.

Kept apart from the loader on purpose: the ``weakref.finalize`` that releases
:class:`Resources` must not reference the loader, or the loader could never
be garbage-collected (see the shutdown note in :mod:`loader.executors.process.pool`
and ``docs/ARCHITECTURE.md``). Every room keeps here the parts that live as
long as the loader; what an epoch opens (a generation it writes, a background
refresh) stays its owner's, and is only registered in :class:`OpenWork`, which
stops or keeps what is still open at the release. It sits with the facade,
above them all: each room names the part it keeps as a ``typing.Protocol`` of
its own (:class:`~loader.executors.host.HostResources`,
:class:`~loader.epochs.context.EpochResources`) and never imports this module.
It names their types only: it imports none of them at run time.
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

    from .cache.remote import RemoteTier
    from .epochs.reads.threads import GatherThreads
    from .epochs.windows import RotationWindow
    from .executors.base import Executor
    from .executors.host import Keepable, Stoppable
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


class OpenWork:
    """The work the epochs hold open while the loader lives, for its finalizer: stopped or kept if the
    loader goes mid-epoch (closed, collected, at exit).

    The work is its owners': an epoch holds the build or writer of the generation it writes, the
    :class:`~loader.epochs.context.EpochContext` what lives across epochs (builds of broken-off
    epochs, a background refresh). They register it here when they open it and :meth:`drop` it when
    they commit, abort or keep it themselves: this registry only lets the finalizer, which must not
    reference the loader, reach what they still hold (``docs/ARCHITECTURE.md``, "Shutdown rules").
    """

    def __init__(self) -> None:
        # By identity, in the order registered.
        self._running: dict[int, Stoppable] = {}  # stopped before a stream's workers close (they serve it)
        self._writers: dict[int, Keepable] = {}  # written by this process alone: kept at the release
        self._builds: dict[int, Keepable] = {}  # written by the workers too: kept when they are killed as well

    def hold(self, work: Keepable, by_workers: bool = True) -> None:
        """Hold `work`, a generation being written: kept as a partial one if its owner does not finish it
        (`by_workers`: the loader's workers write into it, so that killing them keeps it too)."""
        (self._builds if by_workers else self._writers)[id(work)] = work

    def run(self, work: Stoppable) -> None:
        """Hold `work`, running in the background over a stream's workers: stopped before they close."""
        self._running[id(work)] = work

    def drop(self, work: object) -> None:
        """Its owner finished `work` itself (committed, aborted, kept, stopped)."""
        for held in (self._running, self._writers, self._builds):
            held.pop(id(work), None)

    def holds(self, work: object) -> bool:
        """Whether `work` is held: neither dropped by its owner nor kept after a kill."""
        return any(id(work) in held for held in (self._running, self._writers, self._builds))

    def stop(self) -> None:
        """Stop the work running in the background (before the stream workers it uses close)."""
        running, self._running = list(self._running.values()), {}
        _each(running, lambda work: work.stop())

    def keep_builds(self) -> None:
        """Keep the generations the workers write into as partial ones: the workers must be stopped.

        What they hold is not debris: the next attempt at the same generation,
        in this run or a later one with the same fingerprint, adopts and
        completes it (see ``docs/ARCHITECTURE.md``, "Resuming").
        """
        builds, self._builds = list(self._builds.values()), {}
        _each(builds, lambda build: build.keep())

    def keep(self) -> None:
        """Keep every generation held (the loader's release): a stream's writers, then the builds."""
        writers, self._writers = list(self._writers.values()), {}
        builds, self._builds = list(self._builds.values()), {}
        _each(writers + builds, lambda work: work.keep())


def _each(parts: list[Any], release: Callable[[Any], None]) -> None:
    """`release` each of `parts`, whatever happened to the one before; the first failure is raised."""
    failed: BaseException | None = None
    for part in parts:
        try:
            release(part)
        except BaseException as exc:
            failed = failed or exc
    if failed is not None:
        raise failed


class Resources:
    """Everything that must be released: the shutdown path shared by close(), GC and exit.

    Only what lives as long as the loader: the work of an epoch is the epoch's
    own, reached by the release through :attr:`open_work` only.
    """

    def __init__(self) -> None:
        #: The process these belong to: a worker forked while the loader lives holds a copy of them,
        #: which must never stop this process's workers or keep its generations.
        self.owner = os.getpid()
        self.executor: Executor | None = None
        self.slots: SlotPool | None = None
        self.store: Store | None = None
        self.remote: RemoteTier | None = None  # the cache's remote: its publishes are waited for at close
        self.window: RotationWindow | None = None
        self.threads: GatherThreads | None = None  # cached epochs gathered in this process (loader.epochs.reads.threads)
        self.streams: Any = None  # a stream's workers (loader.executors.stream_turn)
        #: What the epochs hold open: a background refresh to stop, generations being written to keep.
        self.open_work = OpenWork()

    def stop_streams(self) -> None:
        """Stop what runs in the background over a stream's workers (its refresh), then the workers."""
        streams, self.streams = self.streams, None
        try:
            self.open_work.stop()
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
        # Order: stop the writers (workers, a stream's refresh) before keeping what they wrote into;
        # before the store closes, no gather thread may still read it. Every step runs even when one
        # before it failed (nothing may be left behind); the first failure is raised at the end.
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
        for release in (self.stop_streams, self.open_work.keep):  # a stream's writer first, then the builds
            try:
                release()
            except BaseException as exc:
                first = first or exc
        step("threads", lambda threads: threads.shutdown())
        step("slots", lambda slots: slots.close())
        step("window", lambda window: window.close())
        step("remote", lambda remote: remote.close())  # publishes read the store: before it closes
        step("store", lambda store: store.close())
        if first is not None:
            raise first
