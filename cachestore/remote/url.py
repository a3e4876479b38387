"""Remote addresses: ``s3://bucket/path`` (any S3-compatible store) and ``file:///shared/path``.

A remote URL names a *root*: every store published there lives under its own key below it
(see :mod:`.layout`), so one root serves any number of datasets. Credentials never go in
a URL (they would end up in logs, ``store.json`` files and error messages): they come from
the environment or ``storage_options`` (:mod:`.settings`).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

from .errors import RemoteConfigError

SCHEMES = ("s3", "file")
#: S3 bucket names (the rules of AWS, which every S3-compatible store accepts).
_BUCKET = re.compile(r"^[a-z0-9][a-z0-9.-]{1,61}[a-z0-9]$")
#: One segment of a key prefix: no empty, ``.`` or ``..`` segment, no control characters.
_SEGMENT = re.compile(r"^[A-Za-z0-9_.=+@,-]{1,255}$")


def is_remote_url(text: object) -> bool:
    """Whether `text` is a remote address (``s3://`` or ``file://``), not a local path."""
    return isinstance(text, str) and text.split("://", 1)[0] in SCHEMES and "://" in text


@dataclass(frozen=True)
class RemoteURL:
    """A parsed remote root: ``scheme`` ``s3`` (``bucket``, ``prefix``) or ``file`` (``path``).

    ``prefix`` is the key prefix inside the bucket, without leading or trailing ``/``
    (``""`` for the bucket's root); ``path`` is the absolute directory of a ``file://`` root.
    """

    scheme: str
    bucket: str = ""
    prefix: str = ""
    path: str = ""

    def __str__(self) -> str:
        if self.scheme == "s3":
            return f"s3://{self.bucket}/{self.prefix}".rstrip("/")
        return f"file://{self.path}"

    def child(self, key: str) -> "RemoteURL":
        """The root `key` below this one (a store's own key)."""
        check_key(key)
        if self.scheme == "s3":
            return RemoteURL("s3", self.bucket, f"{self.prefix}/{key}".strip("/"))
        return RemoteURL("file", path=f"{self.path.rstrip('/')}/{key}")


def check_key(key: str) -> str:
    """`key` when every ``/``-separated segment of it is a plain name (no ``..``, no empty one)."""
    segments = key.split("/")
    if not key or any(not _SEGMENT.match(s) or s in (".", "..") for s in segments):
        raise RemoteConfigError(f"{key!r} is not a valid object key (plain names separated by '/', no '..')")
    return key


def parse_url(url: str) -> RemoteURL:
    """Parse a remote root URL.

    Raises
    ------
    RemoteConfigError
        Another scheme, a bucket name S3 refuses, ``..`` in the path, or credentials or a
        query in the URL (they belong in the environment or ``storage_options``).
    """
    if not isinstance(url, str) or not is_remote_url(url):
        raise RemoteConfigError(f"{url!r} is not a remote URL; give s3://bucket/path or file:///shared/path")
    parts = urlsplit(url)
    if parts.query or parts.fragment:
        raise RemoteConfigError(f"{_shown(url)}: a remote URL takes no query or fragment; "
                                "pass options as storage_options")
    if "@" in parts.netloc:
        raise RemoteConfigError("a remote URL must not hold credentials (user:secret@...): set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY in the environment, or pass storage_options")
    path = unquote(parts.path)
    if parts.scheme == "file":
        if parts.netloc not in ("", "localhost"):
            raise RemoteConfigError(f"{url!r}: a file:// URL names a local directory (file:///shared/path)")
        if not path.startswith("/") or path.rstrip("/") == "":
            raise RemoteConfigError(f"{url!r}: a file:// URL needs an absolute directory other than /")
        inner = path.strip("/")
        check_key(inner)
        return RemoteURL("file", path="/" + inner)
    bucket = parts.netloc
    if not _BUCKET.match(bucket) or ".." in bucket:
        raise RemoteConfigError(f"{url!r}: {bucket!r} is not a valid bucket name")
    prefix = path.strip("/")
    if prefix:
        check_key(prefix)
    return RemoteURL("s3", bucket, prefix)


def _shown(url: str) -> str:
    """`url` without its query (which might hold a signature or a token)."""
    return url.split("?", 1)[0]
