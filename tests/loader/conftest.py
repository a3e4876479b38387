"""Fixtures of the loader tests: leak checks for processes, shared memory and files."""

from __future__ import annotations

import glob
import json
import os
from pathlib import Path

import psutil
import pytest

from loader.executors.process.shm import MEMFD_PREFIX, shm_dir


def live_children() -> list[psutil.Process]:
    """Child processes of this test process, except multiprocessing's resource tracker and forkserver (one
    per process, which live as long as it does)."""
    out = []
    for child in psutil.Process().children(recursive=True):
        try:
            if child.status() == psutil.STATUS_ZOMBIE:
                continue
            if any("resource_tracker" in part or "forkserver" in part for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        out.append(child)
    return out


def segments_of(pid: int) -> list[str]:
    """Slots of training process `pid` still alive anywhere: files in /dev/shm, and memfd slots
    (``/memfd:cachestore-<pid>-...``) any process still holds open or mapped."""
    found = glob.glob(os.path.join(shm_dir(), f"cachestore-{pid}-*"))
    label = f"{MEMFD_PREFIX}{pid}-"
    for proc in psutil.pids():
        for where in (f"/proc/{proc}/fd", f"/proc/{proc}/map_files"):
            try:
                entries = os.listdir(where)
            except OSError:
                continue
            for entry in entries:
                try:
                    link = os.readlink(os.path.join(where, entry))
                except OSError:
                    continue
                if link.startswith(label):
                    found.append(f"{link} (pid {proc})")
    return sorted(set(found))


def my_segments() -> list[str]:
    return segments_of(os.getpid())


def kept_partial(path: str) -> bool:
    """Whether `path` is a staging area kept on purpose: a partial generation for the next run to adopt
    (a writer's kept staging area, or a shared one nobody writes now)."""
    try:
        with open(os.path.join(path, "staging.json")) as f:
            record = json.load(f)
    except (OSError, ValueError):
        return False
    if record.get("shared"):
        from cachestore.backends.staging import has_members

        return not has_members(path)
    return record.get("kept") is True


def partials(prefix: str | os.PathLike, generation: int | None = None) -> list[str]:
    """The staging areas under `prefix` (of `generation`): shared areas, the default, or a writer's own."""
    gen = "" if generation is None else f"{generation:06d}-"
    return sorted(str(p) for p in Path(prefix).glob(f".s*") if p.is_dir()
                  and p.name.startswith((f".staging-{gen}", f".shared-{gen}")) and not p.name.startswith(".shared-tmp-"))


def leftovers(root: str) -> list[str]:
    """Staging directories, temp files and locks anywhere under `root` (kept partial generations are not debris)."""
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = [d for d in dirnames if not kept_partial(os.path.join(dirpath, d))]
        for name in dirnames + filenames:
            if (name.startswith((".staging-", ".shared-tmp-")) or name.endswith(".tmp")
                    or name in ("writer.lock", "lock.mdb")):
                found.append(os.path.join(dirpath, name))
    return found


@pytest.fixture
def no_leaks(tmp_path):
    """Fails the test if it leaves worker processes, segments or store debris behind."""
    yield tmp_path
    import gc

    gc.collect()
    children = live_children()
    for child in children:
        child.kill()
    assert not children, f"processes left behind: {children}"
    assert not my_segments(), f"shared memory left behind: {my_segments()}"
    assert not leftovers(str(tmp_path)), f"files left behind: {leftovers(str(tmp_path))}"
