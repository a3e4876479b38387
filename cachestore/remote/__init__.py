"""The remote tier: generations published on an object store (``s3://``) or a shared file system
(``file://``), computed once and read by every node.

Importing this package imports nothing of the ``remote`` extra (obstore): a client is built on
first use, with an actionable error when the extra is missing.

The store-level API (the loader builds on it)::

    remote = open_remote("s3://bucket/path", local=store)     # the store of `store`'s fingerprint
    handle = remote.publish(store, g)                          # background; handle.wait()
    remote.fetch(store, g)                                     # download, verify, commit locally
    reader = remote.reader(g)                                  # direct reads, a map-style dataset
    claim = remote.claim_part(g, k, m, timeout=...)            # node k computes part k of m ...
    remote.publish_part(store, staging_path, g, n, k, m)       # ... publishes it from its staging area
    remote.fetch_parts(store, g, m, into=staging_path, parts=[...])   # and places the others there
    remote.remote_generations()                                # complete ones, parts published/claimed

Layout on the remote: :mod:`.layout`; documents: :mod:`.manifest`; settings and credentials:
:mod:`.settings`. See docs/ARCHITECTURE.md, "The remote tier".
"""

from __future__ import annotations

from .errors import (ExtraMissingError, ObjectNotFoundError, RemoteConfigError, RemoteCorruptError, RemoteError,
                     RemoteForkError, RemoteManifestError)
from .settings import RemoteSettings, redact, remote_settings
from .store import RemoteStore, open_remote
from .url import RemoteURL, is_remote_url, parse_url

__all__ = ["ExtraMissingError", "ObjectNotFoundError", "RemoteConfigError", "RemoteCorruptError", "RemoteError",
           "RemoteForkError", "RemoteManifestError", "RemoteSettings", "RemoteStore", "RemoteURL", "is_remote_url", "open_remote",
           "parse_url", "redact", "remote_settings"]
