"""Reading a committed memmap generation: the columns and segments mapped, batches gathered verified."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import psutil

from .. import codec
from ..checksums import checksum, first_mismatch, flat_rows, row_checksums
from ..collate import stack_samples
from ..errors import CorruptSampleError
from ..native import native_gather
from .base import GenerationData
from .batch import batch_indices, gather_columns
from .memmap_files import COLUMN, col_name, load_schema

#: Rows gathered, then hashed, per block of a verified batch read: small enough to stay in this
#: core's L2 between the two, so the data crosses the memory bus once (gather), not twice.
VERIFY_BLOCK_BYTES = 1 << 20


def _map(path: Path, dtype: np.dtype, shape: tuple[int, ...]) -> np.ndarray:
    nbytes = dtype.itemsize * int(np.prod(shape, dtype=np.int64))
    size = path.stat().st_size if path.exists() else -1
    if size < nbytes:
        raise CorruptSampleError(f"data file {path} is truncated: {size} bytes, expected {nbytes}; "
                                 "the generation is damaged (prune it and rewrite)")
    if nbytes == 0:
        return np.zeros(shape, dtype=dtype)
    return np.memmap(path, dtype=dtype, mode="r", shape=shape)


class MemmapGeneration(GenerationData):
    # Read-only maps and arrays: a batch read touches no shared state.
    threadsafe_batches = True

    def __init__(self, gen_dir: Path, manifest: dict, verify: bool) -> None:
        super().__init__(int(manifest["generation"]), int(manifest["num_samples"]), str(gen_dir), verify)
        self.layout = manifest.get("layout")
        try:
            self.rows = np.load(gen_dir / "index.npy")
            shard_ids = json.loads((gen_dir / "shards.json").read_text())
        except (OSError, ValueError) as exc:
            raise CorruptSampleError(f"index of generation {self.generation} in {gen_dir} is unreadable: {exc}") from exc
        if len(self.rows) != self.num_samples:
            raise CorruptSampleError(f"index of generation {self.generation} in {gen_dir} has "
                                     f"{len(self.rows)} rows, expected {self.num_samples}")
        self.schema = load_schema(gen_dir)
        self.specs = codec.leaf_specs(self.schema) if self.schema is not None else []
        self.columns = [_map(gen_dir / col_name(k), dtype, (self.num_samples, *shape))
                        for k, (dtype, shape) in enumerate(self.specs)]
        # The columns as rows of bytes, for the compiled gather.
        self._byte_rows = tuple(flat_rows(self.columns, self.num_samples))
        self._widths = tuple(r.shape[1] for r in self._byte_rows)
        self._mapped_in = False
        self.segments: list[np.ndarray | None] = []
        for shard_id in shard_ids:
            seg = gen_dir / f"{shard_id}.seg"
            size = seg.stat().st_size if seg.exists() else 0
            self.segments.append(np.memmap(seg, dtype=np.uint8, mode="r") if size else None)

    def _record(self, i: int, row: Any) -> memoryview:
        seg = self.segments[row["shard"]]
        start, length = int(row["offset"]), int(row["length"])
        if seg is None or start + length > seg.size:
            raise self.corrupt(i, "its record lies beyond the end of the data file (truncated?)")
        rec = seg[start:start + length]
        if self.verify and checksum([rec]) != row["checksum"]:
            raise self.corrupt(i, "checksum mismatch")
        return rec

    def read(self, index: int, copy: bool = True) -> Any:
        i = self.check_index(index)
        row = self.rows[i]
        if row["shard"] == COLUMN:
            leaves = [col[i, ...] for col in self.columns]
            if self.verify and checksum(leaves) != row["checksum"]:
                raise self.corrupt(i, "checksum mismatch")
            if copy:
                leaves = [np.array(leaf) for leaf in leaves]
            return codec.unflatten(self.schema, leaves)
        treedef, leaves = codec.decode_record(self._record(i, row), copy=copy)
        return codec.unflatten(treedef, leaves)

    def batch_layout(self) -> tuple[tuple, list] | None:
        return (self.schema, self.specs) if self.layout == "fixed" else None

    def read_batch(self, indices: Sequence[int], out: list[np.ndarray] | None = None) -> Any:
        if self.layout != "fixed":
            if out is not None:
                raise ValueError("out= is only supported for generations with a fixed layout")
            return stack_samples([self.read(i, copy=False) for i in indices])
        idx = batch_indices(indices, self.num_samples, self.generation)
        if not self._mapped_in:
            self._map_in()
        if self.verify:
            out = self._gather_verified(idx, out)
        else:
            out = gather_columns(self.columns, self.specs, idx, out)
        return codec.unflatten_batch(self.schema, out)

    def _map_in(self) -> None:
        """Map every page of the columns into this process, once, before its first batch read.

        Batch reads go over the whole generation, and a page touched for the first time in a
        process costs a fault there (each worker's, the training process's): the first read epoch
        gathered 48 KiB samples at 1.67 ms per batch of 256, then 1.30; mapped in one call
        (``MADV_POPULATE_READ``, 13-35 ms for 768 MB in the page cache), 1.26 from the start. Not
        for a generation above a quarter of the available memory: that would read it from disk
        up front, and its epochs are bound by the disk anyway.
        """
        self._mapped_in = True
        native = native_gather()
        if native is None or sum(c.nbytes for c in self._byte_rows) > psutil.virtual_memory().available // 4:
            return
        for col in self._byte_rows:
            if col.size:
                native.populate(col)

    def _gather_verified(self, idx: np.ndarray, out: list[np.ndarray] | None) -> list[np.ndarray]:
        """Gather rows `idx` into `out` and check each row's checksum, block by block.

        A block (``VERIFY_BLOCK_BYTES``) is gathered, then hashed while it is still in cache:
        gathering the whole batch first and hashing it after read every byte from memory twice
        (a 12 MiB batch does not fit in cache), which cost a third of the read's speed.
        """
        n = idx.size
        if out is None:
            out = [np.empty((n, *shape), dtype=dtype) for dtype, shape in self.specs]
        rows = flat_rows(out, n)
        native = native_gather()
        if native is not None and len(rows) <= native.MAX_LEAVES:
            # One call per batch, the GIL released: gather threads run side by side.
            bad = native.gather_verified(self._byte_rows, self._widths, np.ascontiguousarray(idx),
                                         tuple(rows), np.ascontiguousarray(self.rows["checksum"][idx]))
            if bad >= 0:
                raise self.corrupt(int(idx[bad]), "checksum mismatch")
            return out
        expected = self.rows["checksum"][idx].tolist()
        block = max(1, VERIFY_BLOCK_BYTES // max(1, sum(r.shape[1] for r in rows)))
        for lo in range(0, n, block):
            hi = min(n, lo + block)
            gather_columns(self.columns, self.specs, idx[lo:hi], [dest[lo:hi] for dest in out])
            bad = first_mismatch(row_checksums([r[lo:hi] for r in rows], hi - lo), expected[lo:hi])
            if bad is not None:
                raise self.corrupt(int(idx[lo + bad]), "checksum mismatch")
        return out

    def close(self) -> None:
        self.columns = []
        self._byte_rows = ()
        self.segments = []
