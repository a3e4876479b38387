"""A one-line progress display for epochs that compute samples.

A few lines of our own instead of tqdm or rich: the loader needs one line
(samples computed, samples/s, ETA), redrawn in place, and nothing else.

The display stays silent unless it is useful: only on a terminal (or when
forced with ``enabled=True``), only once the work has run for ``delay``
seconds (a short or cached epoch prints nothing), and at most a few redraws a
second (a redraw per batch would cost more than it shows).

>>> import io
>>> bar = Progress(1000, "epoch 0 (generate)", enabled=True, stream=io.StringIO(), delay=0)
>>> bar.update(250)
>>> bar.close()
"""

from __future__ import annotations

import shutil
import sys
import time
from typing import Callable, TextIO

#: Seconds between two redraws: about four a second reads as live without flooding a log.
MIN_INTERVAL = 0.25


def format_duration(seconds: float) -> str:
    """``M:SS`` below an hour, else ``H:MM:SS``."""
    seconds = max(0, int(round(seconds)))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    return f"{hours}:{minutes:02d}:{secs:02d}" if hours else f"{minutes}:{secs:02d}"


class Progress:
    """Samples done, samples/s and time left, on one line redrawn with a carriage return.

    Parameters
    ----------
    total
        Samples the work will compute (``None`` when unknown: no ETA then).
    what
        What is running, the start of the line, e.g. ``"epoch 3 (generate)"``.
    enabled
        ``None`` (default): show only when `stream` is a terminal.
        ``True``: show on any stream. ``False``: never show.
    stream
        Where to draw; default ``sys.stderr`` (looked up at construction,
        so a redirected stderr is honoured).
    delay
        Seconds after construction before the first draw; work that ends
        sooner shows nothing at all.
    min_interval
        Least seconds between two redraws.
    clock
        Monotonic seconds; tests inject a fake one.

    Examples
    --------
    >>> with Progress(n, "epoch 0 (generate)") as bar:   # doctest: +SKIP
    ...     for batch in batches:
    ...         bar.update(len(batch))
    """

    def __init__(self, total: int | None, what: str, enabled: bool | None = None, stream: TextIO | None = None,
                 delay: float = 3.0, min_interval: float = MIN_INTERVAL,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.total = total
        self.what = what
        self.stream = sys.stderr if stream is None else stream
        self.enabled = self._is_terminal(self.stream) if enabled is None else bool(enabled)
        self.delay = delay
        self.min_interval = min_interval
        self.clock = clock
        self.done = 0
        self.start = clock()
        self._last_draw: float | None = None
        self._width = 0  # length of the line on screen, to blank what a shorter line leaves
        self._closed = False

    @staticmethod
    def _is_terminal(stream: TextIO) -> bool:
        try:
            return bool(stream.isatty())
        except (AttributeError, ValueError, OSError):  # no isatty, or a closed stream
            return False

    def update(self, n: int = 1) -> None:
        """Count `n` more samples done; redraw if the delay and the throttle allow."""
        self.done += n
        if not self.enabled or self._closed:
            return
        now = self.clock()
        if now - self.start < self.delay:
            return
        if self._last_draw is not None and now - self._last_draw < self.min_interval:
            return
        self._draw(now)

    def line(self, now: float | None = None) -> str:
        """The text of the line at time `now` (default: the clock's now)."""
        now = self.clock() if now is None else now
        elapsed = max(now - self.start, 1e-9)
        rate = self.done / elapsed
        parts = [f"{self.what}: {self.done:,}" + (f"/{self.total:,}" if self.total is not None else "")
                 + " samples computed", f"{rate:,.0f} samples/s"]
        if self.total is not None:
            left = max(self.total - self.done, 0)
            parts.append("ETA " + (format_duration(left / rate) if rate > 0 else "?"))
        parts.append(f"elapsed {format_duration(elapsed)}")
        return ", ".join(parts)

    def _draw(self, now: float) -> None:
        text = self.line(now)
        if self._is_terminal(self.stream):
            # A line longer than the terminal wraps, and "\r" then redraws only its last row.
            text = text[:max(shutil.get_terminal_size().columns - 1, 20)]
        padding = " " * max(self._width - len(text), 0)
        try:
            self.stream.write("\r" + text + padding)
            self.stream.flush()
        except (OSError, ValueError):
            # A closed or broken stream must not break the training loop: stop drawing.
            self.enabled = False
            return
        self._width = len(text)
        self._last_draw = now

    def close(self) -> None:
        """Draw the final state and end the line, if anything was drawn (idempotent)."""
        if self._closed:
            return
        self._closed = True
        if not self.enabled or self._last_draw is None:
            return
        self._draw(self.clock())
        try:
            self.stream.write("\n")
            self.stream.flush()
        except (OSError, ValueError):
            pass

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
