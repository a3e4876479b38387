"""The fields of a loader state that reach the disk, bounded before they are used.

A state handed to ``load_state_dict`` may come from anywhere (a checkpoint in a shared folder, a
file someone edited): it is input (see docs/ARCHITECTURE.md, "Untrusted stores"). Its numbers
name generations and its rotation fallback names a directory, so an absurd epoch would commit a
generation whose name no listing reads, and a forged prefix would make the loader sweep and write
a directory outside the cache. :func:`check_bounds` refuses both before anything is planned;
:func:`loader.state.check_state` checks the rest.
"""

from __future__ import annotations

import os

from .settings import LoaderSettings

#: The largest epoch (and generation) a state may name: far beyond any run, and a generation id well
#: inside the 18 digits a store's names hold.
MAX_EPOCH = 10 ** 12
#: The largest seed (numpy takes any non-negative int; a state's is one a loader drew or was given).
MAX_SEED = 2 ** 128
#: The most batches a state may say were served out of order: those in flight at once, far fewer.
MAX_AHEAD = 1 << 16
#: The most legs on other numbers of ranks a state may record for one epoch.
MAX_LEGS = 64


def _inside(path: str, root: str) -> bool:
    path, root = os.path.realpath(path), os.path.realpath(root)
    return os.path.commonpath([path, root]) == root


def check_bounds(state: dict[str, object], settings: LoaderSettings) -> None:
    """Refuse a state whose numbers or paths no loader of `settings` writes.

    Raises
    ------
    ValueError
        Naming the field: an epoch or cache base beyond :data:`MAX_EPOCH`, a seed beyond
        :data:`MAX_SEED`, a rotation fallback outside the cache's prefix or asking for pickles.
    """
    def bad(name: str, expected: str, value: object) -> ValueError:
        text = repr(value)
        return ValueError(f"damaged loader state: state[{name!r}] must be {expected}, got "
                          f"{text if len(text) <= 80 else text[:77] + '...'}")

    for name, value in (("epoch", state.get("epoch")), ("seed", state.get("seed"))):
        limit = MAX_EPOCH if name == "epoch" else MAX_SEED
        if isinstance(value, int) and value > limit:
            raise bad(name, f"at most {limit}", value)
    cache = state.get("cache")
    base = cache.get("base") if isinstance(cache, dict) else None
    if isinstance(base, int) and base > MAX_EPOCH:
        raise bad("cache", f"a plan whose 'base' is at most {MAX_EPOCH}", cache)
    fallback = state.get("rotation_fallback")
    if not isinstance(fallback, dict):
        return
    if fallback.get("allow_pickle", False) is not False:
        raise bad("rotation_fallback", "a window without allow_pickle (that is the cache setting's, "
                  "never a state's)", fallback)
    prefix = fallback.get("prefix")
    if prefix is not None and (settings.cache is None or not isinstance(prefix, str)
                               or not _inside(prefix, settings.cache.prefix)):
        root = settings.cache.prefix if settings.cache is not None else None
        raise bad("rotation_fallback", f"a window under the cache's prefix {root!r} (the only place a loader "
                  "falls back to)", fallback)
