"""Datasets that fail in ways a real one does (importable by spawned workers)."""

from __future__ import annotations

import os
import threading

import numpy as np


class LabelError(Exception):
    """An exception whose constructor takes other arguments than its message."""

    def __init__(self, index: int, path: str) -> None:
        super().__init__(f"bad label {index} at {path}")
        self.index = index
        self.path = path


class LabelErrorWithDefault(Exception):
    """Unpickling would call ``cls(message)`` and build another message: ``bad label <message> at None``."""

    def __init__(self, index: object, path: str | None = None) -> None:
        super().__init__(f"bad label {index} at {path}")
        self.path = path


class HeldLockError(Exception):
    """Carries an attribute that does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.lock = threading.Lock()
        self.code = 42


class RaisingDataset:
    """``dataset[fail_at]`` raises the exception named by `kind`; other samples are ``{"y": i}``."""

    def __init__(self, n: int = 20, fail_at: int = 7, kind: str = "label") -> None:
        self.n, self.fail_at, self.kind = n, fail_at, kind

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if index == self.fail_at:
            self._fail(index)
        return {"y": index, "x": np.zeros(2, np.float32)}

    def _fail(self, index: int) -> None:
        if self.kind == "label":
            raise LabelError(index, f"/data/labels/{index}.txt")
        if self.kind == "label-default":
            raise LabelErrorWithDefault(index, "/data/x")
        if self.kind == "lock":
            raise HeldLockError(f"sample {index} holds a lock")
        if self.kind == "key":
            raise KeyError(f"sample {index} is broken")
        if self.kind == "local":
            class LocalError(Exception):  # not importable by name: cannot cross processes
                pass

            raise LocalError(f"local failure at {index}")
        raise AssertionError(self.kind)


class ObjectArrayDataset:
    """Samples holding an object-dtype array (a list of strings turned into an array, say)."""

    def __init__(self, n: int = 8) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        return {"x": np.zeros(2, np.float32), "tags": np.array(["a", index], dtype=object)}


class DiskFillingDataset:
    """Sample i is {"x": 16 KiB of i, "y": i}; computing `fill_at` fills the file system of `fill_dir`.

    Another program filling the disk in the middle of a generate epoch, after the
    budget projection has let the generation start.
    """

    def __init__(self, n: int = 48, fill_dir: str | None = None, fill_at: int | None = None) -> None:
        self.n, self.fill_dir, self.fill_at = n, fill_dir, fill_at

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if index == self.fill_at and self.fill_dir is not None:
            from tests.fullfs import fill

            # Once per test: the marker sits next to the file system, which the test empties again.
            marker = os.path.join(os.path.dirname(self.fill_dir), "filled-once")
            if not os.path.exists(marker):
                open(marker, "w").close()
                fill(self.fill_dir)
        return {"x": np.full(4096, index, np.float32), "y": index}


class HangingDataset:
    """``dataset[hang_at]`` never returns (a stuck read); it first drops ``hanging-<pid>`` in `marker_dir`."""

    def __init__(self, n: int = 40, hang_at: int = 6, marker_dir: str = "") -> None:
        self.n, self.hang_at, self.marker_dir = n, hang_at, marker_dir

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict:
        if index == self.hang_at and self.marker_dir:
            open(os.path.join(self.marker_dir, f"hanging-{os.getpid()}"), "w").close()
            threading.Event().wait()  # no timeout: only a signal ends this
        return {"x": np.full(1024, index, np.float32), "y": index}
