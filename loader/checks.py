"""Checks of one setting's value, each a ``ValueError`` that names the setting (used as the settings are parsed)."""

from __future__ import annotations


def check_int(name: str, value: object, minimum: int, allow_none: bool = False) -> int | None:
    """`value`, unless it is not an int >= `minimum` (or ``None``, if allowed): a ``ValueError`` naming `name`."""
    if allow_none and value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")
    return value


def int_at_least(name: str, value: object, minimum: int) -> int:
    """`value`, unless it is not an int >= `minimum`: a ``ValueError`` naming `name`."""
    checked = check_int(name, value, minimum)
    assert checked is not None  # allow_none is off
    return checked


def check_choice(name: str, key: str, value: object, allowed: tuple[object, ...]) -> object:
    """`value` if it is one of `allowed` (compared by identity for booleans), else a ValueError naming `key`."""
    # Identity for bools and None: 1 == True and 0 == False, and an int is not a boolean setting.
    if any(value is a if isinstance(a, bool) or a is None else (type(value) is type(a) and value == a)
           for a in allowed):
        return value
    raise ValueError(f"{name}[{key!r}] must be one of {', '.join(map(repr, allowed))}, "
                     f"got {value!r} ({type(value).__name__})")


def check_keys(name: str, given: object, allowed: set[str]) -> dict[str, object]:
    """`given`, unless it is not a dict or has keys outside `allowed` (a ``ValueError`` naming them)."""
    if not isinstance(given, dict):
        raise ValueError(f"{name} must be a dict, got {type(given).__name__}")
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ValueError(f"{name} has unknown key(s) {', '.join(map(repr, unknown))}; "
                         f"allowed: {', '.join(sorted(allowed))}")
    return given
