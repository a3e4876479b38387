"""Reading the samples a memmap staging area already holds (a partial generation being resumed).

The files still grow while they are read (workers write on), so they are read with
``pread`` through the shards' index rows, never mapped. In a shared staging area
(:mod:`cachestore.write.shared`) a sample may be logged twice, by a member killed between
flushing it and marking it done and by the one that computed it again: only the copy the
done map names is read (:mod:`cachestore.guard.claims`).
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..errors import CacheStoreError, CorruptSampleError
from ..format import codec, records
from ..format.checksums import checksum
from ..format.codec import Leaf, LeafSpec, Sample, TreeDef
from ..guard import safefs
from ..guard.claims import done_map, shard_tag
from .memmap_files import COLUMN, col_name, load_schema, read_rows
from .reading import StagingData


class StagingRecords(StagingData):
    """Samples of a memmap staging area, read with ``pread`` (its files still grow).

    Parameters
    ----------
    staging
        The staging area.
    verify
        Check each record against its checksum.
    shared_samples
        The sample count of a shared staging area, whose done map says which copy of a sample
        counts; ``None`` for the staging area of one writer.
    """

    def __init__(self, staging: Path, verify: bool, shared_samples: int | None = None,
                 allow_pickle: bool = False) -> None:
        self.dir = staging
        self.verify = verify
        self.allow_pickle = allow_pickle
        self._shared = shared_samples
        self._where: dict[int, tuple[str, np.void]] = {}  # index -> (shard id, index row)
        self._schema: TreeDef | None = None
        self._specs: list[LeafSpec] = []

    def _scan(self) -> None:
        tags = None
        if self._shared is not None:
            # Read before the logs: a member logs a sample, then marks it done, so every tag read
            # here names a row the logs read below hold.
            try:
                tags = done_map(self.dir, self._shared)
            except FileNotFoundError:
                return  # committed (or removed) since: nothing more to find here
        for path in sorted(self.dir.glob("*.idx")):
            shard_id = path.name[:-4]
            tag = shard_tag(shard_id)
            for row in read_rows(path):
                i = int(row["index"])
                if tags is not None and not (0 <= i < len(tags) and tags[i] == tag):
                    continue  # not the copy that counts (or not done yet: a later scan looks again)
                self._where.setdefault(i, (shard_id, row))
        if self._schema is None:
            self._schema = load_schema(self.dir)
            self._specs = codec.leaf_specs(self._schema) if self._schema is not None else []

    def _leaves(self, shard_id: str, row: np.void) -> tuple[TreeDef, list[Leaf]] | None:
        """The record of `row` as ``(treedef, leaves)``, ``None`` when it is missing or fails its checksum."""
        if self._schema is None:
            self._schema = load_schema(self.dir)
            self._specs = codec.leaf_specs(self._schema) if self._schema is not None else []
        i = int(row["index"])
        if row["shard"] == COLUMN:
            if self._schema is None:
                return None
            leaves = []
            for k, ((dtype, shape), rowbytes) in enumerate(zip(self._specs, codec.row_bytes(self._specs))):
                data = _pread(self.dir / col_name(k), i * rowbytes, rowbytes) if rowbytes else b""
                if len(data) != rowbytes:
                    return None
                leaves.append(np.frombuffer(data, dtype=dtype).reshape(shape).copy())
            if self.verify and checksum(leaves) != row["checksum"]:
                return None
            return self._schema, leaves
        record = _pread(self.dir / f"{shard_id}.seg", int(row["offset"]), int(row["length"]))
        if len(record) != row["length"] or (self.verify and checksum([record]) != row["checksum"]):
            return None
        try:
            return records.decode_record(record, copy=True, raw=int(row["raw"]))
        except CorruptSampleError:
            return None

    def sound(self, shard_id: str, row: np.void) -> bool:
        return self._leaves(shard_id, row) is not None

    def read(self, index: int) -> Sample:
        if index not in self._where:
            self._scan()  # written since the last look
        if index not in self._where:
            raise CacheStoreError(f"sample {index} is not in the staging area {self.dir}")
        leaves = self._leaves(*self._where[index])
        if leaves is None:
            raise CorruptSampleError(f"sample {index} in the staging area {self.dir} is corrupt or truncated")
        return self.sample(index, *leaves, where=str(self.dir))


def _pread(path: Path, offset: int, length: int) -> bytes:
    """`length` bytes at `offset` of `path`; fewer (none) where the file does not hold them: a row
    read back may name any size, and nothing is allocated for bytes that are not there."""
    try:
        fd = safefs.open_nofollow(path, os.O_RDONLY | os.O_NONBLOCK)
    except FileNotFoundError:
        return b""
    try:
        if offset < 0 or length < 0 or offset + length > os.fstat(fd).st_size:
            return b""
        return os.pread(fd, length, offset)
    finally:
        os.close(fd)
