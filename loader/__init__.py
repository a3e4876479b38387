"""The loader: a multiprocess data loader with epoch-versioned caching and rotation.

>>> from loader import CachedLoader   # doctest: +SKIP
"""

from cachestore.format.collate import stack_samples as default_collate

from .api import CachedLoader
from .epochs.plan import EpochStats

__all__ = ["CachedLoader", "EpochStats", "default_collate"]
