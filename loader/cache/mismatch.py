"""What two fingerprints differ in, in words, and the dataset's parameters as ``cachestore inspect`` shows them."""

from __future__ import annotations

import json
import re
from typing import Any

_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _stable_json(obj: Any) -> str:
    # repr() of arbitrary objects embeds their address, which changes every run.
    return json.dumps(obj, sort_keys=True, default=lambda o: _ADDRESS.sub("", repr(o)))


#: What each fingerprint key means, for messages; values worth showing are shown.
_PARTS = {
    "fingerprint": ("the explicit fingerprint (cache_setting['fingerprint'])", True),
    "dataset": ("the dataset class", True),
    "params_sha256": ("the dataset parameters", False),
    "state_sha256": ("the dataset's state (its attributes, or what its functions use)", False),
    "length": ("the length", True),
    "source_sha256": ("the dataset's code (its class's source, or what its methods use)", False),
    "files": ("the number of data files it names", True),
    "files_sha256": ("a data file it names (its size or modification time: rewritten in place?)", False),
    "partition": ("the partition [consumer_index, nb_consumer]", True),
}


def describe_mismatch(stored: dict | None, requested: dict | None) -> str:
    """Which parts of two fingerprints differ, in words, for an error message.

    Examples
    --------
    >>> describe_mismatch({"dataset": "a.A", "length": 10}, {"dataset": "a.A", "length": 12})
    'the length changed (stored 10, now 12)'
    """
    if not isinstance(stored, dict) or not isinstance(requested, dict):
        return "the store records no fingerprint to compare" if not isinstance(stored, dict) else "no fingerprint given"
    changes = []
    explicit = ("fingerprint" in stored, "fingerprint" in requested)
    if explicit[0] != explicit[1]:
        changes.append("the store was written with an explicit cache_setting['fingerprint'] and this run has none"
                       if explicit[0] else "this run gives an explicit cache_setting['fingerprint'], "
                                           "the store was written without one")
    keys = [k for k in _PARTS if k in stored or k in requested]
    keys += sorted(k for k in set(stored) | set(requested) if k not in _PARTS)
    for key in keys:
        if explicit[0] != explicit[1] and key in ("fingerprint", "dataset", "params_sha256", "source_sha256"):
            continue  # one side has no such part: already said above
        if stored.get(key) != requested.get(key):
            label, show = _PARTS.get(key, (f"{key!r}", True))
            detail = f" (stored {stored.get(key)!r}, now {requested.get(key)!r})" if show else ""
            changes.append(f"{label} changed{detail}")
    return "; ".join(changes) if changes else "nothing differs"


def describe_params(params: dict) -> Any:
    """JSON-safe description of the dataset's keyword arguments (for ``cachestore inspect``)."""
    return json.loads(_stable_json(params))
