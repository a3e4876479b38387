"""How long a loader's epochs are: the dataset's length as it is now (a stream's is what its newest
committed generation holds), ``len(loader)`` in batches, and a new runner when the dataset grew or
shrank since the last one was built. A part of :class:`~loader.api.CachedLoader` (a mixin: the facade
keeps the constructor and the iteration, ``docs/ARCHITECTURE.md``)."""

from __future__ import annotations

import logging
from typing import Any

from .arguments import Unbatched
from .cache.streams import committed_length, controller_length, wait_for_writer
from .distributed import ConsumerLayout
from .epochs.order import sampled_length
from .epochs.rotation import batch_sizes
from .epochs.runner import EpochRunner
from .resources import Resources
from .settings import LoaderSettings, RotationSettings
from .state import EpochCursor, stream_length

log = logging.getLogger("loader.api")


class LoaderLengths:
    """The lengths of :class:`~loader.api.CachedLoader` (see the module docstring)."""

    settings: LoaderSettings
    dataset: Any
    num_samples: int
    _runner: EpochRunner | None
    _cursor: EpochCursor
    _res: Resources
    _len_told: int | None

    def _layout(self, num_samples: int | None = None) -> ConsumerLayout:
        raise NotImplementedError

    def _start(self) -> None:
        raise NotImplementedError

    @property
    def seed(self) -> int:
        raise NotImplementedError

    @property
    def rotation(self) -> RotationSettings | None:
        raise NotImplementedError

    @property
    def samples_per_epoch(self) -> int:
        """Samples this consumer serves per epoch (before rotation repeats them)."""
        return self._layout().per_consumer

    def __len__(self) -> int:
        """Batches of the next epoch; the dataset's length is asked each time, as torch does (one that grew
        serves more from the next ``iter()`` on)."""
        n = self._batches()
        if self.settings.dataset.stream and not self._data_length():
            # torch warns when a stream yields more than this said (NOTE [ IterableDataset and __len__ ])
            self._len_told = len(self.dataset)
            if self._runner is not None:
                self._runner.ctx.stream_len_called = self._len_told
        return n

    def _batches(self) -> int:
        """``len(self)``, told nobody."""
        s, rotation = self.settings, self.rotation
        if s.dataset.stream and not self._data_length():
            return stream_length(self.dataset, s.batch_size if not isinstance(s.collate_fn, Unbatched) else None,
                                 s.drop_last)
        if s.sampling is not None and rotation is None:
            return sampled_length(s.sampling, s.batch_size, s.drop_last)
        layout = self._layout(self._data_length())
        if rotation is not None:
            return len(batch_sizes(layout.per_consumer, rotation.rotation, s.batch_size, s.drop_last))
        return layout.batches(s.batch_size, s.drop_last)

    def _data_length(self, wait: bool = False) -> int:
        """The dataset's length; a stream's is what its newest committed generation holds (0: none yet,
        its next epoch iterates it). With `wait`, before the first epoch, what another job writing the
        store now commits counts too (it is waited for)."""
        s = self.settings
        if not s.dataset.stream:
            return len(self.dataset)
        if s.rotation is not None:  # each epoch rotates through this many samples of each rank's own stream
            return (s.rotation.stream_samples or len(self.dataset)) * s.nb_consumer
        if s.cache is None:
            return 0
        layout = self._layout(0)
        # Ranks on several nodes: each node's store holds its own ranks' streams, which the layout takes
        # as every nodes-th sample of a dataset that many times as long.
        nodes = layout.nodes if layout.node_scope and not layout.whole else 1
        if self._runner is not None and self._runner.ctx.cache is not None:
            return controller_length(self._runner.ctx.cache) * nodes
        # Another job writing this stream: its result (not another rank of the node: they write it together).
        if wait and self._runner is None and layout.local_ranks == 1:
            wait_for_writer(s.cache, layout, s.timeout)
        return committed_length(s.cache, layout, s.dataset, remote=wait) * nodes

    def _follow_length(self) -> None:
        """Serve the dataset as long as it is now: one that grew (or shrank) since the runner was built
        gets a new runner, whose layout, fingerprint (the length is part of it: another store's
        samples) and workers (with the dataset as it is) are its own; the old one's parts are
        released as at close (a generation being written is kept as a partial one)."""
        n = self._data_length(wait=True)
        if n == self.num_samples:
            return
        if self._cursor.loaded is not None:
            raise RuntimeError(f"the dataset has {n} samples, the state given to load_state_dict was taken with "
                               f"{self.num_samples}: load it into a loader of the dataset it was taken with")
        log.info("the dataset has %d samples, %d when the loader was built: the next epoch serves them all", n,
                 self.num_samples)
        seed = self.seed  # a loaded state's stays
        self._cursor.close_active()
        started = self._runner is not None
        if started:
            self._res.release()
            self._runner = None
        self.num_samples = n
        if started:
            self._start()  # fingerprinted anew: it changed
            assert self._runner is not None
            self._runner.state.seed = seed
