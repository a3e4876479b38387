"""Moving batches to torch tensors on a device, optionally through pinned memory."""

from __future__ import annotations

import logging
import os
from typing import Callable

import numpy as np

from .dataset import Batch, BatchFn
from .settings import LoaderSettings

log = logging.getLogger(__name__)


def make_mover(settings: LoaderSettings) -> BatchFn | None:
    """What every batch goes through on its way out: `to_device`, a :class:`DeviceMover`, or nothing."""
    if settings.to_device is not None:
        return settings.to_device
    if settings.device is None and not settings.pin_memory:
        return None
    device = settings.device
    if isinstance(device, str) and device == "cuda":
        device = f"cuda:{int(os.environ.get('LOCAL_RANK', 0))}"  # one GPU per rank under torchrun
    return DeviceMover(device, settings.pin_memory)


def tree_map(fn: Callable[[object], object], batch: Batch) -> Batch:
    if isinstance(batch, dict):
        return {k: tree_map(fn, v) for k, v in batch.items()}
    if type(batch) in (list, tuple):
        mapped = [tree_map(fn, v) for v in batch]
        return mapped if type(batch) is list else tuple(mapped)
    if isinstance(batch, tuple) and hasattr(type(batch), "_fields"):  # a namedtuple of batches
        return type(batch)(*(tree_map(fn, v) for v in batch))
    return fn(batch)


class DeviceMover:
    """Turns numpy leaves into tensors, pins them if asked, moves them to `device`."""

    def __init__(self, device: object, pin_memory: bool) -> None:
        import torch

        self.torch = torch
        self.device = torch.device(device) if device is not None else None  # type: ignore[call-overload]
        self.pin = pin_memory and torch.cuda.is_available()
        if pin_memory and not self.pin:
            log.info("pin_memory=True ignored: no CUDA device is available")

    def _leaf(self, x: object) -> object:
        torch = self.torch
        if isinstance(x, np.ndarray):
            if not (x.dtype.kind in "biufc" or x.dtype == np.bool_):
                return x
            tensor = torch.from_numpy(x if x.flags.writeable else x.copy())
        elif isinstance(x, torch.Tensor):
            tensor = x
        else:
            return x
        if self.pin and tensor.device.type == "cpu":
            tensor = tensor.pin_memory()  # a copy out of the shared-memory slot, which is then released
        if self.device is not None and tensor.device != self.device:
            tensor = tensor.to(self.device, non_blocking=self.pin)
        return tensor

    def __call__(self, batch: Batch) -> Batch:
        return tree_map(self._leaf, batch)
