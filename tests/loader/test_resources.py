"""What a loader's release stops and keeps of the work its epochs hold open, and in which order
(docs/ARCHITECTURE.md, "Shutdown rules"): the epochs own that work; `Resources.open_work` only lets
the release reach it."""

from __future__ import annotations

from loader.resources import OpenWork, Resources


class Part:
    """A fake part that notes each release, by name, in `done`."""

    def __init__(self, name: str, done: list[str]) -> None:
        self.name, self.done = name, done

    def _note(self) -> None:
        self.done.append(self.name)

    shutdown = close = stop = keep = _note


def test_the_release_stops_then_keeps_what_epochs_hold_in_the_order_of_the_shutdown_rules():
    done: list[str] = []
    res = Resources()
    for name in ("executor", "streams", "threads", "slots", "window", "remote", "store"):
        setattr(res, name, Part(name, done))
    res.open_work.hold(Part("build", done))
    res.open_work.hold(Part("stream writer", done), by_workers=False)
    res.open_work.run(Part("stream refresh", done))
    res.release()
    assert done == ["executor", "stream refresh", "streams", "stream writer", "build", "threads", "slots",
                    "window", "remote", "store"]


def test_what_its_owner_finished_is_left_alone_and_a_kill_keeps_only_the_builds():
    done: list[str] = []
    work = OpenWork()
    build, committed, writer = Part("build", done), Part("committed", done), Part("writer", done)
    work.hold(build)
    work.hold(committed)
    work.hold(writer, by_workers=False)
    work.drop(committed)
    assert not work.holds(committed) and work.holds(build) and work.holds(writer)
    work.keep_builds()  # the workers were killed
    assert done == ["build"] and not work.holds(build) and work.holds(writer)
    work.keep()
    assert done == ["build", "writer"] and not work.holds(writer)


def test_every_part_is_kept_though_one_fails_and_the_first_failure_is_raised():
    done: list[str] = []

    class Failing(Part):
        def keep(self) -> None:
            raise OSError(self.name)

    work = OpenWork()
    work.hold(Failing("first", done))
    work.hold(Part("second", done))
    work.hold(Failing("third", done))
    try:
        work.keep()
    except OSError as exc:
        assert str(exc) == "first"
    else:
        raise AssertionError("the failure was not raised")
    assert done == ["second"]
