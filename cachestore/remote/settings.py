"""Where a remote is and how to reach it: endpoint, region, credentials, client options.

Settings come from the usual environment variables (``AWS_ENDPOINT_URL``,
``AWS_ACCESS_KEY_ID``, ``AWS_SECRET_ACCESS_KEY``, ``AWS_SESSION_TOKEN``, ``AWS_REGION``)
and from a ``storage_options`` dict, which wins key by key. An ``http://`` endpoint (a
server on this machine) is allowed as given.

Credentials are kept out of everything that leaves the process or is shown: a
:class:`RemoteSettings` pickles without them (a process that unpickles one takes them from its
own environment, or from this process's registry when it is a forked child of the one that
was given them), its repr names only where they came from, and every message of a remote
error passes through :func:`redact`.
"""

from __future__ import annotations

import os
import secrets
import threading
from dataclasses import dataclass, field, replace
from typing import Mapping

from .errors import RemoteConfigError
from .url import RemoteURL, parse_url

#: ``storage_options`` keys, each with the names it is also known by (those of obstore, fsspec and boto).
OPTION_ALIASES: dict[str, tuple[str, ...]] = {
    "endpoint": ("endpoint_url", "aws_endpoint_url", "aws_endpoint"),
    "region": ("aws_region", "region_name", "aws_default_region"),
    "access_key_id": ("aws_access_key_id", "key"),
    "secret_access_key": ("aws_secret_access_key", "secret"),
    "session_token": ("aws_session_token", "token"),
    "allow_http": (),
    "virtual_hosted_style_request": (),
    "timeout": (),  # seconds a request may take
    "connect_timeout": (),
    "max_retries": (),  # retries of one request; retry_timeout bounds them first (a server restart: seconds)
    "retry_timeout": (),  # seconds of retries (503 SlowDown, dropped connections) before giving up
    "conditional_put": (),  # "auto" (probe the server), True, False (see parts.py)
    "concurrency": (),  # requests in flight for a publish or a fetch
}
_CANONICAL = {alias: key for key, aliases in OPTION_ALIASES.items() for alias in (key, *aliases)}
_SECRET_KEYS = ("access_key_id", "secret_access_key", "session_token")

_KNOWN_SECRETS: set[str] = set()
_KNOWN_LOCK = threading.Lock()
#: Credentials given as storage_options, by reference: a forked child finds them, a pickle never holds them.
_REGISTRY: dict[str, "Credentials"] = {}


def redact(text: str) -> str:
    """`text` with every credential this process knows replaced by ``***``."""
    with _KNOWN_LOCK:
        known = sorted(_KNOWN_SECRETS, key=len, reverse=True)
    for value in known:
        text = text.replace(value, "***")
    return text


def _remember(value: str | None) -> None:
    if value and len(value) >= 4:
        with _KNOWN_LOCK:
            _KNOWN_SECRETS.add(value)


@dataclass(frozen=True)
class Credentials:
    """An access key pair (and session token); shown as ``Credentials(<source>)`` only."""

    access_key_id: str = field(repr=False)
    secret_access_key: str = field(repr=False)
    session_token: str | None = field(default=None, repr=False)
    source: str = "environment"

    def __post_init__(self) -> None:
        for value in (self.access_key_id, self.secret_access_key, self.session_token):
            _remember(value)

    def __reduce__(self) -> tuple[object, ...]:
        raise TypeError("credentials are never pickled; a process takes them from its environment")


def _env(name: str, *more: str) -> str | None:
    for key in (name, *more):
        value = os.environ.get(key)
        if value:
            return value
    return None


def _as_bool(key: str, value: object) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "yes", "false", "0", "no"):
        return value.lower() in ("true", "1", "yes")
    raise RemoteConfigError(f"storage_options[{key!r}] must be a boolean")


def _as_seconds(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < 1e6:
        raise RemoteConfigError(f"storage_options[{key!r}] must be a positive number of seconds")
    return float(value)


def _as_count(key: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= 1000:
        raise RemoteConfigError(f"storage_options[{key!r}] must be an int from 0 to 1000")
    return value


@dataclass(frozen=True)
class RemoteSettings:
    """A remote root and how to reach it; picklable, without its credentials (see the module docstring).

    Build with :func:`remote_settings`.
    """

    url: RemoteURL
    endpoint: str | None = None
    region: str = "us-east-1"
    allow_http: bool = False
    virtual_hosted_style_request: bool = False
    timeout: float = 60.0
    connect_timeout: float = 5.0
    max_retries: int = 40
    retry_timeout: float = 120.0
    conditional_put: str = "auto"
    concurrency: int = 8
    credentials: Credentials | None = field(default=None, repr=False, compare=False)
    #: Where credentials came from: "environment", "storage_options" (registry key ``ref``) or "none".
    credential_source: str = "none"
    ref: str = field(default="", repr=False, compare=False)

    def __getstate__(self) -> dict[str, object]:
        state = dict(self.__dict__)
        state["credentials"] = None
        return state

    def __setstate__(self, state: dict[str, object]) -> None:
        if state.get("credential_source") == "environment":
            state["credentials"] = _env_credentials()
        elif state.get("credential_source") == "storage_options":
            state["credentials"] = _REGISTRY.get(str(state.get("ref")))
        self.__dict__.update(state)

    def for_url(self, url: RemoteURL) -> "RemoteSettings":
        """The same settings for another root (a store's key below this one)."""
        return replace(self, url=url)

    def missing_credentials_hint(self) -> str:
        """Why this process has no credentials, and what to do about it."""
        if self.credential_source == "storage_options":
            return ("the credentials given in storage_options stay in the process that got them (a pickle never "
                    "holds them): set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY in this process's environment")
        return "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or pass them in storage_options)"


def _env_credentials() -> Credentials | None:
    key, secret = _env("AWS_ACCESS_KEY_ID"), _env("AWS_SECRET_ACCESS_KEY")
    if key is None or secret is None:
        return None
    return Credentials(key, secret, _env("AWS_SESSION_TOKEN"), "environment")


def _canonical(options: Mapping[str, object]) -> dict[str, object]:
    out: dict[str, object] = {}
    for name, value in options.items():
        key = _CANONICAL.get(str(name).lower())
        if key is None:
            raise RemoteConfigError(f"unknown storage option {str(name)!r}; known: {', '.join(OPTION_ALIASES)}")
        out[key] = value
    return out


def remote_settings(url: str | RemoteURL, storage_options: Mapping[str, object] | None = None) -> RemoteSettings:
    """The settings of the remote root `url`, from the environment and `storage_options`.

    Raises
    ------
    RemoteConfigError
        An invalid URL, an unknown option or a value of the wrong type (the message never
        repeats a value, which might be a credential).
    """
    root = url if isinstance(url, RemoteURL) else parse_url(url)
    opts = _canonical(dict(storage_options or {}))
    for key in _SECRET_KEYS:
        if key in opts and not isinstance(opts[key], str):
            raise RemoteConfigError(f"storage_options[{key!r}] must be a string")
    endpoint = opts.get("endpoint", _env("AWS_ENDPOINT_URL_S3", "AWS_ENDPOINT_URL"))
    if endpoint is not None and (not isinstance(endpoint, str) or not endpoint.startswith(("http://", "https://"))):
        raise RemoteConfigError("the endpoint must be an http:// or https:// URL")
    if isinstance(endpoint, str) and "@" in endpoint.split("//", 1)[1].split("/", 1)[0]:
        raise RemoteConfigError("the endpoint URL must not hold credentials; set AWS_ACCESS_KEY_ID and "
                                "AWS_SECRET_ACCESS_KEY instead")
    region = opts.get("region", _env("AWS_REGION", "AWS_DEFAULT_REGION") or "us-east-1")
    if not isinstance(region, str):
        raise RemoteConfigError("storage_options['region'] must be a string")
    credentials, source, ref = _credentials(opts)
    conditional = opts.get("conditional_put", "auto")
    if conditional != "auto":
        conditional = "yes" if _as_bool("conditional_put", conditional) else "no"
    concurrency = _as_count("concurrency", opts.get("concurrency", 8))
    # Enough retries that retry_timeout is the bound: ten of a backoff from 50 ms end within about a
    # second, less than a server takes to restart.
    max_retries = _as_count("max_retries", opts.get("max_retries", 40))
    return RemoteSettings(
        url=root, endpoint=endpoint.rstrip("/") if isinstance(endpoint, str) else None, region=region,
        # An http:// endpoint is a server the user named: it works as given.
        allow_http=_as_bool("allow_http", opts.get("allow_http", isinstance(endpoint, str)
                                                    and endpoint.startswith("http://"))),
        virtual_hosted_style_request=_as_bool("virtual_hosted_style_request",
                                              opts.get("virtual_hosted_style_request", False)),
        timeout=_as_seconds("timeout", opts.get("timeout", 60.0)),
        connect_timeout=_as_seconds("connect_timeout", opts.get("connect_timeout", 5.0)),
        max_retries=max_retries, retry_timeout=_as_seconds("retry_timeout", opts.get("retry_timeout", 120.0)),
        conditional_put=str(conditional), concurrency=max(1, concurrency),
        credentials=credentials, credential_source=source, ref=ref)


def _credentials(opts: dict[str, object]) -> tuple[Credentials | None, str, str]:
    given = [k for k in _SECRET_KEYS if k in opts]
    if not given:
        found = _env_credentials()
        return found, ("environment" if found is not None else "none"), ""
    if "access_key_id" not in opts or "secret_access_key" not in opts:
        raise RemoteConfigError("storage_options must give both access_key_id and secret_access_key")
    token = opts.get("session_token")
    credentials = Credentials(str(opts["access_key_id"]), str(opts["secret_access_key"]),
                              None if token is None else str(token), "storage_options")
    ref = secrets.token_hex(8)
    _REGISTRY[ref] = credentials
    return credentials, "storage_options", ref
