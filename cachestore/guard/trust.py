"""Whose files a job takes as its own: the trust model of a shared prefix or bucket.

A prefix on a cluster is often a group scratch folder that other users can write to. Whoever
can write there can rename a job's directories aside and put their own in their place, with
correct names, sizes and checksums: nothing in the bytes tells such a generation from the job's
own. What does is who owns it. So a job trusts what its own user wrote (and root's files); a
generation, a staging area, a rotation window or a rank file owned by another user is served,
adopted or joined only where the user named those writers (``trusted_uids``, ``trusted_gids``).
A file of another user is otherwise :class:`~cachestore.errors.UntrustedOwnerError`, or damage
the job replaces with its own (see docs/ARCHITECTURE.md, "Untrusted stores").

A prefix that others may write without the sticky bit lets them rename and remove the job's
entries too: :func:`warn_if_shared` says so once per path.
"""

from __future__ import annotations

import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Iterable

from ..errors import UntrustedOwnerError

log = logging.getLogger(__name__)

_warned: set[str] = set()  # paths already warned about in this process: one warning each


@dataclass(frozen=True)
class Trust:
    """The users and groups whose files a job takes as its own, besides its own user and root.

    Parameters
    ----------
    uids
        Other users whose generations, staging areas, windows and rank files are served or joined.
    gids
        Groups: a file whose group is one of these is trusted (its owner is a member).
    """

    uids: frozenset[int] = field(default_factory=frozenset)
    gids: frozenset[int] = field(default_factory=frozenset)

    @classmethod
    def of(cls, uids: Iterable[int] | None = None, gids: Iterable[int] | None = None) -> Trust:
        """A :class:`Trust` from user-given ids, each checked to be a non-negative int.

        Raises
        ------
        TypeError
            An id that is not an int (a user name: give ``pwd.getpwnam(name).pw_uid``).
        """
        return cls(_ids(uids, "trusted_uids"), _ids(gids, "trusted_gids"))

    def trusts(self, st: os.stat_result) -> bool:
        """Whether a file with the status `st` is this job's to read: its own user's, root's, or one named."""
        return st.st_uid in (os.geteuid(), 0) or st.st_uid in self.uids or st.st_gid in self.gids

    def why_not(self, path: str | os.PathLike[str], st: os.stat_result, what: str) -> str | None:
        """``None`` when `st` (of `path`) is trusted, else why not, in words a message can hold."""
        if self.trusts(st):
            return None
        return (f"{what} {path} belongs to user {st.st_uid} (group {st.st_gid}), not to this job's user "
                f"{os.geteuid()}: another user wrote it, and this job trusts only its own files; name that "
                "user in trusted_uids (or its group in trusted_gids) to share it")

    def check(self, path: str | os.PathLike[str], st: os.stat_result, what: str) -> None:
        """Raise :class:`UntrustedOwnerError` naming `path` unless `st` (its status) is trusted."""
        why = self.why_not(path, st, what)
        if why is not None:
            raise UntrustedOwnerError(why)

    def check_fd(self, fd: int, path: str | os.PathLike[str], what: str) -> None:
        """:meth:`check` of the file open at `fd` (the file read, whatever its name now names)."""
        self.check(path, os.fstat(fd), what)


#: What a job trusts when the user named no one: its own user and root.
OWN = Trust()


def _ids(values: Iterable[int] | None, name: str) -> frozenset[int]:
    if values is None:
        return frozenset()
    if isinstance(values, (str, bytes)):
        raise TypeError(f"{name} takes numeric ids (a list of ints), not {values!r}")
    ids = list(values)
    for value in ids:
        if type(value) is not int or value < 0:
            raise TypeError(f"{name} takes numeric ids >= 0, not {value!r} (a name: pwd.getpwnam(name).pw_uid, "
                            "grp.getgrnam(name).gr_gid)")
    return frozenset(ids)


def open_to_others(st: os.stat_result) -> bool:
    """Whether a directory with the status `st` lets other users rename and remove what is in it:
    writable by group or others, without the sticky bit (as ``/tmp`` has)."""
    return bool(st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)) and not st.st_mode & stat.S_ISVTX


def warn_if_shared(path: str | os.PathLike[str]) -> None:
    """Log one warning per process and path when `path` (a prefix) or its parent is writable by others
    without the sticky bit."""
    for where in (os.fspath(path), os.path.dirname(os.path.abspath(path))):
        if where in _warned:
            continue
        try:
            st = os.stat(where)
        except OSError:
            continue
        if open_to_others(st):
            _warned.add(where)
            log.warning("%s is writable by other users without the sticky bit (mode %o): they can rename and "
                        "replace this job's files there. Their files are not served (only this user's, and "
                        "trusted_uids / trusted_gids), but a job can be made to fail or recompute: "
                        "`chmod +t %s`, or a prefix of your own", where, stat.S_IMODE(st.st_mode), where)
