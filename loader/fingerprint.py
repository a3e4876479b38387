"""What identifies the producer of cached samples, so a cache is never reused stale."""

from __future__ import annotations

import hashlib
import inspect
import json
import re
import sys
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable_json(obj: Any) -> str:
    # repr() of arbitrary objects embeds their address, which changes every run.
    return json.dumps(obj, sort_keys=True, default=lambda o: _ADDRESS.sub("", repr(o)))


def _source_hash(cls: type) -> str:
    """Hash of the module source defining `cls` (class source if the module is not a file)."""
    module = sys.modules.get(cls.__module__)
    for target in (module, cls):
        try:
            return hashlib.sha256(inspect.getsource(target).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            continue
    return "unknown"


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def dataset_fingerprint(cls: type, params: dict, length: int, partition: tuple[int, int]) -> dict:
    """The fingerprint recorded in (and checked against) a store.

    Covers the dataset class, a hash of its keyword arguments, its length, its
    module source, and the consumer partition this loader serves.
    """
    return {
        "dataset": class_path(cls),
        "params_sha256": hashlib.sha256(_stable_json(params).encode()).hexdigest()[:16],
        "length": int(length),
        "source_sha256": _source_hash(cls),
        "partition": list(partition),
    }


def describe_params(params: dict) -> Any:
    """JSON-safe description of the dataset's keyword arguments (for ``cachestore inspect``)."""
    return json.loads(_stable_json(params))
