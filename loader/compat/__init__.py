"""Drop-in constructors for users of ``dataset_server`` and ``swift_loader``.

``from loader.compat import DataLoader, AsyncDataLoader, SwiftLoader`` takes
the place of ``from dataset_server import DataLoader`` (its shared-memory
version), ``from dataset_server import AsyncDataLoader`` (its older TCP
version) and ``from swift_loader import SwiftLoader``. Each class keeps its
original signature - positional order, names and documented defaults - and
is a :class:`~loader.CachedLoader` configured equivalently.

Every original argument either maps to ours (see the table in the README,
"Migrating from dataset_server and swift-loader") or is accepted and, when
given a value other than its default, explained once per process in the log
(``loader.compat`` logger, INFO): why this loader does not need it. Keyword
arguments of :class:`~loader.CachedLoader` that the original did not have
(``cache_setting`` for a ``SwiftLoader``, ``seed``, ``drop_last``, ...) are
passed through; any other name is a :class:`TypeError`, as from any Python
function (``swift_loader`` silently ignored misspelt options).

Two original names live on in ``CachedLoader`` with another meaning, and
are therefore *not* passed on by these classes: ``use_threading`` (in
``dataset_server`` a thread that polls the workers; in ours, workers that
are threads) and ``max_minibatch_length`` (in ``dataset_server`` bytes of a
per-worker shared-memory buffer; in ours samples per task).
"""

from .dataset_server import AsyncDataLoader, DataLoader
from .swift_loader import SwiftLoader

__all__ = ["AsyncDataLoader", "DataLoader", "SwiftLoader"]
