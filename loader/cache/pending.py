"""Generations whose epoch was broken off: committed when complete, else kept as partial ones.

A ``break`` (or an error, or ``close()``) ends an epoch while the workers may
still be running its tasks, which write into the epoch's generation. The
build then waits in the epoch context's ``pending`` until :func:`settle` (at the next
``iter()``) has let those tasks finish and every worker
close its shard; :func:`keep_or_commit` then commits the generation when
those last tasks completed it, and keeps it as a partial generation
otherwise (``docs/ARCHITECTURE.md``, "Resuming").
"""

from __future__ import annotations

import logging
import time

from ..executors import messages as m
from ..executors.host import ExecutorHost, HostResources
from .build import GenerationBuild
from .controller import CacheController
from .refresh import BackgroundRefresh

log = logging.getLogger(__name__)

#: Seconds the workers get to finish the tasks of a broken-off epoch (without ``timeout``).
SETTLE_TIMEOUT = 120.0


def settle(host: ExecutorHost, res: HostResources, cache: CacheController | None,
           refresh: BackgroundRefresh | None, pending: list[GenerationBuild], timeout: float | None,
           epoch: int) -> bool:
    """Before `epoch` runs: keep or commit the builds of broken-off epochs (`pending`, emptied), once the
    workers finished the tasks that write into them, and let the tasks of a broken-off run of `epoch`
    itself finish.

    Workers run the tasks they were sent in order, so the abandoned epoch's
    results arrive first (their slots are freed as they come); then every
    worker closes its shard. Workers that take too long are killed: what they
    wrote is whole on disk either way. Results are told apart by (epoch,
    batch, part): an earlier run of the same epoch (``set_epoch`` back to it
    after a ``break``) must be done before this one sends its first task.
    Returns ``False`` when the workers were killed (a running background
    refresh is gone with them).
    """
    executor, slots = res.executor, res.slots
    writing = executor is not None and any(b.in_workers for b in pending)
    same_epoch = executor is not None and slots is not None and slots.orphaned(epoch) > 0
    if not writing and not same_epoch:
        for build in _take(pending, res):
            build.keep()
        return True
    assert executor is not None
    deadline = time.monotonic() + (timeout or SETTLE_TIMEOUT)
    try:
        while slots is not None and slots.orphaned(None if writing else epoch):
            msg = executor.next_message(timeout=max(0.0, deadline - time.monotonic()))
            if msg is None:
                raise TimeoutError("the tasks of a broken-off epoch did not finish")
            if refresh is not None and refresh.handle(msg):
                continue
            if isinstance(msg, (m.BatchDone, m.TaskFailed)):
                slots.release_task(msg)
        if writing:
            executor.flush_shards()
    except Exception as exc:
        log.info("stopping the workers of a broken-off epoch (generation(s) %s kept): %s",
                 [b.generation for b in pending], exc)
        host.kill()  # keeps every build
        pending.clear()
        return False
    for build in _take(pending, res):
        keep_or_commit(build, cache)
    return True


def _take(pending: list[GenerationBuild], res: HostResources) -> list[GenerationBuild]:
    """The builds of `pending`, taken out of it and no longer held for the finalizer: the caller
    commits or keeps them now."""
    builds = pending[:]
    pending.clear()
    for build in builds:
        res.open_work.drop(build)
    return builds


def keep_or_commit(build: GenerationBuild, cache: CacheController | None) -> None:
    """A broken-off epoch's build, its writers stopped: commit it when complete, else keep it.

    Complete happens when the interrupted epoch was the one that wrote the
    last missing samples (a loop that always breaks early still gets its
    cache); the tasks still running at the break count too.
    """
    epoch = build.epoch
    try:
        # finish(): records sent to this process are in.
        if cache is not None and build.finish(None) is None and build.complete():
            cache.commit(build, epoch)
            log.info("epoch %d was broken off, but generation %d is complete: committed", epoch, build.generation)
            return
    except Exception as exc:  # the commit refused it (and discarded it): the next epoch writes it again
        log.warning("generation %d could not be committed after epoch %d was broken off: %s",
                    build.generation, epoch, exc)
        return
    log.info("epoch %d ended with generation %d incomplete (%d of %d samples in): kept, the next epoch "
             "or run of this generation completes it", epoch, build.generation,
             len(build.writer.present()) if build.open else 0, len(build.have))
    build.keep()
