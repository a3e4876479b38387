"""What ``CachedLoader.state_dict()`` holds, how far each epoch got, and the check that a state fits.

A state is small and made of plain Python values: where the run is (the epoch
and how many of its batches were served), the seed, the cache's plan (which
generation epoch 0 of the run used, whether caching or background refresh
gave up, a rotation fallback), and the arguments that must match for the
same batches to come out. Samples are never in it: a generation being written
survives in the store's staging area instead (see ``docs/ARCHITECTURE.md``,
"Resuming").
"""

from __future__ import annotations

import weakref
from dataclasses import asdict, dataclass
from typing import Callable, Iterator

from cachestore.errors import FingerprintError

from .cache.fingerprint import class_path, dataset_fingerprint
from .dataset import Batch, DatasetSource
from .errors import FailedBatch
from .distributed import ConsumerLayout, rank_batch_count
from .epochs.order import num_batches, sampled_length
from .epochs.rotation import batch_sizes
from .executors.positions import StreamAt
from .settings import LoaderSettings, RotationSettings
from .state_bounds import check_bounds
from .state_fields import check_ahead, check_blocks, check_field, check_history, natural, other_node, torchdata_view

#: 2: a stream copy's position is ``[its dataset's state, its iterator's]`` (1: the dataset's alone). A
#: version 1 state without a stream position means the same in both, and loads.
STATE_VERSION = 2


def _identity(settings: LoaderSettings, num_samples: int, layout: ConsumerLayout) -> dict[str, object]:
    """The arguments that decide which batches a run serves, as comparable plain values.

    With a store shared by a node's ranks, the node (its index, how many) stands for the rank and
    the world size: a state resumes on another number of ranks of the same node (elastic).
    """
    cache = settings.cache
    try:
        fingerprint = dataset_fingerprint(settings.dataset, num_samples, layout.store_owner,
                                          cache.fingerprint if cache is not None else None)
    except FingerprintError:
        # Not cached, and not hashable by value (a lock, an open file): its class stands for it.
        fingerprint = {"dataset": class_path(settings.dataset.dataset_class)}
    identity: dict[str, object] = {
        "dataset_class": fingerprint.get("dataset"),
        "dataset_params": {k: v for k, v in fingerprint.items() if k in ("params_sha256", "state_sha256")},
        # A stream's length is what its store holds: a state taken before the commit is no other stream's.
        "dataset length": None if settings.dataset.stream else num_samples,
        "batch_size": settings.batch_size,
        "drop_last": settings.drop_last,
        "shuffle": settings.shuffle,
        "nearby_shuffle": settings.nearby_shuffle,
        "nb_consumer": settings.nb_consumer,
        "consumer_index": settings.consumer_index,
        "partition": settings.partition,
        "cache_setting['update_frequency']": cache.k_or_none if cache is not None else None,
        "cache_setting": cache is not None,
        "rotation_setting": asdict(settings.rotation) if settings.rotation is not None else None,
    }
    if layout.node_scope:
        del identity["nb_consumer"], identity["consumer_index"]
        identity["node"] = [layout.node, layout.nodes]
    return identity


def take_identity(dataset: DatasetSource) -> None:
    """Take the dataset's identity, once per loader, at its first ``iter()`` (later calls do nothing).

    What was fingerprinted before (the constructor's look at a stream's store) is forgotten: the
    dataset as it is now counts. A stream is fingerprinted now, before this process iterates it: its
    own iteration changes its attributes (a position, a count of passes), which are its state, not its
    identity; the store it is filed under and every state the loader records name it as it starts
    (``docs/ARCHITECTURE.md``, "Identity").
    """
    if dataset.memo.get("taken"):
        return
    dataset.memo.clear()
    dataset.memo["taken"] = True
    if dataset.instance is not None and dataset.stream:
        try:
            dataset_fingerprint(dataset, 0, (0, 1))
        except FingerprintError:
            pass  # not hashable by value: a state names its class (_identity)


def make_state(settings: LoaderSettings, layout: ConsumerLayout, seed: int, num_samples: int, epoch: int,
               served: int, cache: dict[str, object] | None, rotation_fallback: dict[str, object] | None,
               window: str | None = None, stream: dict[str, object] | None = None,
               generating: bool = False, ahead: list[int] | None = None,
               history: tuple[tuple[int, int], ...] = (), blocks: bool = False) -> dict[str, object]:
    """The state of a loader about to serve batch `served` of epoch `epoch`.

    `cache` is the cache controller's snapshot; `rotation_fallback` the
    rotation window ``on_budget_exceeded="rotate"`` switched to (as a dict);
    `window` the directory of a disk rotation window, which a resumed run
    adopts when this run stopped right there. With a store shared by a node's
    ranks, ``ranks`` says how many split the epoch: resumed on another number of
    ranks, the epoch goes on after the first ``batches_served x batch_size x
    ranks`` samples of its order, which the new ranks split between them.
    `stream`: where a stateful stream's copies were after batch `served` (their
    own states), so the epoch goes on from there rather than from the start.
    `generating`: the epoch was a stream's generate epoch (its batches as the
    stream made them): resumed once the generation is committed, its rest is
    served as that epoch served it, not as a read epoch would. `ahead`: batches past `served` served out
    of order (``in_order=False``), not served again. `history`: ``(ranks, batches served when they
    stopped)`` of the epoch's earlier legs on another number of ranks (2 ranks, then 1, then 2 again:
    each leg dealt what the ones before left). `blocks`: the epoch served its batches in block order
    (a read epoch's; resumed after its generate epoch committed, the rest keeps that epoch's order).
    """
    identity = _identity(settings, num_samples, layout)
    if rotation_fallback is not None:
        identity["rotation_setting"] = None  # the fallback replaced the cache during the run
    state = {"version": STATE_VERSION, "epoch": epoch, "batches_served": served, "batches_ahead": list(ahead or []),
             "seed": seed, "arguments": identity, "cache": cache, "rotation_fallback": rotation_fallback,
             "rotation_window": window, "ranks": layout.local_ranks if layout.node_scope else None,
             "ranks_history": [list(leg) for leg in history], "block_order": blocks,
             "stream": stream, "stream_generate": generating}
    if stream is not None and settings.nb_worker > 0:
        state["_snapshot"] = torchdata_view(stream)
    return state


@dataclass(frozen=True)
class LoadedState:
    """A state that passed :func:`check_state`: what a new loader continues from."""

    epoch: int
    batches_served: int
    seed: int
    cache: dict[str, object] | None
    rotation_fallback: dict[str, object] | None
    rotation_window: str | None
    ranks: int | None = None  # ranks of the node that split the epoch (a store shared by a node's ranks)
    stream: StreamAt | None = None  # where a stateful stream's copies were
    generating: bool = False  # the epoch was a stream's generate epoch (see make_state)
    ahead: frozenset[int] = frozenset()  # batches past batches_served served out of order (in_order=False)
    # (ranks, batches_served when they stopped) of the epoch's earlier legs on other numbers of ranks
    history: tuple[tuple[int, int], ...] = ()
    blocks: bool = True  # the epoch served its batches in block order (states before the field: as planned)


def check_state(state: object, settings: LoaderSettings, num_samples: int, samples_per_epoch: int,
                layout: ConsumerLayout) -> LoadedState:
    """The state, checked field by field; refuse one taken from a loader with other arguments.

    Raises
    ------
    ValueError
        The state is not a loader state, a field is damaged (naming it), or an argument differs
        (naming the first that does).
    """
    if not isinstance(state, dict) or state.get("version") not in (1, STATE_VERSION) or not isinstance(
            state.get("arguments"), dict):
        raise ValueError("not a CachedLoader state (expected the dict returned by loader.state_dict(), "
                         f"version {STATE_VERSION})")
    if state["version"] == 1 and state.get("stream") is not None:
        raise ValueError("this state (version 1) records a stream's position in a format this version no longer "
                         "reads: resume from a state taken by this version, or from the start of its epoch "
                         "(set state['stream'] = None: the stream is then iterated again up to the batch)")
    check_bounds(state, settings)
    epoch, served, seed = state.get("epoch"), state.get("batches_served"), state.get("seed")
    check_field(state, "epoch", natural(epoch), "an int >= 0")
    check_field(state, "seed", natural(seed), "an int >= 0")
    mine = _identity(settings, num_samples, layout)
    theirs = dict(state["arguments"])
    theirs.setdefault("partition", "equal")  # states taken before the argument existed
    fallback = state.get("rotation_fallback")
    if fallback is not None:
        theirs["rotation_setting"] = mine["rotation_setting"]
    # Another rank's state without a cache (DDP: rank 0's, loaded on every rank): each rank goes on with its own
    # part from the same place; what only the rank that took it can adopt (its disk window, its stream's own
    # position) is left. A store of each rank's own (scope "rank") has a plan of its own: refused there.
    other_rank = settings.cache is None and "consumer_index" in mine and theirs.get(
        "nb_consumer") == mine["nb_consumer"] and theirs.get("consumer_index") != mine["consumer_index"]
    if other_rank:
        theirs["consumer_index"] = mine["consumer_index"]
    if other_node(mine, theirs):
        other_rank = True
    for name, value in mine.items():
        if theirs.get(name) != value:
            raise ValueError(f"this state was taken from a loader with another {name} ({theirs.get(name)!r}; "
                             f"this loader has {value!r}): build the loader with the same arguments to resume")
    if settings.seed_given and seed != settings.seed:
        raise ValueError(f"this state was taken from a loader with another seed ({seed}; this loader "
                         f"has {settings.seed}): pass seed={seed} or seed=None to resume")
    cache = state.get("cache")
    if settings.cache is None:
        check_field(state, "cache", cache is None, "None for a loader without cache_setting")
        check_field(state, "rotation_fallback", fallback is None, "None for a loader without cache_setting")
    else:  # None: taken before the loader that took it iterated (it plans at its first iter(), as a new one)
        check_field(state, "cache", (cache is None and served == 0) or isinstance(cache, dict) and natural(
            cache.get("base")) and isinstance(cache.get("off"), bool) and isinstance(cache.get("refresh_off"), bool),
            "the cache plan, {'base': int >= 0, 'off': bool, 'refresh_off': bool} (or None at batch 0)")
    rotation = settings.rotation
    if fallback is not None:
        try:
            rotation = RotationSettings(**fallback)  # type: ignore[arg-type]
        except (TypeError, ValueError) as exc:
            raise ValueError(f"damaged loader state: state['rotation_fallback'] is not a rotation setting "
                             f"({exc})") from None
    window = state.get("rotation_window")
    check_field(state, "rotation_window", window is None or isinstance(window, str), "None or a directory")
    ranks = state.get("ranks")
    generating = state.get("stream_generate", False)
    check_field(state, "stream_generate", isinstance(generating, bool), "a bool")
    batches = _epoch_batches(state, settings, samples_per_epoch, layout, rotation, generating)
    check_field(state, "batches_served", natural(served) and (batches is None or served <= batches),  # type: ignore[operator]
                f"an int from 0 to {batches} (the batches of an epoch)" if batches is not None else "an int >= 0")
    assert isinstance(epoch, int) and isinstance(served, int) and isinstance(seed, int)
    ahead = check_ahead(state, settings, layout, served, batches, rotation)
    stream = state.get("stream") if not other_rank else None
    window = window if not other_rank else None
    at = StreamAt.from_plain(stream, max(1, settings.nb_worker)) if stream is not None else None
    return LoadedState(epoch, served, seed, cache if isinstance(cache, dict) else None,
                       fallback if isinstance(fallback, dict) else None, window if isinstance(window, str) else None,
                       ranks if layout.node_scope and isinstance(ranks, int) else None, at, bool(generating), ahead,
                       check_history(state, served) if layout.node_scope else (), check_blocks(state))


def _epoch_batches(state: dict, settings: LoaderSettings, samples_per_epoch: int, layout: ConsumerLayout,
                   rotation: RotationSettings | None, generating: object) -> int | None:
    """The batches of an epoch the state's ``batches_served`` may count up to (``None``: any number)."""
    if settings.dataset.stream and (not samples_per_epoch or generating):
        return None  # a stream not written yet: as many batches as it yields
    if layout.node_scope:
        ranks = state.get("ranks")
        check_field(state, "ranks", isinstance(ranks, int) and not isinstance(ranks, bool) and ranks > 0,
                    "the number of ranks of the node (an int >= 1)")
        assert isinstance(ranks, int)
        if state.get("ranks_history"):  # legs on other numbers of ranks: the most one rank would serve
            ranks = 1
        return rank_batch_count(layout.per_store, ranks, settings.batch_size, settings.drop_last, layout.even)
    if rotation is not None:
        return len(batch_sizes(samples_per_epoch, rotation.rotation, settings.batch_size, settings.drop_last))
    if settings.sampling is not None:
        try:  # a sampler may draw more (or fewer) samples than the dataset has
            return sampled_length(settings.sampling, settings.batch_size, settings.drop_last)
        except TypeError:  # it has no len(): any number of batches
            return None
    return num_batches(samples_per_epoch, settings.batch_size, settings.drop_last)


def stream_length(dataset: object, batch_size: int | None, drop_last: bool) -> int:
    """``len(loader)`` of a stream not written yet, as torch's: from the stream's ``len()``.

    Raises
    ------
    TypeError
        The stream has no ``len()`` (as torch's ``DataLoader`` says it): its length is known once a
        cache holds it.
    """
    try:
        n = len(dataset)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"object of type '{type(dataset).__name__}' has no len(): a stream's length is known once "
                        "its generation is committed (a cache_setting, after the first epoch)") from None
    if batch_size is None:
        return n
    return n // batch_size if drop_last else -(-n // batch_size)


def known_length(length: Callable[[], int]) -> int | None:
    """``length()`` (the loader's ``len``), ``None`` when it has none (a sampler without ``len()``)."""
    try:
        return length()
    except TypeError:
        return None


@dataclass
class EpochProgress:
    """How far an epoch got: kept by the loader, so a state taken after a ``break`` still knows."""

    epoch: int
    served: int = 0  # batches delivered so far (those before a resume included)
    exhausted: bool = False
    started: bool = False  # next() was called: the epoch ran (even if it served nothing)
    total: int | None = None  # batches the epoch serves, when known: served them all is done
    start: int = 0  # batches_served of the state it resumed from (0: none)
    ahead: frozenset[int] = frozenset()  # and the batches past them it had served out of order


def served_batches(start: int, ahead: frozenset[int], count: int, out_of_order: list[int]) -> tuple[int, list[int]]:
    """``(batches_served, batches_ahead)`` of an epoch that resumed after batch `start` (and the batches
    `ahead` of it served out of order) and served `count` more: those `out_of_order` says (their
    numbers after `start`, in the order served), or else the next ones in order. A state records the
    first batch not served yet and the batches past it that were (``in_order=False``); in order,
    ``batches_ahead`` is empty."""
    done = set(ahead)
    if out_of_order:
        done.update(start + seq for seq in out_of_order[:count])
    else:
        number = start
        while count > 0:
            if number not in ahead:
                done.add(number)
                count -= 1
            number += 1
    first = start
    while first in done:
        first += 1
    return first, sorted(n for n in done if n > first)


class EpochIterator:
    """The iterator of one epoch; ended early when a newer epoch starts or the loader closes."""

    def __init__(self, batches: Iterator[Batch], progress: EpochProgress, owner: object = None) -> None:
        self._batches = batches
        # The loader, alive as long as its iterator (``for b in CachedLoader(...)`` holds only this, as
        # torch's iterator holds its loader): its collection releases the workers the epoch runs on.
        self._owner = owner
        self.progress = progress
        self.epoch = progress.epoch
        self._superseded_by: int | None = None

    def __iter__(self) -> "EpochIterator":
        return self

    def __next__(self) -> Batch:
        if self._superseded_by is not None:
            raise RuntimeError(
                f"this iterator of epoch {self.epoch} was ended by a newer iter(loader) (epoch "
                f"{self._superseded_by}): a loader serves one epoch at a time, so iterate it once per epoch "
                "(zip(loader, loader) or two live iterators cannot work; use two loaders for that)")
        self.progress.started = True
        try:
            batch = next(self._batches)
        except StopIteration:
            self.progress.exhausted = True
            raise
        self.progress.served += 1
        if isinstance(batch, FailedBatch):
            raise batch.error  # the next next() serves the next batch
        return batch

    @property
    def _workers(self) -> list[object]:
        """torch's iterator attribute that code written for it reads: the worker processes, by worker id
        (``multiprocessing`` processes, as torch's: ``pid``, ``join``, ``is_alive``, ``exitcode``), or each
        worker's handle with its ``pid`` where the executor has no such process; empty without worker
        processes."""
        res = getattr(self._owner, "_res", None)
        streams = getattr(res, "streams", None)  # a stream's workers (loader.executors.stream_turn)
        executor = getattr(streams, "executor", None) or getattr(res, "executor", None)
        workers = getattr(executor, "workers", None)
        return [getattr(w, "os_process", None) or w for w in sorted(workers, key=lambda w: getattr(w, "worker_id", 0))
                if getattr(w, "pid", None) is not None] if workers else []

    def end(self, superseded_by: int | None = None) -> None:
        """Stop the epoch now (its workers' results are dropped, an unfinished generation is kept)."""
        self._superseded_by = superseded_by
        close = getattr(self._batches, "close", None)
        if close is not None:
            close()

    def close(self) -> None:
        """End the epoch early, like a generator's ``close()``."""
        self.end()


class EpochCursor:
    """Where a loader is between its epochs: the epoch the next ``iter()`` serves, how far the latest
    one got, a loaded state waiting for the first ``iter()``, and the live iterator."""

    def __init__(self) -> None:
        self.next_epoch = 0  # the epoch the next iter() serves
        self.current: int | None = None  # the epoch of the latest iter(), until set_epoch()
        self.skip = 0  # batches of the next epoch served before a resume
        self.loaded: LoadedState | None = None  # a loaded state, applied at the next iter()
        self.ahead: frozenset[int] = frozenset()  # batches of the next epoch past `skip` served out of order
        self.progress: EpochProgress | None = None  # the latest epoch's, kept after its iterator is gone
        self._active: weakref.ref[EpochIterator] | None = None

    @property
    def epoch(self) -> int:
        return self.current if self.current is not None else self.next_epoch

    def begin(self) -> tuple[int, int, frozenset[int]]:
        """The epoch a new ``iter()`` serves, the batches of it already served and those past them served
        out of order; ends the live iterator."""
        epoch, skip, ahead = self.next_epoch, self.skip, self.ahead
        last = self.progress
        if last is not None and not last.started and self.current == last.epoch:
            # The previous iterator never served a batch (Lightning starts one it drops): it
            # consumed no epoch, so this one serves that epoch.
            epoch, skip, ahead = last.epoch, last.served, last.ahead
        self.close_active(superseded_by=epoch)
        return epoch, skip, ahead

    def iterate(self, epoch: int, skip: int, batches: Iterator[Batch], total: int | None = None,
                owner: object = None, ahead: frozenset[int] = frozenset()) -> EpochIterator:
        """The iterator of `epoch` (`total` batches, when known), now the live one; it keeps `owner` alive."""
        self.next_epoch, self.current, self.skip, self.ahead = epoch + 1, epoch, 0, frozenset()
        self.progress = EpochProgress(epoch, skip, total=total, start=skip, ahead=ahead)
        it = EpochIterator(batches, self.progress, owner)
        self._active = weakref.ref(it)
        return it

    def set_epoch(self, epoch: int) -> None:
        if epoch != self.next_epoch:
            self.skip, self.ahead = 0, frozenset()
        self.next_epoch, self.current, self.progress = epoch, None, None

    def position(self) -> tuple[int, int]:
        """``(epoch, batches served)`` a state records: the rest of a broken-off epoch comes first."""
        progress = self.progress
        # As torchdata's: an epoch whose last batch was served but whose iterator has not ended yet (a state
        # taken inside the loop after its last batch) resumes with its rest (nothing), and the next iter()
        # serves the next epoch; a loop that keeps its own epoch counter then trains no epoch twice.
        if progress is not None and not progress.exhausted:
            return progress.epoch, progress.served
        return self.next_epoch, self.skip

    def served(self, out_of_order: Callable[[int], list[int]]) -> tuple[int, int, list[int]]:
        """``(epoch, batches_served, batches_ahead)`` a state records (see :func:`served_batches`);
        `out_of_order(epoch)`: the batches of the epoch served out of order, in the order served."""
        progress = self.progress
        if progress is not None and not progress.exhausted:
            first, ahead = served_batches(progress.start, progress.ahead, progress.served - progress.start,
                                          out_of_order(progress.epoch))
            return progress.epoch, first, ahead
        return self.next_epoch, self.skip, sorted(self.ahead)

    def load(self, loaded: LoadedState) -> None:
        """Continue from `loaded` at the next ``iter()``, as torchdata's loader does: on a new loader, or
        on one that has iterated (a rewind, a reload after a failed step), whose live iterator ends."""
        self.close_active()
        self.current, self.progress = None, None
        self.loaded = loaded
        self.next_epoch, self.skip, self.ahead = loaded.epoch, loaded.batches_served, loaded.ahead

    def close_active(self, superseded_by: int | None = None) -> None:
        active = self._active() if self._active is not None else None
        if active is not None:
            active.end(superseded_by)
        self._active = None
