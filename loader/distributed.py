"""What ``torch.distributed`` says about this process: the world size and the rank."""

from __future__ import annotations

import sys


def distributed_defaults() -> tuple[int, int]:
    """World size and rank when torch.distributed is initialised, else (1, 0)."""
    # Only a process that imported torch.distributed can have initialised it:
    # importing torch here would cost a second for nothing.
    dist = sys.modules.get("torch.distributed")
    if dist is not None and dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size()), int(dist.get_rank())
    return 1, 0
