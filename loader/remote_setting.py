"""The remote keys of ``cache_setting``, checked once; and which node of how many this process is.

``remote`` is parsed by :func:`cachestore.remote.parse_url` (imported only when a remote is
asked for: the package is importable without the ``remote`` extra, and the core never
needs it). ``storage_options`` stays out of every repr, log line and state (credentials).
"""

from __future__ import annotations

import math
import os


def _positive(key: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0 or math.isnan(value):
        raise ValueError(f"cache_setting[{key!r}] must be a number of seconds > 0, got {value!r}")
    return float(value)


def check_remote_settings(cache: object) -> None:
    """Check ``remote``, ``storage_options``, the timeouts, ``nb_node`` and ``node_rank`` of `cache` (a
    :class:`~loader.settings.CacheSettings`), with a ValueError naming the key."""
    remote, backend, options = getattr(cache, "remote"), getattr(cache, "backend"), getattr(cache, "storage_options")
    nb_node, node_rank = getattr(cache, "nb_node"), getattr(cache, "node_rank")
    if remote is not None:
        from cachestore.remote.errors import RemoteConfigError
        from cachestore.remote.url import parse_url

        if not isinstance(remote, str):
            raise ValueError(f"cache_setting['remote'] must be a URL string (s3://bucket/path or file:///path), got "
                             f"{type(remote).__name__}")
        try:
            parse_url(remote)
        except (RemoteConfigError, ValueError) as exc:
            raise ValueError(f"cache_setting['remote']: {exc}") from None
        if backend == "memory":
            raise ValueError("cache_setting['remote'] publishes stores on disk; backend='memory' holds nothing "
                             "to publish (use 'memmap', the default, or 'lmdb')")
    if options is not None and not isinstance(options, dict):
        raise ValueError("cache_setting['storage_options'] must be a dict (endpoint, region, credentials)")
    _positive("start_timeout", getattr(cache, "start_timeout"))
    _positive("part_timeout", getattr(cache, "part_timeout"))
    for key, value in (("nb_node", nb_node), ("node_rank", node_rank)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < (key == "nb_node")):
            raise ValueError(f"cache_setting[{key!r}] must be an int >= {int(key == 'nb_node')}, got {value!r}")
    if (nb_node is None) != (node_rank is None):
        raise ValueError("cache_setting['nb_node'] and ['node_rank'] go together (or both from torchrun's environment)")
    if nb_node is not None and node_rank is not None and node_rank >= nb_node:
        raise ValueError(f"cache_setting['node_rank'] {node_rank} must be < nb_node {nb_node}")


def node_of(nb_node: int | None, node_rank: int | None, nb_consumer: int) -> tuple[int, int]:
    """``(nodes, node)``: ``cache_setting``'s `nb_node`/`node_rank`, else torchrun's (``WORLD_SIZE //
    LOCAL_WORLD_SIZE``, ``GROUP_RANK``) when they describe the `nb_consumer` consumers, else one node."""
    if nb_node is not None and node_rank is not None:
        return nb_node, node_rank
    env = os.environ
    world, local, group = env.get("WORLD_SIZE", ""), env.get("LOCAL_WORLD_SIZE", ""), env.get("GROUP_RANK", "")
    if world.isdigit() and local.isdigit() and group.isdigit() and int(local) > 0 and int(world) == nb_consumer \
            and nb_consumer % int(local) == 0 and int(group) < nb_consumer // int(local):
        return nb_consumer // int(local), int(group)
    return 1, 0
