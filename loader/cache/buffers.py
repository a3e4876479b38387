"""Arrays and tensors in the fingerprint: by dtype, shape and bytes (:mod:`loader.cache.fingerprint`)."""

from __future__ import annotations

from typing import Any

import numpy as np

from cachestore.errors import FingerprintError

from .reach import Hasher


def feed_array(hasher: Hasher, obj: Any, where: str, depth: int) -> None:
    """A numpy array or scalar: its dtype, shape and bytes; an object array item by item."""
    arr = np.asarray(obj)
    hasher.tag("ndarray" if isinstance(obj, np.ndarray) else "npscalar",
               np.lib.format.dtype_to_descr(arr.dtype), arr.shape)
    if arr.dtype.hasobject:
        for i, item in enumerate(arr.ravel().tolist()):
            hasher.feed(item, f"{where}.flat[{i}]", depth + 1)
    else:
        hasher.h.update(np.ascontiguousarray(arr).view(np.uint8).data)


def feed_tensor(hasher: Hasher, obj: Any, where: str, hint: str) -> None:
    """A torch tensor: its dtype, shape and bytes (dense, on the CPU); a nested one part by part.

    Raises
    ------
    FingerprintError
        Its bytes cannot be read (the message ends with `hint`).
    """
    import torch  # already imported: codec.is_tensor found it in sys.modules

    t = obj.detach()
    if t.is_nested:  # no flat buffer of its own (sizes() is refused): its components, in order
        parts = t.unbind()
        hasher.tag("nested tensor", str(t.layout), str(t.dtype), len(parts))
        for i, part in enumerate(parts):
            feed_tensor(hasher, part, f"{where}[{i}]", hint)
        return
    if t.layout != torch.strided:
        t = t.to_dense()
    t = t.cpu().contiguous()
    hasher.tag("tensor", str(t.dtype), tuple(t.shape))
    try:
        raw = t.reshape(-1).view(torch.uint8).numpy()
    except (RuntimeError, TypeError) as exc:
        raise FingerprintError(f"cannot fingerprint the dataset parameters: {where} is a tensor of "
                               f"{t.dtype} whose bytes cannot be read ({exc}); {hint}") from exc
    hasher.h.update(memoryview(raw).cast("B"))
