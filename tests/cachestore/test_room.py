"""memory_room: the host's available memory, or the room a cgroup memory limit leaves (v1 and v2)."""

from __future__ import annotations

from pathlib import Path

import psutil
import pytest

from cachestore.space.room import cgroup_room, memory_room

GiB = 1 << 30


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def _v2(tmp_path: Path, levels: dict[str, tuple[str, int, int]]) -> tuple[Path, Path]:
    """A fake v2 tree: {cgroup path: (memory.max, memory.current, inactive_file)}; the process in the deepest."""
    root = tmp_path / "cgroup"
    for path, (limit, current, inactive) in levels.items():
        here = root / path.strip("/") if path != "/" else root
        _write(here / "memory.max", f"{limit}\n")
        _write(here / "memory.current", f"{current}\n")
        _write(here / "memory.stat", f"anon 1234\nfile 999\ninactive_file {inactive}\nactive_file 5\n")
    proc = tmp_path / "proc-cgroup"
    _write(proc, f"0::{max(levels, key=len)}\n")
    return root, proc


def test_v2_limit_minus_working_set(tmp_path):
    root, proc = _v2(tmp_path, {"/": ("max", 10 * GiB, 0), "/job": (str(2 * GiB), GiB, GiB // 4)})
    # 2 GiB limit, 1 GiB used of which a quarter is reclaimable file pages: 1.25 GiB of room.
    assert cgroup_room(root, proc) == 2 * GiB - (GiB - GiB // 4)
    assert memory_room(root, proc) == min(psutil.virtual_memory().available, 2 * GiB - 3 * GiB // 4)


def test_the_tightest_ancestor_decides(tmp_path):
    root, proc = _v2(tmp_path, {"/": ("max", 0, 0), "/a": (str(GiB), 900 << 20, 0),
                                "/a/b": (str(4 * GiB), 100 << 20, 0)})
    assert cgroup_room(root, proc) == GiB - (900 << 20)


def test_no_limit_is_the_hosts_available_memory(tmp_path):
    root, proc = _v2(tmp_path, {"/": ("max", 5 * GiB, 0), "/job": ("max", GiB, 0)})
    assert cgroup_room(root, proc) is None
    assert abs(memory_room(root, proc) - psutil.virtual_memory().available) < 256 << 20


def test_v1_memory_controller(tmp_path):
    root = tmp_path / "cgroup"
    here = root / "memory" / "docker" / "abc"
    _write(here / "memory.limit_in_bytes", f"{GiB}\n")
    _write(here / "memory.usage_in_bytes", f"{600 << 20}\n")
    _write(here / "memory.stat", f"cache 100\ntotal_inactive_file {100 << 20}\n")
    _write(root / "memory" / "memory.limit_in_bytes", "9223372036854771712\n")  # unlimited at the top
    proc = tmp_path / "proc-cgroup"
    _write(proc, "12:cpu,cpuacct:/docker/abc\n4:memory:/docker/abc\n0::/\n")
    assert cgroup_room(root, proc) == GiB - (500 << 20)


def test_an_overfull_cgroup_has_no_room_and_garbage_is_ignored(tmp_path):
    root, proc = _v2(tmp_path, {"/job": (str(GiB), 2 * GiB, 0)})
    assert cgroup_room(root, proc) == 0
    _write(proc, "garbage\n::\n")
    assert cgroup_room(root, proc) is None
    assert cgroup_room(root, tmp_path / "missing") is None


def test_this_process(tmp_path):
    room = memory_room()
    assert 0 < room <= psutil.virtual_memory().total
