"""``dataset_server``'s ``DataLoader`` and ``AsyncDataLoader``, as :class:`~loader.CachedLoader` s."""

from __future__ import annotations

import logging
import math
from typing import Any, Callable

from .base import CompatLoader, check_pass_through, explain

log = logging.getLogger(__name__)


class DataLoader(CompatLoader):
    """``dataset_server.DataLoader`` (its shared-memory version), as a :class:`~loader.CachedLoader`.

    Parameters
    ----------
    dataset_class, dataset_params, batch_size, nb_worker
        As in ``CachedLoader`` (``nb_worker`` is required here, as there).
    max_minibatch_length
        Accepted, not needed: bytes of dataset_server's per-worker buffer;
        our shared-memory slots grow to fit any batch.
    max_queue_size, prefetch_time, device, pin_memory, gpu_indices, nearby_shuffle, collate_fn
        As in ``CachedLoader``.
    shuffle
        Default ``False``, as in dataset_server.
    cache_setting, rotation_setting
        As in ``CachedLoader`` (the same keys; ``prefix`` is a directory).
    use_threading
        Accepted, not needed: dataset_server's thread that polls the workers.
        (``CachedLoader(use_threading=True)`` means worker *threads*; it is
        not set from this.)
    **cached_loader_kwargs
        Other keyword arguments of ``CachedLoader`` (``seed``, ``drop_last``, ...).
    """

    def __init__(self, dataset_class: type, dataset_params: dict, batch_size: int, nb_worker: int,
                 max_minibatch_length: int | None = None, max_queue_size: int = 20,
                 prefetch_time: float | None = None, shuffle: bool = False, device: Any = None,
                 pin_memory: bool = False, gpu_indices: list[int] | None = None, nearby_shuffle: int = 0,
                 cache_setting: dict | None = None, rotation_setting: dict | None = None,
                 use_threading: bool = False, collate_fn: Callable | None = None,
                 **cached_loader_kwargs: Any) -> None:
        own = {"dataset_class", "dataset_params", "dataset_kwargs", "batch_size", "nb_worker", "worker_per_consumer",
               "max_minibatch_length", "max_queue_size", "prefetch_time", "shuffle", "device", "pin_memory",
               "gpu_indices", "nearby_shuffle", "cache_setting", "rotation_setting", "use_threading", "collate_fn"}
        check_pass_through(type(self).__name__, cached_loader_kwargs, own)
        if max_minibatch_length is not None:
            explain("max_minibatch_length", "DataLoader")
        if use_threading:
            explain("use_threading", "DataLoader")
        self._setup_compat()
        super().__init__(dataset_class=dataset_class, dataset_params=dataset_params, batch_size=batch_size,
                         nb_worker=nb_worker, shuffle=shuffle,
                         nearby_shuffle=nearby_shuffle, collate_fn=collate_fn, max_queue_size=max_queue_size,
                         prefetch_time=prefetch_time, device=device, pin_memory=pin_memory,
                         gpu_indices=gpu_indices, cache_setting=cache_setting, rotation_setting=rotation_setting,
                         **cached_loader_kwargs)


# ---------------------------------------------------------------------------- dataset_server.AsyncDataLoader
def _async_cache_setting(cache_setting: dict | None) -> dict | None:
    if cache_setting is None:
        return None
    if not isinstance(cache_setting, dict):
        return cache_setting  # CachedLoader names the problem
    setting = dict(cache_setting)
    if "side" in setting:
        setting.pop("side")
        explain("cache_setting['side']", "AsyncDataLoader")
    return setting


def _async_rotation_setting(client: dict | None, server: dict | None) -> dict | None:
    """One ``rotation_setting`` from AsyncDataLoader's two.

    The server rotated samples, the client rotated the batches it received:
    each sample was served ``server_rotation * client_rotation`` times. Ours
    rotates samples through one window: the product of the two rotations, the
    window of the server setting when there is one (else the client's),
    ``max_rotation_size`` as its size.
    """
    given = [s for s in (server, client) if s is not None]
    if not given:
        return None
    for setting in given:
        if not isinstance(setting, dict):
            return setting  # CachedLoader names the problem
    primary = given[0]
    setting = {k: v for k, v in primary.items() if k not in ("min_rotation_size", "max_rotation_size")}
    if "max_rotation_size" in primary:
        setting["size"] = primary["max_rotation_size"]
    if any("min_rotation_size" in s for s in given):
        explain("min_rotation_size", "AsyncDataLoader")
    if len(given) == 2:
        rotations = [s.get("rotation") for s in given]
        if all(isinstance(r, int) and not isinstance(r, bool) for r in rotations):
            setting["rotation"] = math.prod(rotations)
            log.info("AsyncDataLoader: server rotation %d x client rotation %d: each sample is served %d times "
                     "from one window", rotations[0], rotations[1], setting["rotation"])
    return setting


class AsyncDataLoader(CompatLoader):
    """``dataset_server.AsyncDataLoader`` (the older TCP version), as a :class:`~loader.CachedLoader`.

    Its servers become worker processes (``nb_servers`` -> ``nb_worker``) and
    ``wait_time`` (seconds to preload before the first batch) becomes
    ``prefetch_time``, which ends as soon as the queue is full. Networking
    arguments (``start_port``, ``packet_size``, ``retry_interval``,
    ``nb_retry``) are accepted and not needed. ``cache_setting`` may keep its
    ``side`` key (there is one side here). ``client_rotation_setting`` and
    ``server_rotation_setting`` become one ``rotation_setting`` (see
    :func:`_async_rotation_setting`). Versions of AsyncDataLoader that took
    ``client_wait_time`` or ``qt_threading`` are accepted too (keywords only).
    """

    def __init__(self, dataset_class: type, dataset_params: dict, batch_size: int, nb_servers: int,
                 start_port: int = 11111, max_queue_size: int = 20, shuffle: bool = False, device: Any = None,
                 pin_memory: bool = False, packet_size: int = 125000, wait_time: float = 10,
                 retry_interval: float = 10, nb_retry: int = 10, gpu_indices: list[int] | None = None,
                 nearby_shuffle: int = 0, cache_setting: dict | None = None,
                 client_rotation_setting: dict | None = None, server_rotation_setting: dict | None = None,
                 *, client_wait_time: float | None = None, qt_threading: bool | None = None,
                 **cached_loader_kwargs: Any) -> None:
        own = {"dataset_class", "dataset_params", "dataset_kwargs", "batch_size", "nb_worker", "worker_per_consumer",
               "max_queue_size", "shuffle", "device", "pin_memory", "prefetch_time", "gpu_indices",
               "nearby_shuffle", "cache_setting", "rotation_setting"}
        check_pass_through(type(self).__name__, cached_loader_kwargs, own)
        for name, value, default in (("start_port", start_port, 11111), ("packet_size", packet_size, 125000),
                                     ("retry_interval", retry_interval, 10), ("nb_retry", nb_retry, 10),
                                     ("client_wait_time", client_wait_time, None),
                                     ("qt_threading", qt_threading, None)):
            if value != default:
                explain(name, "AsyncDataLoader")
        self._setup_compat()
        super().__init__(dataset_class=dataset_class, dataset_params=dataset_params, batch_size=batch_size,
                         nb_worker=nb_servers, shuffle=shuffle,
                         nearby_shuffle=nearby_shuffle, max_queue_size=max_queue_size, prefetch_time=wait_time,
                         device=device, pin_memory=pin_memory, gpu_indices=gpu_indices,
                         cache_setting=_async_cache_setting(cache_setting),
                         rotation_setting=_async_rotation_setting(client_rotation_setting, server_rotation_setting),
                         **cached_loader_kwargs)


