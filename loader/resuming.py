"""Resuming a loader's run: the epoch it serves, its state as a small dict of plain values, and a state
loaded to go on from (as torchdata's ``StatefulDataLoader`` means them; :mod:`loader.state` checks and
builds the dict). A part of :class:`~loader.api.CachedLoader` (a mixin: the facade keeps the
constructor and the iteration, ``docs/ARCHITECTURE.md``)."""

from __future__ import annotations

import os

from cachestore.backends import get_backend
from cachestore.errors import NotAStoreError
from cachestore.store import open_local

from .checks import int_at_least
from .epochs.context import left_by_iteration
from .executors.positions import StreamAt, stream_start
from .lengths import LoaderLengths
from .state import check_state, make_state


class ResumableLoader(LoaderLengths):
    """The resuming part of :class:`~loader.api.CachedLoader` (see the module docstring)."""

    _pinned_plan: dict[str, object] | None

    @property
    def epoch(self) -> int:
        """The epoch being served (or, before its ``iter()``, the one the next ``iter()`` serves)."""
        return self._cursor.epoch

    def set_epoch(self, epoch: int) -> None:
        """Make the next ``iter(loader)`` serve `epoch` (as ``DistributedSampler.set_epoch``).

        The order, the generation read or written and the partition all
        follow from the epoch number, so calling this with the loop's own
        counter keeps every rank, and a resumed run, in step.
        """
        self._cursor.set_epoch(int_at_least("epoch", epoch, 0))

    def state_dict(self) -> dict[str, object]:
        """Where the run is, as a small dict of plain values (picklable, JSON-able).

        Taken between epochs or in the middle of one: a new loader built with
        the same arguments continues after :meth:`load_state_dict` exactly
        where this one was, batch for batch, generation for generation.
        Samples are not in it: a generation being written survives in the
        store's staging area.
        """
        epoch, served, ahead = self._cursor.served(self._runner.out_of_order if self._runner is not None
                                                   else lambda epoch: [])
        r, runner = self._cursor.loaded, self._runner
        history: tuple[tuple[int, int], ...] = ()
        blocks = False
        if r is not None:  # loaded, not iterated yet: still the loaded plan
            cache, fallback, window, generating = r.cache, r.rotation_fallback, r.rotation_window, r.generating
            history, blocks = r.history, r.blocks
        elif runner is not None:
            (cache, fallback), window, generating = runner.snapshot(), runner.window_path(), runner.generating(epoch)
            history, blocks = runner.ranks_history(epoch), runner.in_blocks(epoch)
        else:
            cache, fallback, window, generating = self._plan_before_start(), None, None, False
        stream = self._stream_position(epoch, served)
        return make_state(self.settings, self._layout(), self.seed, self.num_samples, epoch, served, cache,
                          fallback, window, stream.plain() if stream is not None else None, generating and served > 0,
                          ahead, history, blocks)

    def _plan_before_start(self) -> dict[str, object] | None:
        """The cache plan of a state taken before the first ``iter()``: the generation the first epoch
        starts from, pinned for this loader too, so that the state says what the run reads from here on
        even when another loader on the prefix commits a newer generation meanwhile (torchdata's meaning:
        a state is where the run is). ``None`` without a cache, or with a remote (whose newest generation
        is asked for at the start)."""
        s = self.settings
        if s.cache is None or s.cache.remote is not None or not get_backend(s.cache.backend).persistent:
            return None
        if self._pinned_plan is None:
            path, newest = self._layout().store_path(s.cache.prefix), None
            if os.path.isdir(path):
                try:
                    with open_local(path, readonly=True) as store:
                        newest = store.latest()
                except NotAStoreError:
                    pass
            self._pinned_plan = {"base": newest if newest is not None else 0, "off": False, "refresh_off": False}
        return dict(self._pinned_plan)

    def _stream_position(self, epoch: int, served: int) -> StreamAt | None:
        """Where a stateful stream's copies were after batch `served` of `epoch` (a loaded state's, until
        iterated), ``None`` where the stream is iterated again up to there (see :mod:`loader.state`)."""
        loaded = self._cursor.loaded
        if loaded is not None:
            return loaded.stream
        at, s = self._runner.ctx.stream_at if self._runner is not None else None, self.settings
        if s.nb_worker == 0 and s.dataset.stream and s.dataset.instance is not None and self._runner is not None:
            left_by_iteration(s.dataset.instance)  # as this process's iteration has it now: the same identity
        if at is not None and at[:2] == (epoch, served):
            return at[2]
        # A stream this process iterates, not begun yet: as it is now (torchdata's).
        return stream_start(s.dataset.instance) if served == 0 and s.nb_worker == 0 and s.dataset.stream else None

    def load_state_dict(self, state: dict[str, object]) -> None:
        """Continue the run `state` was taken from, at the next ``iter()`` (as torchdata's loader: on a new
        loader, or on one that has iterated, whose live iterator ends).

        Raises
        ------
        ValueError
            The state comes from a loader with other arguments (it says which).
        """
        self._follow_length()  # a stream's, committed by the node's ranks: known once their scope is decided
        self._cursor.load(check_state(state, self.settings, self.num_samples, self.samples_per_epoch, self._layout()))
