"""The object-store client: obstore, imported on first use, behind a few plain methods.

Why obstore (the ``remote`` extra): its requests are served by a Rust runtime with the
GIL released, it serves several times more small requests per second than boto3, it
coalesces nearby ranged reads into one request (``get_ranges``, what direct reads of
runs of records need), it retries 5xx answers (503 SlowDown) and dropped connections
with backoff on its own, and it has no dependency of its own (boto3 and s3fs pin
conflicting botocore versions). The core of cachestore never imports it: only building
a :class:`Client` does, with an actionable error when the extra is missing.

Every error leaves here as a :class:`~.errors.RemoteError` (or a subclass) whose message
names the operation and the key, and holds no credential (:func:`.settings.redact`).
"""

from __future__ import annotations

import importlib
import os
from dataclasses import dataclass
from datetime import datetime, timedelta, timezone
from types import ModuleType
from typing import Any, Callable, Iterator, Sequence, TypeVar

from .errors import ExtraMissingError, ObjectNotFoundError, RemoteError, RemoteForkError, RemoteManifestError
from .settings import RemoteSettings, redact
from .url import check_key

T = TypeVar("T")

#: The process whose requests started obstore's runtime (its threads, one per process). A process forked
#: from it inherits the runtime without its threads: a request there waits for ever (or crashes), whatever
#: client makes it. Process-wide by nature, as the runtime is.
_runtime_pid: int | None = None


def runtime_started() -> bool:
    """Whether this process made requests (so a process forked from it now cannot make any)."""
    return _runtime_pid == os.getpid()


def check_not_forked() -> None:
    """Refuse to make requests in a process forked from one that made some (they would hang).

    Raises
    ------
    RemoteForkError
        This process was forked after its parent used a remote.
    """
    if _runtime_pid is not None and _runtime_pid != os.getpid():
        raise RemoteForkError(
            f"this process (pid {os.getpid()}) was forked from process {_runtime_pid} after that one used a remote "
            "store: the remote client's runtime does not survive a fork, and its requests would never finish. "
            "Start the worker processes with spawn or forkserver instead: torch.utils.data.DataLoader(..., "
            "multiprocessing_context='spawn'), or multiprocessing.get_context('spawn'); a remote reader pickles "
            "without credentials and reopens in each (CachedLoader's start_method='auto' spawns by itself)")


def obstore_module() -> ModuleType:
    """The ``obstore`` package; :class:`ExtraMissingError` with the install command when it is missing."""
    try:
        return importlib.import_module("obstore")
    except ImportError as exc:
        raise ExtraMissingError("the remote tier (s3:// and file:// remotes) needs the 'remote' extra: "
                                "pip install 'cachestore[remote]' (it installs obstore)") from exc


@dataclass(frozen=True)
class ObjectInfo:
    """An object's key (relative to the client's root), size and last modification (the server's clock)."""

    key: str
    size: int
    modified: float


class Client:
    """Requests to one remote root (:class:`RemoteSettings`); thread-safe, one per process and root.

    Keys are relative to the root and checked (:func:`.url.check_key`): no ``..``, no empty segment.
    """

    def __init__(self, settings: RemoteSettings, *, retry_timeout: float | None = None) -> None:
        check_not_forked()
        self.settings = settings
        self._ob = obstore_module()
        self._exc = importlib.import_module("obstore.exceptions")
        store_mod = importlib.import_module("obstore.store")
        url = settings.url
        retry = {"max_retries": settings.max_retries,
                 "retry_timeout": timedelta(seconds=retry_timeout or settings.retry_timeout),
                 "backoff": {"init_backoff": timedelta(milliseconds=50), "max_backoff": timedelta(seconds=5),
                             "base": 2}}
        if url.scheme == "file":
            self._store: Any = store_mod.LocalStore(url.path, mkdir=True)
            return
        config: dict[str, object] = {"region": settings.region,
                                     "virtual_hosted_style_request": settings.virtual_hosted_style_request}
        if settings.endpoint is not None:
            config["endpoint"] = settings.endpoint
        creds = settings.credentials
        if creds is not None:
            config["access_key_id"] = creds.access_key_id
            config["secret_access_key"] = creds.secret_access_key
            if creds.session_token:
                config["session_token"] = creds.session_token
        else:
            config["skip_signature"] = True  # anonymous: a public bucket, or an error that says what to set
        client_options = {"allow_http": settings.allow_http, "timeout": timedelta(seconds=settings.timeout),
                          "connect_timeout": timedelta(seconds=settings.connect_timeout)}
        try:
            self._store = store_mod.S3Store(url.bucket, prefix=url.prefix or None, config=config,
                                            client_options=client_options, retry_config=retry)
        except Exception as exc:  # obstore's configuration errors
            raise RemoteError(f"cannot set up a client for {url}: {redact(str(exc))}") from None

    def __repr__(self) -> str:
        return f"Client({str(self.settings.url)!r})"

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("a remote client is not pickled; pickle its RemoteSettings (without credentials)")

    # plumbing ---------------------------------------------------------------
    def _call(self, what: str, key: str, fn: Callable[[], T]) -> T:
        global _runtime_pid
        check_not_forked()
        _runtime_pid = os.getpid()
        try:
            return fn()
        except (self._exc.NotFoundError, FileNotFoundError):
            err = ObjectNotFoundError(f"{what} {self._where(key)}: no such object")
            err.key = key
            raise err from None
        except (self._exc.PermissionDeniedError, self._exc.UnauthenticatedError) as exc:
            hint = "" if self.settings.credentials is not None else f" ({self.settings.missing_credentials_hint()})"
            raise RemoteError(f"{what} {self._where(key)} was refused: {_short(exc)}{hint}") from None
        except (self._exc.BaseError, OSError, RuntimeError) as exc:
            raise RemoteError(f"{what} {self._where(key)} failed: {_short(exc)}") from None

    def _where(self, key: str) -> str:
        return f"{str(self.settings.url).rstrip('/')}/{key}" if key else str(self.settings.url)

    # requests ---------------------------------------------------------------
    def put(self, key: str, data: bytes | bytearray | memoryview) -> None:
        """Write object `key` (whole or not at all)."""
        check_key(key)
        self._call("writing", key, lambda: self._ob.put(self._store, key, data, use_multipart=False))

    def put_new(self, key: str, data: bytes) -> bool:
        """Create object `key` only if it does not exist (a conditional put); ``False`` when it does."""
        check_key(key)

        def run() -> bool:
            try:
                self._ob.put(self._store, key, data, mode="create")
            except (self._exc.AlreadyExistsError, self._exc.PreconditionError):
                return False
            return True
        return self._call("creating", key, run)

    def get(self, key: str) -> bytes:
        """The whole object `key`."""
        check_key(key)
        return self._call("reading", key, lambda: bytes(self._ob.get(self._store, key).bytes()))

    def get_document(self, key: str, limit: int) -> bytes:
        """The whole object `key` when it takes at most `limit` bytes (a manifest, ``store.json``).

        Its size is looked up first and no more than that is read: an object anyone with write
        access made huge is refused before its bytes travel (a remote is untrusted input).

        Raises
        ------
        ObjectNotFoundError
            `key` is not there.
        RemoteManifestError
            It takes more than `limit` bytes.
        """
        info = self.head(key)
        if info is None:
            exc = ObjectNotFoundError(f"{self._where(key)} is not there")
            exc.key = key
            raise exc
        if info.size > limit:
            raise RemoteManifestError(f"{self._where(key)}: {info.size} bytes, more than a document of the remote "
                                      f"may hold ({limit}); the remote is damaged or was written by something else")
        if not info.size:
            return b""
        found = self._call("reading", key, lambda: self._ob.get_ranges(self._store, key, starts=[0], ends=[info.size]))
        return bytes(found[0])

    def get_ranges(self, key: str, starts: Sequence[int], ends: Sequence[int]) -> list[memoryview]:
        """Byte ranges ``[starts[j], ends[j])`` of object `key`; nearby ranges travel in one request."""
        check_key(key)
        if not starts:
            return []
        found = self._call("reading", key, lambda: self._ob.get_ranges(self._store, key, starts=list(starts),
                                                                         ends=list(ends)))
        return [memoryview(b) for b in found]

    def stream_range(self, key: str, start: int, end: int, piece_bytes: int) -> Iterator[memoryview]:
        """Bytes ``[start, end)`` of object `key` in one request, handed over as they arrive, in pieces of
        at least `piece_bytes` (the last may be shorter); a dropped connection is resumed by obstore."""
        check_key(key)
        if end <= start:
            return
        found = self._call("reading", key, lambda: self._ob.get(self._store, key, options={"range": (start, end)}))
        stream = iter(found.stream(min_chunk_size=piece_bytes))
        while True:
            buf = self._call("reading", key, lambda: next(stream, None))
            if buf is None:
                return
            yield memoryview(buf)

    def head(self, key: str) -> ObjectInfo | None:
        """Size and modification time of object `key`, ``None`` when it is not there."""
        check_key(key)
        try:
            meta = self._call("looking up", key, lambda: self._ob.head(self._store, key))
        except ObjectNotFoundError:
            return None
        return _info(meta)

    def list_objects(self, prefix: str) -> list[ObjectInfo]:
        """Every object whose key starts with ``prefix/`` (recursively)."""
        check_key(prefix)

        def run() -> list[ObjectInfo]:
            return [_info(m) for batch in self._ob.list(self._store, prefix + "/", chunk_size=1000) for m in batch]
        return self._call("listing", prefix + "/", run)

    def list_dirs(self, prefix: str = "") -> list[str]:
        """The names of the "directories" right below ``prefix/`` (the root when empty)."""
        if prefix:
            check_key(prefix)
        found = self._call("listing", prefix, lambda: self._ob.list_with_delimiter(self._store, prefix or None))
        names = [str(p).rstrip("/").rsplit("/", 1)[-1] for p in found["common_prefixes"]]
        return sorted(names)

    def delete(self, keys: Sequence[str]) -> None:
        """Remove objects `keys` (those already gone are fine)."""
        for key in keys:
            check_key(key)
        for lo in range(0, len(keys), 500):
            batch = list(keys[lo:lo + 500])
            try:
                self._call("removing", batch[0] if batch else "", lambda: self._ob.delete(self._store, batch))
            except ObjectNotFoundError:
                pass


def _info(meta: Any) -> ObjectInfo:
    modified = meta.get("last_modified")
    when = modified.timestamp() if isinstance(modified, datetime) else datetime.now(timezone.utc).timestamp()
    return ObjectInfo(str(meta["path"]), int(meta["size"]), when)


def _short(exc: BaseException) -> str:
    """The first line of an obstore error (its XML body and debug details cut), credentials redacted."""
    text = redact(str(exc)).strip()
    first = text.split("\n", 1)[0]
    return first[:400]
