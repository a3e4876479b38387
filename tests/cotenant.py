"""A co-tenant: another user of a prefix that everyone may write (mode 0777, no sticky bit).

Tests run as root; a co-tenant is a forked child that drops to :data:`OTHER` (its uid and gid)
before it acts, so what it makes belongs to another user, and it can do only what the prefix's
mode lets any user do: rename, replace and plant entries. :func:`as_cotenant` waits for it with
a timeout (a pidfd, no polling), so a co-tenant that hangs fails the test.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import tempfile
import traceback
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

#: The co-tenant's uid and gid: no user of this machine.
OTHER = 4242
#: Seconds a co-tenant may take.
COTENANT_WAIT = 60.0


def as_cotenant(action: Callable[..., Any], *args: Any, timeout: float = COTENANT_WAIT) -> None:
    """Run ``action(*args)`` in a child process as user :data:`OTHER`; fail if it raises or hangs."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.setgroups([])
            os.setgid(OTHER)
            os.setuid(OTHER)
            os.umask(0o022)
            action(*args)
            code = 0
        except BaseException:
            traceback.print_exc()
        finally:
            os._exit(code)
    fd = os.pidfd_open(pid)
    try:
        ready, _, _ = select.select([fd], [], [], timeout)
        if not ready:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            raise AssertionError(f"the co-tenant did not finish within {timeout} s")
    finally:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the co-tenant failed (its traceback is above)"


@pytest.fixture
def shared_prefix() -> Iterator[Path]:
    """A directory every user may write, without the sticky bit (a group scratch folder)."""
    path = Path(tempfile.mkdtemp(prefix="cotenant-", dir="/tmp"))  # /tmp: every user can reach it
    os.chmod(path, 0o777)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def owned_by_other(path: str | os.PathLike[str]) -> None:
    """Hand `path` (and what is under it) to :data:`OTHER`, as if that user had made it."""
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.lchown(os.path.join(root, name), OTHER, OTHER)
    os.lchown(path, OTHER, OTHER)
