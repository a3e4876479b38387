"""``python -m cachestore``: the same command line as the ``cachestore`` script."""

import sys

from .cli import main

sys.exit(main())
