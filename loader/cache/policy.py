"""``on_budget_exceeded``: what the loader does when a generation does not fit its budget.

``"error"`` raises :class:`~cachestore.BudgetExceededError` (with the way
out: a rotation window that fits), ``"stream"`` stops caching and serves
computed samples, ``"rotate"`` switches to a disk rotation window that fits.
The decision is made here; the runner applies a switch to rotation.
"""

from __future__ import annotations

import logging

from cachestore.errors import BudgetExceededError

from ..executors.base import Executor
from ..settings import BudgetPolicy, RotationSettings
from .build import GenerationBuild
from .controller import CacheController

log = logging.getLogger(__name__)


def give_up_caching(cache: CacheController, exc: BudgetExceededError) -> BudgetPolicy:
    """The generation cannot be written (a full disk, the budget): apply ``on_budget_exceeded``.

    Returns the policy applied (``STREAM`` or ``ROTATE``: the caller then
    switches to a rotation window); caching is off for the rest of the run.

    Raises
    ------
    BudgetExceededError
        `exc`, explained, under the policy ``"error"``.
    """
    policy = cache.settings.policy
    if policy is BudgetPolicy.ERROR:
        raise explain(exc)
    cache.disable()
    # Logged as text: a log record holding the exception would keep its frames, and with them
    # this epoch's batches (and their shared-memory slots), alive as long as the record.
    if policy is BudgetPolicy.ROTATE:
        log.warning("%s", str(exc))
    else:
        log.warning("cache disabled, serving uncached samples from now on: %s", str(exc))
    return policy


def close_generation(build: GenerationBuild, cache: CacheController, executor: Executor | None,
                     epoch: int) -> BudgetPolicy | None:
    """End of a generate epoch: commit `build`; ``None`` when it was committed.

    When writing stopped because the budget ran out (policies ``"stream"``
    and ``"rotate"``), or the commit itself did not fit, the generation is
    discarded and the policy applied is returned.

    Raises
    ------
    RuntimeError
        The workers could not close their shards (the generation is discarded).
    """
    problem = build.finish(executor)
    if problem is not None:
        build.abort()
        if build.failed is None:
            raise RuntimeError(f"workers could not finish generation {build.generation}: {problem}")
        cache.disable()
        return build.policy
    try:
        cache.commit(build, epoch)
    except BudgetExceededError as exc:
        # Every sample fit, the index or manifest did not: the same promise as for the samples.
        build.abort()
        return give_up_caching(cache, exc)
    return None


#: Times each sample is served when ``on_budget_exceeded="rotate"`` falls back with K = inf.
FALLBACK_ROTATION = 4


def rotation_fallback(cache: CacheController, sample_bytes: float, num_samples: int) -> RotationSettings:
    """``on_budget_exceeded="rotate"``: the disk rotation window that fits what is left.

    `sample_bytes` is the size of one stored sample. When not even one
    fits on the disk, the window is kept in memory instead.
    """
    cache.disable()
    rotation = cache.settings.k_or_none or FALLBACK_ROTATION
    available = cache.store.budget().available
    if available is None:
        return RotationSettings("disk", rotation, num_samples, cache.store.path)
    # One file per slot: allocated in whole blocks, plus the record header.
    per_slot = -(-(sample_bytes + 512) // 4096) * 4096
    fits = int(available // per_slot)
    if fits < 1:
        log.warning("not even one sample (%d bytes) fits the %d bytes left for %s: rotating through a "
                    "window in memory instead", sample_bytes, available, cache.store.path)
        return RotationSettings("memory", rotation, None, None)
    return RotationSettings("disk", rotation, min(fits, num_samples), cache.store.path)


def explain(exc: BudgetExceededError) -> BudgetExceededError:
    """`exc`, its message extended with the loader's ways out (a rotation window that fits)."""
    fits = exc.fits_samples
    text = str(exc)
    if fits is not None and "rotation_setting" not in text:
        # The store knows sizes, not rotation: the loader words the way out. Same object, same traceback.
        exc.args = (f"{text}; a rotation window of about {fits} samples would fit: rotation_setting="
                    f"{{'medium': 'disk', 'size': {max(fits, 1)}, 'rotation': 4, 'prefix': ...}}, or "
                    "cache_setting={..., 'on_budget_exceeded': 'rotate'} to switch to it automatically",)
    return exc
