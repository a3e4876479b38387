"""Moving batches to torch tensors on a device, optionally through pinned memory."""

from __future__ import annotations

import logging
from typing import Any, Callable

import numpy as np

log = logging.getLogger(__name__)


def tree_map(fn: Callable[[Any], Any], batch: Any) -> Any:
    if isinstance(batch, dict):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if type(batch) in (list, tuple):
        mapped = [tree_map(fn, v) for v in batch]
        return mapped if type(batch) is list else tuple(mapped)
    return fn(batch)


class DeviceMover:
    """Turns numpy leaves into tensors, pins them if asked, moves them to `device`."""

    def __init__(self, device: Any, pin_memory: bool) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device) if device is not None else None
        self.pin = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin:
            log.info("pin_memory=True ignored: no CUDA device is available")

    def _leaf(self, x: Any) -> Any:
        torch = self.torch
        if isinstance(x, np.ndarray):
            if x.dtype.kind in "biufc" or x.dtype == np.bool_:
                x = torch.from_numpy(x if x.flags.writeable else x.copy())
            else:
                return x
        if isinstance(x, torch.Tensor):
            if self.pin and x.device.type == "cpu":
                x = x.pin_memory()  # a copy out of the shared-memory slot, which is then released
            if self.device is not None and x.device != self.device:
                x = x.to(self.device, non_blocking=self.pin)
            return x
        return x

    def __call__(self, batch: Any) -> Any:
        return tree_map(self._leaf, batch)
