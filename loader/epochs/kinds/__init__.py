"""The kinds of epoch, one object each, chosen once per epoch from its plan (:func:`kind_of`).

============  =====================================================  ========================
kind          what the epoch does                                    module
============  =====================================================  ========================
compute       samples from the dataset, nothing written              :mod:`.compute`
generate      every sample computed, written, served; committed      :mod:`.generate`
read          served from a committed generation                     :mod:`.read`
refresh       read, while idle workers compute the next generation   :mod:`.refresh`, :mod:`.stream_refresh`
rotate        served ``R`` times each through a bounded window       :mod:`.rotate`
stream        a stream iterated, served as it comes (and written)    :mod:`.stream`
============  =====================================================  ========================

Each is an :class:`~.base.EpochKind` with a plan of its own
(:mod:`loader.epochs.plan`). A new kind is a plan class, a module here and
one line in :func:`kind_of`: so is the generate epoch of a stream (an
``IterableDataset`` iterated once and written in arrival order, its later
epochs then read like any generation).
"""

from __future__ import annotations

from cachestore.errors import BudgetExceededError, GenerationCommitted

from ...cache.policy import give_up_caching
from ...cache.read_order import ReadChoice, read_order
from ..context import EpochContext
from ..places import ComputePlace
from ..plan import EpochPlan, GeneratePlan, ReadPlan, RotatePlan, StreamGeneratePlan, StreamPlan
from .base import EpochKind
from .compute import ComputeEpoch
from .generate import GenerateEpoch
from .read import ReadEpoch
from .refresh import RefreshEpoch
from .rotate import RotateEpoch
from .stream import StreamEpoch, StreamGenerateEpoch
from .stream_refresh import StreamRefreshEpoch

__all__ = ["ComputeEpoch", "EpochKind", "GenerateEpoch", "ReadEpoch", "RefreshEpoch", "RotateEpoch", "StreamEpoch",
           "StreamGenerateEpoch", "StreamRefreshEpoch", "kind_of"]


def kind_of(ctx: EpochContext, place: ComputePlace, plan: EpochPlan) -> EpochKind:
    """The kind of the epoch `plan` describes: the one place it is chosen.

    A generate epoch opens its generation here, and a failed open is an event
    the epoch handles, never a second plan: where the other processes writing
    the generation committed it meanwhile, the epoch reads it in the batches it
    planned; where the budget has no room for it, its policy applies and the
    epoch computes those batches (caching given up) or serves its order through
    the rotation window the policy opened.
    """
    if isinstance(plan, StreamPlan):
        return StreamGenerateEpoch.open(ctx, place, plan) if isinstance(plan, StreamGeneratePlan) else \
            StreamEpoch(ctx, place, plan)
    if isinstance(plan, GeneratePlan):
        cache, generation = ctx.cache, plan.generation
        assert cache is not None and generation is not None
        try:
            return GenerateEpoch.open(ctx, place, plan)
        except BudgetExceededError as exc:
            ctx.apply_policy(give_up_caching(cache, exc))
            plan = plan.as_rotate() if ctx.state.rotation is not None else plan.as_compute()
        except GenerationCommitted:
            info = cache.committed().get(generation)
            if info is None:  # it went away under the processes that committed it: computed, nothing written
                return GenerateEpoch(ctx, place, plan, None)
            plan = plan.as_read(info.created, read_order(ReadChoice("random", 1, False), ctx.settings, None))
    if isinstance(plan, RotatePlan):
        return RotateEpoch(ctx, place, plan)
    if isinstance(plan, ReadPlan) and StreamRefreshEpoch.applies(ctx, plan):
        return StreamRefreshEpoch(ctx, place, plan)
    if isinstance(plan, ReadPlan):
        return (RefreshEpoch if RefreshEpoch.applies(ctx, place, plan) else ReadEpoch)(ctx, place, plan)
    return ComputeEpoch(ctx, place, plan)
