"""The progress line: silent when short or not on a terminal, throttled, one line ended by close()."""

from __future__ import annotations

import io

import pytest

from loader.progress import Progress, format_duration


class Clock:
    """A clock the test moves by hand: no sleeps."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_silent_on_a_pipe_unless_forced():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(100, "epoch 0 (generate)", stream=stream, delay=0, clock=clock)
    clock.now += 5
    bar.update(10)
    bar.close()
    assert stream.getvalue() == ""


def test_shows_on_a_terminal_by_default():
    clock, stream = Clock(), Terminal()
    bar = Progress(100, "epoch 0 (generate)", stream=stream, delay=0, clock=clock)
    clock.now += 5
    bar.update(10)
    assert stream.getvalue().startswith("\repoch 0 (generate): 10/100 samples computed")


def test_nothing_before_the_delay_so_short_epochs_print_nothing():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(1000, "epoch 0 (generate)", enabled=True, stream=stream, delay=3.0, clock=clock)
    for _ in range(10):
        clock.now += 0.25
        bar.update(100)
    bar.close()
    assert stream.getvalue() == ""  # 2.5 s: done before the delay


def test_line_shows_count_rate_and_eta():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(1000, "epoch 5 (refresh)", enabled=True, stream=stream, delay=3.0, clock=clock)
    clock.now += 4.0
    bar.update(400)
    assert stream.getvalue() == "\repoch 5 (refresh): 400/1,000 samples computed, 100 samples/s, ETA 0:06, elapsed 0:04"


def test_redraws_are_throttled():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(10_000, "e", enabled=True, stream=stream, delay=0, clock=clock)
    for _ in range(100):  # 100 updates in one second: at most 4 redraws
        clock.now += 0.01
        bar.update(1)
    assert 1 <= stream.getvalue().count("\r") <= 4
    clock.now += 1.0
    bar.update(1)
    assert stream.getvalue().count("\r") <= 5


def test_close_draws_the_final_state_and_ends_the_line_once():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(20, "e", enabled=True, stream=stream, delay=1.0, clock=clock)
    clock.now += 2.0
    bar.update(10)
    clock.now += 0.1
    bar.update(10)  # throttled
    bar.close()
    bar.close()
    out = stream.getvalue()
    assert out.endswith("\n") and out.count("\n") == 1
    assert out.rsplit("\r", 1)[1].startswith("e: 20/20 samples computed")


def test_a_shorter_line_blanks_the_rest_of_the_longer_one():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(None, "e", enabled=True, stream=stream, delay=0, clock=clock)
    clock.now += 1.0
    bar.update(123_456)
    first = stream.getvalue()
    clock.now += 99.0
    bar.update(1)  # the rate drops: fewer digits
    second = stream.getvalue()[len(first):]
    assert len(second) >= len(first)
    assert "ETA" not in second  # no total, no ETA


def test_disabled_never_writes():
    clock, stream = Clock(), Terminal()
    with Progress(10, "e", enabled=False, stream=stream, delay=0, clock=clock) as bar:
        clock.now += 10
        bar.update(5)
    assert stream.getvalue() == ""


def test_a_closed_stream_does_not_break_the_loop():
    clock, stream = Clock(), io.StringIO()
    bar = Progress(10, "e", enabled=True, stream=stream, delay=0, clock=clock)
    stream.close()
    clock.now += 1
    bar.update(1)
    bar.close()
    assert bar.enabled is False


@pytest.mark.parametrize("seconds,text", [(0, "0:00"), (59.6, "1:00"), (61, "1:01"), (3600 + 62, "1:01:02")])
def test_format_duration(seconds, text):
    assert format_duration(seconds) == text
