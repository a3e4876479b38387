"""Validation of ``cache_setting`` and ``rotation_setting``: errors name the key."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

from cachestore.backends import available_backends
from cachestore.disk import parse_size

BUDGET_POLICIES = ("error", "stream", "rotate")
#: The values each boolean key of ``cache_setting`` accepts: the one place to widen
#: (e.g. ``background_refresh`` taking ``"auto"``). Strings like ``"no"`` or ``"False"``
#: are refused rather than read as true, which is what ``bool()`` would make of them.
BOOL_VALUES: dict[str, tuple] = {"verify": (True, False), "allow_pickle": (True, False),
                                 "background_refresh": (True, False)}
#: Default window of the memory rotation medium, in samples (see RotationSettings).
DEFAULT_MEMORY_WINDOW = 1024


def _check_choice(name: str, key: str, value: Any, allowed: tuple) -> Any:
    """`value` if it is one of `allowed` (compared by identity for booleans), else a ValueError naming `key`."""
    # Identity for bools and None: 1 == True and 0 == False, and an int is not a boolean setting.
    if any(value is a if isinstance(a, bool) or a is None else (type(value) is type(a) and value == a)
           for a in allowed):
        return value
    raise ValueError(f"{name}[{key!r}] must be one of {', '.join(map(repr, allowed))}, "
                     f"got {value!r} ({type(value).__name__})")


def _check_keys(name: str, given: dict, allowed: set[str]) -> None:
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(sorted(allowed))}")


@dataclass(frozen=True)
class CacheSettings:
    """Parsed ``cache_setting``.

    ``prefix`` (required) is the store directory; ``update_frequency`` K is an
    int >= 2 or ``math.inf`` (default: ``math.inf``, computed once and reused);
    ``backend`` ``"memmap"`` (default), ``"lmdb"`` or ``"memory"``;
    ``compression`` ``None`` or ``"zstd"``; ``disk_budget`` bytes or ``"20GB"``;
    ``on_budget_exceeded`` ``"error"`` (default), ``"stream"`` or ``"rotate"``;
    ``verify`` checks record checksums on read (default ``True``);
    ``allow_pickle`` stores otherwise unsupported sample types with pickle;
    ``background_refresh`` computes the next generation with idle workers during
    the cached epochs before it (default ``False``; see :mod:`loader.refresh`).
    """

    prefix: str
    update_frequency: float
    backend: str = "memmap"
    compression: str | None = None
    disk_budget: int | None = None
    on_budget_exceeded: str = "error"
    verify: bool = True
    allow_pickle: bool = False
    background_refresh: bool = False

    KEYS = frozenset({"prefix", "update_frequency", "backend", "compression", "disk_budget",
                      "on_budget_exceeded", "verify", "allow_pickle", "background_refresh"})

    @classmethod
    def parse(cls, setting: dict) -> "CacheSettings":
        _check_keys("cache_setting", setting, set(cls.KEYS))
        prefix = setting.get("prefix")
        if not isinstance(prefix, (str, os.PathLike)) or not str(prefix):
            raise ValueError("cache_setting['prefix'] is required: the directory of the cache, e.g. 'cache/train'")
        k = setting.get("update_frequency", math.inf)
        if k != math.inf and (isinstance(k, bool) or not isinstance(k, int) or k < 2):
            raise ValueError(f"cache_setting['update_frequency'] must be an int >= 2 or math.inf, got {k!r} "
                             "(1 would rewrite the cache every epoch: use no cache_setting instead)")
        backend = setting.get("backend", "memmap")
        if backend not in available_backends():
            raise ValueError(f"cache_setting['backend'] {backend!r} is unknown; "
                             f"available: {', '.join(available_backends())}")
        compression = setting.get("compression")
        if compression not in (None, "zstd"):
            raise ValueError(f"cache_setting['compression'] must be None or 'zstd', got {compression!r}")
        try:
            budget = parse_size(setting.get("disk_budget"))
        except ValueError as exc:
            raise ValueError(f"cache_setting['disk_budget']: {exc}") from None
        policy = setting.get("on_budget_exceeded", "error")
        if policy not in BUDGET_POLICIES:
            raise ValueError(f"cache_setting['on_budget_exceeded'] must be one of {BUDGET_POLICIES}, got {policy!r}")
        flags = {key: _check_choice("cache_setting", key, setting.get(key, getattr(cls, key)), allowed)
                 for key, allowed in BOOL_VALUES.items()}
        return cls(str(prefix), k, backend, compression, budget, policy, **flags)


@dataclass(frozen=True)
class RotationSettings:
    """Parsed ``rotation_setting``.

    ``medium`` ``"memory"`` or ``"disk"``; ``rotation`` R >= 2 (times each
    generated sample is served); ``size`` S >= 1 samples in the window
    (required for disk; for memory the default is ``max(1024, 4 * batch_size)``,
    at most N); ``prefix``
    the directory of the disk window (required for disk).
    """

    medium: str
    rotation: int
    size: int | None
    prefix: str | None

    KEYS = frozenset({"medium", "rotation", "size", "prefix"})

    @classmethod
    def parse(cls, setting: dict) -> "RotationSettings":
        _check_keys("rotation_setting", setting, set(cls.KEYS))
        medium = setting.get("medium", "memory")
        if medium not in ("memory", "disk"):
            raise ValueError(f"rotation_setting['medium'] must be 'memory' or 'disk', got {medium!r}")
        rotation = setting.get("rotation")
        if isinstance(rotation, bool) or not isinstance(rotation, int) or rotation < 2:
            raise ValueError(f"rotation_setting['rotation'] must be an int >= 2, got {rotation!r}")
        size = setting.get("size")
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"rotation_setting['size'] must be an int >= 1, got {size!r}")
        prefix = setting.get("prefix")
        if medium == "disk":
            if size is None:
                raise ValueError("rotation_setting['size'] is required for medium 'disk' (samples in the window)")
            if not isinstance(prefix, (str, os.PathLike)) or not str(prefix):
                raise ValueError("rotation_setting['prefix'] is required for medium 'disk' (its directory)")
        return cls(medium, rotation, size, str(prefix) if prefix is not None else None)

    def window(self, n: int, batch_size: int) -> int:
        """Samples the window holds for a dataset of `n` samples.

        The memory medium's default is ``max(1024, 4 * batch_size)``: large
        enough that a sample's repeats land batches apart, small enough to stay
        well inside RAM for the sample sizes that need rotation.
        """
        size = self.size if self.size is not None else max(DEFAULT_MEMORY_WINDOW, 4 * batch_size)
        return max(1, min(size, n))


def check_int(name: str, value: Any, minimum: int, allow_none: bool = False) -> None:
    if allow_none and value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
