"""A stream's next generation, written in the background while the cached epochs read the current one.

A map-style dataset's refresh hands chunks of indices to idle workers
(:mod:`loader.cache.refresh`). A stream has no indices: it can only be
iterated, in order, by its own workers
(:mod:`loader.executors.stream_turn`), which are idle while the cached
epochs read generation ``g`` (those are read by the store's read paths).
So a thread of the training process iterates the stream through them (a
stream epoch of its own, :data:`BACKGROUND_BASE` up) and puts each sample,
in arrival order as a generate epoch does, into generation ``g + 1``'s
writer, committing at the end of the stream. The thread does little under
the GIL: it unpickles the workers' samples and encodes and writes them.

The epoch that should read ``g + 1`` waits for the thread
(:meth:`StreamRefresh.wait`); a refresh that failed leaves that epoch to
iterate the stream itself, as without a background refresh. Stopped (close,
an error, a new runner) the thread ends at its next batch, or when the
workers are stopped under it, and the generation is aborted: a stream's
partial generation cannot be taken up (the stream's position is not
recorded), so nothing half-written stays (``docs/ARCHITECTURE.md``,
"Streams").
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Callable

import numpy as np

from cachestore import GenerationInfo, GenerationWriter

from ..executors.stream_turn import StreamTurn

log = logging.getLogger(__name__)

#: The stream epochs of background refreshes are numbered from here: above any epoch a loop counts, and
#: each one its own, so that a worker's late answer to a stopped refresh is never taken for a later one's.
BACKGROUND_BASE = 1 << 40
_numbers = itertools.count(BACKGROUND_BASE)

#: Seconds a stopped refresh gets to end at its next batch before the workers are stopped under it.
STOP_GRACE = 1.0


class StreamRefresh:
    """Generation `generation` of a stream, written by a thread from the stream's workers (see the module
    docstring).

    Parameters
    ----------
    generation
        The generation written.
    writer
        Its writer (no sample count: the stream's end says it); the refresh commits or aborts it.
    streams
        The stream's workers; nothing else may use them until the refresh ended.
    limit
        ``cache_setting["stream_samples"]``: the first samples only (``None``: the whole stream).
    expected
        The samples of the generation read meanwhile: a refresh of another length is dropped, since the
        epochs of that generation still to come read with its length.
    commit
        Commits the finished writer (the cache's one commit, which publishes it; no pruning: the epochs of
        the generation read meanwhile still read it).
    seed
        The run's: the workers' generators are seeded from ``(seed, generation)`` for the iteration, so
        that each generation draws its own random augmentations (workers started anew, as a loader whose
        dataset length changed starts them, would otherwise draw the last generation's again).
    """

    def __init__(self, generation: int, writer: GenerationWriter, streams: StreamTurn, limit: int | None,
                 expected: int, commit: Callable[[GenerationWriter], GenerationInfo | None], seed: int) -> None:
        self.generation, self.writer, self.streams = generation, writer, streams
        self.limit, self.expected, self.commit = limit, expected, commit
        self.reseed = int(np.random.SeedSequence([seed % 2**32, generation, 0x5352]).generate_state(1)[0])
        self.epoch = next(_numbers)
        self.info: GenerationInfo | None = None  # the committed generation
        self.failed: str | None = None  # why it did not commit
        self.cpu_seconds = 0.0  # the thread's own CPU time: what it took of the training process's GIL, at most
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"cachestore-stream-refresh-{generation}",
                                       daemon=True)
        self.thread.start()

    def _run(self) -> None:
        committed = False
        try:
            written = self._write()
            if self._stop.is_set():
                self.failed = "stopped"
            elif written != self.expected:
                self.failed = (f"the stream yielded {written} samples, the generation read meanwhile holds "
                               f"{self.expected}")
            else:
                self.info = self.commit(self.writer)
                committed = self.info is not None
                if not committed:
                    self.failed = "its samples went away (was the cache directory removed?)"
        except BaseException as exc:  # reported by wait(); the epoch of the generation then writes it
            self.failed = f"{type(exc).__name__}: {exc}"
        finally:
            if not committed:
                self._abort()
            self.cpu_seconds = time.thread_time()

    def _write(self) -> int:
        """Put the stream's samples in arrival order; how many were put (fewer when stopped)."""
        written = 0
        for _worker, _count, samples in self.streams.items(self.epoch, collate=False, reseed=self.reseed):
            for sample in samples:
                if self.limit is not None and written >= self.limit:
                    break
                self.writer.put(written, sample)
                written += 1
            if self._stop.is_set() or (self.limit is not None and written >= self.limit):
                break
        return written

    def _abort(self) -> None:
        try:
            self.writer.abort()
        except Exception as exc:  # its staging area may be gone already (the prefix removed)
            log.debug("aborting the background refresh of generation %d: %s", self.generation, exc)

    def wait(self) -> float:
        """Wait for the refresh to end (committed, or :attr:`failed`); the seconds waited."""
        start = time.perf_counter()
        while self.thread.is_alive():
            self.thread.join(0.1)  # in slices: Ctrl-C reaches the training process meanwhile
        return time.perf_counter() - start

    def stop(self) -> None:
        """End the refresh now: the thread stops at its next batch (or when the workers are stopped under it,
        a stream whose next batch is slow), and the generation is aborted."""
        self._stop.set()
        self.thread.join(STOP_GRACE)
        if self.thread.is_alive():
            self.streams.close()  # its wait on the workers ends with them
            self.thread.join()
        if self.info is not None:
            log.debug("background refresh of generation %d was committed before the stop", self.generation)
