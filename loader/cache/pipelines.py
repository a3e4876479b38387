"""A webdataset pipeline's identity: its sources and stages, not its shufflers' seeds.

``webdataset.WebDataset`` draws a random ``seed`` each time it is built (``random.randint`` unless
``WDS_SEED`` or ``seed=`` is given) and hands it to its shard shuffler; ``detshuffle`` and
``ResampledShards`` count their passes in ``epoch`` and keep a generator in ``rng``. None of these
says which samples the pipeline yields, only in which order (an endless, resampled stream's first
``stream_samples`` are a draw either way): hashed by value, they made every run of the same
pipeline a new dataset, and its cache was never read again. The fingerprint leaves them out of
every object of the webdataset package, as it leaves out a torch datapipe's seeds
(:func:`loader.datapipes.identity_state`); the shard list, every stage and its arguments stay.
"""

from __future__ import annotations

from typing import Any

#: What driving a webdataset pipeline changes, or what it draws at random when built.
_DRIVEN = frozenset({"seed", "rng", "epoch"})


def is_webdataset(obj: object) -> bool:
    """Whether `obj` is an object of the webdataset package (a pipeline, a stage, a shard list)."""
    return type(obj).__module__.partition(".")[0] == "webdataset"


def identity_state(obj: Any) -> dict[str, Any] | None:
    """The attributes of webdataset object `obj` that say what it yields (``None``: it has none to
    show, and is hashed as any other object). A stage made by a ``pipelinefilter`` (webdataset's
    ``shuffle(n, seed=...)``) keeps its keyword arguments in ``kw``: its seed is left out there."""
    state = getattr(obj, "__dict__", None)
    if not isinstance(state, dict):
        return None
    state = {k: v for k, v in state.items() if k not in _DRIVEN}
    kw = state.get("kw")
    if isinstance(kw, dict):
        state["kw"] = {k: v for k, v in kw.items() if k not in _DRIVEN}
    return state
