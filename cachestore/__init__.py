"""cachestore: epoch-versioned sample storage for machine-learning datasets.

Samples are written into *generations* that become visible atomically, read
back by index or as vectorised batches, and shared between processes by path.
"""

from .backends import available_backends, register_backend
from .backends.base import Backend, GenerationInfo
from .backends.spec import StoreSpec
from .errors import (BatchStackError, BudgetExceededError, CacheStoreError, CorruptSampleError, FingerprintError,
                     FingerprintMismatchError, GenerationCommitted, GenerationNotFoundError, MalformedFileError,
                     NotAStoreError, NotRegularFileError, PickleRefusedError, StoreLockedError, SymlinkError,
                     UnsupportedSampleError, UntrustedOwnerError)
from .format.collate import stack_samples
from .pruning import Removed
from .read.readable import ReadableStore
from .read.reader import Reader
from .opening import open_store
from .store import Store
from .write.sink import Put, PutResult, SampleSink
from .write.writer import GenerationWriter, ShardSpec, Writer

__version__ = "0.1.0"

__all__ = [
    "Backend", "BatchStackError", "BudgetExceededError", "CacheStoreError", "CorruptSampleError", "FingerprintError",
    "FingerprintMismatchError", "GenerationCommitted", "GenerationInfo", "GenerationNotFoundError",
    "GenerationWriter", "MalformedFileError", "NotAStoreError", "NotRegularFileError", "PickleRefusedError", "Put",
    "PutResult", "ReadableStore", "Reader", "Removed", "SampleSink", "ShardSpec", "Store", "StoreLockedError", "StoreSpec",
    "SymlinkError", "UnsupportedSampleError", "UntrustedOwnerError", "Writer", "available_backends", "open_store",
    "register_backend", "stack_samples",
]

