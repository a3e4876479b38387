"""Where rotation epochs over a stream left it: each epoch takes the stream's next samples.

Rotation over a stream (``docs/ARCHITECTURE.md``, "Streams") serves N samples of the stream per
epoch. The stream's workers keep iterating across epochs: the next epoch takes the N samples after
the last epoch's, and a stream that ended is iterated again from its start.
"""

from __future__ import annotations

import itertools
from typing import Any, Iterator

from ..dataset import Sample
from ..executors.stream_turn import InlineStream, StreamTurn

class StreamFeed:
    """A stream's samples across the rotation epochs over it: each epoch takes the stream's next ones, where
    the last epoch stopped; a stream that ended is iterated again from its start (a new pass, numbered on
    from `base`: its workers' answers are never taken for another pass's)."""

    def __init__(self, streams: StreamTurn | InlineStream, base: int) -> None:
        self.streams, self.passes = streams, itertools.count(base)
        self._items: Iterator[tuple[int, int, Any]] | None = None
        self._samples: Iterator[Sample] = iter(())

    def take(self, n: int) -> list[Sample]:
        """The stream's next `n` samples.

        Raises
        ------
        ValueError
            A whole pass of the stream yields fewer than `n` samples.
        """
        got: list[Sample] = list(itertools.islice(self._samples, n)) if self._items is not None else []
        if len(got) < n:
            self.close()  # the pass ended: the rest comes from a new one
            self._items = self.streams.items(next(self.passes), collate=False)
            self._samples = (sample for _worker, _count, batch in self._items for sample in batch)
            more = list(itertools.islice(self._samples, n - len(got)))
            if len(more) < n - len(got):
                self.close()
                raise ValueError(f"the stream yielded {len(more)} samples in a whole pass: rotation takes {n} "
                                 "of them at once (its len(), or rotation_setting['stream_samples'])")
            got += more
        return got

    def close(self) -> None:
        """Stop the pass under way (the workers end their iterators at their next Begin)."""
        if self._items is not None:
            items, self._items, self._samples = self._items, None, iter(())
            items.close()  # type: ignore[attr-defined]


#: Pass numbers of rotation over a stream (the stream workers' epochs), apart from the epochs' own numbers.
ROTATION_BASE = 1 << 41
