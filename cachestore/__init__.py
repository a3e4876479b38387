"""cachestore: epoch-versioned sample storage for machine-learning datasets.

Samples are written into *generations* that become visible atomically, read
back by index or as vectorised batches, and shared between processes by path.
"""

from .backends import available_backends, register_backend
from .backends.base import Backend, GenerationInfo
from .collate import stack_samples
from .errors import (BatchStackError, BudgetExceededError, CacheStoreError, CorruptSampleError, FingerprintError,
                     FingerprintMismatchError, GenerationCommitted, GenerationNotFoundError, MalformedFileError,
                     NotAStoreError, NotRegularFileError, PickleRefusedError, StoreLockedError, SymlinkError,
                     UnsupportedSampleError, UntrustedOwnerError)
from .reader import Reader
from .spec import StoreSpec
from .pruning import Removed
from .sink import Put, PutResult, SampleSink
from .store import Store, open_store
from .writer import GenerationWriter, ShardSpec, Writer

__version__ = "0.1.0"

__all__ = [
    "Backend", "BatchStackError", "BudgetExceededError", "CacheStoreError", "CorruptSampleError", "FingerprintError",
    "FingerprintMismatchError", "GenerationCommitted", "GenerationInfo", "GenerationNotFoundError",
    "GenerationWriter", "MalformedFileError", "NotAStoreError", "NotRegularFileError", "PickleRefusedError", "Put",
    "PutResult", "Reader", "Removed", "SampleSink", "ShardSpec", "Store", "StoreLockedError", "StoreSpec",
    "SymlinkError", "UnsupportedSampleError", "UntrustedOwnerError", "Writer", "available_backends", "open_store",
    "register_backend", "stack_samples",
]

