"""A memory limit for a benchmark's reading process, and cold page caches.

:func:`child_memory_cgroup` makes a child memory cgroup under this process's
own (v1 ``memory.limit_in_bytes`` or v2 ``memory.max``) and removes it when
done; :func:`command_in` starts a command inside it. Nothing else is touched:
no other cgroup is written, and the child is only made when running as root.
:func:`evict` drops a directory's files from the page cache, so the next read
of them goes to the disk.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


class CgroupRefused(OSError):
    """No child memory cgroup could be made here; the message says why."""


@dataclass(frozen=True)
class MemoryCgroup:
    """A child memory cgroup: its directory, its limit in bytes, and the cgroup version (1 or 2)."""

    path: Path
    limit: int
    version: int

    @property
    def procs(self) -> Path:
        return self.path / "cgroup.procs"

    def peak(self) -> int | None:
        """The most memory (pages of files included) the cgroup held since :meth:`reset_peak`, if known."""
        name = "memory.max_usage_in_bytes" if self.version == 1 else "memory.peak"
        try:
            return int((self.path / name).read_text().split()[0])
        except (OSError, ValueError, IndexError):
            return None

    def reset_peak(self) -> None:
        """Start a new peak (v1 only: v2's ``memory.peak`` cannot be reset on every kernel)."""
        if self.version == 1:
            with contextlib.suppress(OSError):
                (self.path / "memory.max_usage_in_bytes").write_text("0")


def own_memory_cgroup(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> tuple[Path, str, int]:
    """This process's memory cgroup: ``(directory, limit file, version)``.

    Raises
    ------
    CgroupRefused
        The process has no memory cgroup that this module knows how to find.
    """
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError as exc:
        raise CgroupRefused(f"cannot read {proc_cgroup}: {exc}") from None
    for line in lines:  # v1 first: where both exist, the memory controller lives in v1
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if "memory" in controllers.split(",") and (root / "memory").is_dir():
            return root / "memory" / path.strip("/"), "memory.limit_in_bytes", 1
    for line in lines:
        if line.startswith("0::"):
            base = root / "unified" if (root / "unified").is_dir() else root
            return base / line[3:].strip("/"), "memory.max", 2
    raise CgroupRefused("this process has no memory cgroup")


def create_child(limit: int, name: str) -> MemoryCgroup:
    """A new child memory cgroup `name` of this process's own, limited to `limit` bytes.

    Raises
    ------
    CgroupRefused
        Not root, no memory cgroup, or the kernel refused the directory or the limit
        (e.g. v2 without the memory controller delegated to children).
    """
    if os.geteuid() != 0:
        raise CgroupRefused("creating a memory cgroup needs root")
    base, limit_file, version = own_memory_cgroup()
    child = base / name
    try:
        child.mkdir()
    except OSError as exc:
        raise CgroupRefused(f"cannot create {child}: {exc}") from None
    try:
        (child / limit_file).write_text(str(limit))
        if int((child / limit_file).read_text().strip()) > limit:
            raise OSError(f"{limit_file} did not take the limit")
    except (OSError, ValueError) as exc:
        remove(child)
        raise CgroupRefused(f"cannot limit {child}: {exc}") from None
    return MemoryCgroup(child, limit, version)


def remove(path: Path, tries: int = 50) -> bool:
    """Remove an empty cgroup directory; True when gone.

    Its last process may have exited a moment ago, and the kernel releases the
    cgroup a little later: try again for a few seconds.
    """
    for _ in range(tries):
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.1)
    return not path.exists()


@contextlib.contextmanager
def child_memory_cgroup(limit: int, name: str | None = None) -> Iterator[MemoryCgroup]:
    """:func:`create_child` for the duration of a ``with`` block, removed after it (raises :class:`CgroupRefused`)."""
    cg = create_child(limit, name or f"cachestore-bench-{os.getpid()}")
    try:
        yield cg
    finally:
        if not remove(cg.path):
            raise OSError(f"could not remove the memory cgroup {cg.path}: processes left in it?")


def command_in(cg: MemoryCgroup | None, argv: list[str]) -> list[str]:
    """`argv` started inside `cg` (the shell moves itself in, then execs it); `argv` itself when ``None``."""
    if cg is None:
        return argv
    return ["sh", "-c", 'echo $$ > "$0" && exec "$@"', str(cg.procs), *argv]


def store_files(root: str | os.PathLike[str]) -> list[Path]:
    """Every regular file under `root`, sorted by path."""
    return sorted(p for p in Path(root).rglob("*") if p.is_file() and not p.is_symlink())


def evict(root: str | os.PathLike[str]) -> None:
    """Drop every file under `root` from the page cache.

    Dirty pages are written first (``os.sync``): ``POSIX_FADV_DONTNEED`` skips
    them. Pages some process still maps stay. Only these files are touched,
    unlike ``/proc/sys/vm/drop_caches``, which would empty the whole machine's
    cache under every other process.
    """
    os.sync()
    for path in store_files(root):
        try:
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_bounded(argv: list[str], timeout: float, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run `argv` in a session of its own; on timeout (or interrupt) its whole process group is killed.

    The reading processes start loader workers and torch workers: killing only
    the process we started would leave them behind (and its cgroup busy).
    """
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, **kwargs)  # type: ignore[call-overload]
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        _kill_group(proc.pid)
        out, err = proc.communicate()
        err += f"\nkilled after {timeout:g} s"
    except BaseException:
        _kill_group(proc.pid)
        proc.wait()
        raise
    _kill_group(proc.pid)  # a worker that outlived its parent still holds the group (and the cgroup)
    return subprocess.CompletedProcess(argv, proc.returncode, out, err)


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, 9)
