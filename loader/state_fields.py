"""The fields of a loader state beyond where an epoch stopped, checked: the batches served out of order
(``in_order=False``), the legs an epoch ran on other numbers of ranks, the order it was served in, and
whether it is another node's.

A state is input (docs/ARCHITECTURE.md, "Untrusted stores"): each field is checked for what it may hold
before :func:`loader.state.check_state` builds the loaded state from it.
"""

from __future__ import annotations

from .distributed import ConsumerLayout
from .settings import LoaderSettings, RotationSettings
from .state_bounds import MAX_AHEAD, MAX_LEGS


def check_field(state: dict[str, object], name: str, ok: bool, expected: str) -> None:
    """A ``ValueError`` naming field `name` of `state` unless `ok`."""
    if not ok:
        raise ValueError(f"damaged loader state: state[{name!r}] must be {expected}, got {state.get(name)!r}")


def natural(value: object) -> bool:
    """Whether `value` is an int >= 0 (not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def check_ahead(state: dict, settings: LoaderSettings, layout: ConsumerLayout, served: int, batches: int | None,
                rotation: RotationSettings | None) -> frozenset[int]:
    """The state's ``batches_ahead`` (absent in states of loaders that serve in order), checked."""
    ahead = state.get("batches_ahead", [])
    check_field(state, "batches_ahead", isinstance(ahead, list) and len(ahead) <= MAX_AHEAD and all(
        natural(n) and n > served and (batches is None or n < batches) for n in ahead) and len(set(ahead)) == len(ahead),
        f"a list of distinct batch numbers past batches_served ({served})"
        + (f" and below {batches}" if batches is not None else ""))
    if ahead and (settings.dataset.stream or rotation is not None):
        raise ValueError("this state says batches were served out of order, which a stream or a rotation epoch "
                         "never does: it was taken from another kind of loader")
    ranks = state.get("ranks")
    if ahead and layout.node_scope and ranks != layout.local_ranks:
        raise ValueError(f"this state was taken on {ranks} ranks with batches served out of order (in_order=False): "
                         f"it resumes on {ranks} ranks only (this node has {layout.local_ranks})")
    return frozenset(ahead)


def check_history(state: dict, served: int) -> tuple[tuple[int, int], ...]:
    """The state's ``ranks_history`` (absent in states of runs that kept their number of ranks), checked."""
    history = state.get("ranks_history", [])
    ok = isinstance(history, list) and len(history) <= MAX_LEGS and all(
        isinstance(leg, list) and len(leg) == 2 and all(natural(v) for v in leg) and leg[0] > 0 for leg in history)
    ok = ok and all(a[1] <= b[1] for a, b in zip(history, history[1:])) and all(leg[1] <= served for leg in history)
    check_field(state, "ranks_history", ok, f"a list of at most {MAX_LEGS} [ranks, batches served] legs, in "
                f"order, up to batches_served ({served})")
    return tuple((int(r), int(upto)) for r, upto in history)


def check_blocks(state: dict) -> bool:
    """The state's ``block_order`` (states before the field: as the epoch is planned)."""
    blocks = state.get("block_order", True)
    check_field(state, "block_order", isinstance(blocks, bool), "a bool")
    return bool(blocks)


def torchdata_view(stream: dict[str, object]) -> dict[str, object]:
    """Where a stream's worker copies are (``state["stream"]``), as torchdata's ``StatefulDataLoader`` lays
    out its workers' snapshots (``_snapshot``): a view for code written against that layout (which reads
    whether a worker's stream ended, or its iterator's state). It is not read back: ``state["stream"]``
    is what a load continues from."""
    states, ended = stream["states"], stream["ended"]
    assert isinstance(states, list) and isinstance(ended, list)
    workers = {}
    for i, (at, done) in enumerate(zip(states, ended)):
        ds, it = at if isinstance(at, list) and len(at) == 2 else (None, None)
        workers[f"worker_{i}"] = {"worker_id": i, "dataset_state": ds,
                                  "fetcher_state": {"dataset_iter_state": it, "fetcher_ended": done}}
    return {"_worker_snapshots": workers}


def other_node(mine: dict[str, object], theirs: dict[str, object]) -> bool:
    """Whether `theirs` is another node's state (rank 0's, loaded on every rank of every node), made this
    node's: the nodes go on in step, each with its own part, as another rank's does.

    Raises
    ------
    ValueError
        It was taken on another number of nodes, whose parts are not these.
    """
    node, their_node = mine.get("node"), theirs.get("node")
    if not isinstance(node, list) or not isinstance(their_node, list) or their_node == node:
        return False
    if len(their_node) != 2 or their_node[1] != node[1]:
        raise ValueError(f"this state was taken on a job of another number of nodes ({their_node[-1]!r}; this "
                         f"one has {node[1]}): the nodes split each generation and epoch by their number, so "
                         "a state resumes on as many nodes, each with any number of ranks")
    theirs["node"] = node
    return True
