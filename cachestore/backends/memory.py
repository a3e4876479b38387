"""In-RAM backend: generations are numpy arrays owned by one Store instance.

No disk at all; the budget is RAM (``psutil``'s available memory, or the
store's ``disk_budget`` read as a RAM budget). State is per instance: two
``open_store(path, backend="memory")`` calls are two independent stores, and
a reader pickled into another process carries its arrays with it. Samples are
copied on ``put`` so later changes by the caller never reach the store.

A kept staging area (a partial generation) stays in this ``Store`` object and
is adopted by its next writer of the same generation; it dies with the object
(and the process), so a new run starts such a generation over.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Collection

import numpy as np
import numpy.typing as npt

from ..errors import CacheStoreError, GenerationCommitted, GenerationNotFoundError
from ..format import codec
from ..format.codec import Batch, Leaf, LeafSpec, Sample, TreeDef
from ..format.collate import stack_samples
from ..space.budget import Budget
from .base import (Backend, GenerationInfo, ProducerRecord, ShardWriter, StagingToken, StoreMeta,
                   missing_generation)
from .batch import Indices, batch_indices, gather_columns
from .reading import BatchLayout, GenerationData, StagingData
from .staging import check_complete

_tokens = itertools.count()


class _Staging:
    """A generation being written: fixed-shape samples straight into its final columns, others one by one.

    Columns are allocated at the first stackable sample when the sample count is known, and
    every sample of that structure is copied into its row: the committed generation then
    uses these arrays as they are. A copy per sample, then a second copy into columns at
    commit, doubled the peak and left the heap fragmented by thousands of sample-sized
    blocks that the allocator did not hand back after close.
    """

    def __init__(self, token: StagingToken) -> None:
        self.token = token
        self.record: ProducerRecord | None = None
        self.kept = False
        self.samples: dict[int, tuple[TreeDef, list[Leaf]]] = {}
        self.created = time.time()
        self.raw_bytes = 0
        self.rewritten: list[int] = []  # indices put again: commit refuses them, like every backend
        self.schema: TreeDef | None = None
        self.columns: list[Leaf] = []
        self.filled = np.zeros(0, dtype=bool)  # which rows of the columns hold a sample
        self.row_bytes = 0

    def open_columns(self, treedef: TreeDef, n: int) -> None:
        self.schema = treedef
        specs = codec.leaf_specs(treedef)
        self.columns = [np.empty((n, *shape), dtype=dtype) for dtype, shape in specs]
        self.filled = np.zeros(n, dtype=bool)
        self.row_bytes = sum(col[0].nbytes for col in self.columns)

    def has(self, index: int) -> bool:
        return index in self.samples or (index < len(self.filled) and bool(self.filled[index]))

    def count(self) -> int:
        return len(self.samples) + int(self.filled.sum())

    def indices(self) -> list[int]:
        in_columns: list[int] = np.flatnonzero(self.filled).tolist()
        return list(self.samples) + in_columns


class MemoryShard(ShardWriter):
    """Copies samples into a staging area of this process's memory."""

    def __init__(self, staging: _Staging, allow_pickle: bool) -> None:
        token = staging.token
        super().__init__(token.generation, token.write_budget(), token.num_samples, False, allow_pickle)
        self.staging = staging

    def _write(self, index: int, treedef: TreeDef, leaves: list[Leaf]) -> int:
        st, n = self.staging, self.staging.token.num_samples
        if (st.schema is None and not st.samples and n and codec.is_stackable(treedef)
                and codec.leaf_specs(treedef)):
            st.open_columns(treedef, n)
        if st.has(index):
            previous = st.samples.pop(index, None)
            if previous is None:  # it was in the columns
                st.raw_bytes -= st.row_bytes
                st.filled[index] = False
            else:
                st.raw_bytes -= sum(leaf.nbytes for leaf in previous[1])
            st.rewritten.append(index)
        if n is not None and treedef == st.schema and index < n:
            for col, leaf in zip(st.columns, leaves):
                col[index] = leaf
            st.filled[index] = True
            nbytes = st.row_bytes
        else:
            copies = [np.array(leaf, copy=True) for leaf in leaves]
            st.samples[index] = (treedef, copies)
            nbytes = sum(leaf.nbytes for leaf in copies)
        st.raw_bytes += nbytes
        return nbytes

    def _flush(self) -> None:
        pass

    def usage(self) -> int:
        return self.staging.raw_bytes


class MemoryGeneration(GenerationData):
    """A committed in-RAM generation: columns when every sample has one fixed structure."""

    # Read-only arrays: a batch read touches no shared state.
    threadsafe_batches = True

    def __init__(self, generation: int, staging: _Staging, n: int, allow_pickle: bool = False) -> None:
        super().__init__(generation, n, "memory", verify=False, allow_pickle=allow_pickle)
        self.created = time.time()
        samples = staging.samples
        self.schema: TreeDef | None = None
        self.specs: list[LeafSpec] = []
        self.columns: list[Leaf] = []
        self.samples: list[tuple[TreeDef, list[Leaf]]] = []  # when there are no columns
        if staging.schema is not None and n and not samples and len(staging.columns[0]) == n:
            samples = {}  # every sample is already in its row: the staging columns are the generation
            self.schema, self.columns = staging.schema, staging.columns
            self.specs = codec.leaf_specs(self.schema)
            staging.columns = []
        elif staging.schema is not None:  # some samples differ: each one keeps its own arrays
            for i in np.flatnonzero(staging.filled).tolist():
                samples[i] = (staging.schema, [col[i, ...].copy() for col in staging.columns])
            staging.columns = []
        treedefs = {treedef for treedef, _ in samples.values()}
        if self.columns:
            for col in self.columns:
                col.flags.writeable = False
        elif n and len(treedefs) == 1 and codec.is_stackable(next(iter(treedefs))):
            self.schema = treedefs.pop()
            self.specs = codec.leaf_specs(self.schema)
            self.columns = [np.empty((n, *shape), dtype=dtype) for dtype, shape in self.specs]
            for i in range(n):
                _, leaves = samples.pop(i)  # free each sample as it is copied in
                for col, leaf in zip(self.columns, leaves):
                    col[i] = leaf
            for col in self.columns:
                col.flags.writeable = False
        else:
            self.samples = [samples[i] for i in range(n)]
            for _, leaves in self.samples:  # read(copy=False) and batches hand these out: no writes through them
                for leaf in leaves:
                    leaf.flags.writeable = False
        self.nbytes = sum(c.nbytes for c in self.columns) + sum(
            leaf.nbytes for _, leaves in self.samples for leaf in leaves)

    def read(self, index: int, copy: bool = True) -> Sample:
        i = self.check_index(index)
        if self.schema is not None:
            treedef, leaves = self.schema, [col[i, ...] for col in self.columns]
        else:
            treedef, leaves = self.samples[i]
        if copy:
            leaves = [np.array(leaf) for leaf in leaves]
        return self.sample(i, treedef, leaves)

    def batch_layout(self) -> BatchLayout | None:
        return (self.schema, self.specs) if self.schema is not None else None

    def read_batch(self, indices: Indices, out: list[Leaf] | None = None) -> Batch:
        if self.schema is None:
            if out is not None:
                raise ValueError("out= is only supported for generations with a fixed layout")
            return stack_samples([self.read(i, copy=False) for i in indices])
        idx = batch_indices(indices, self.num_samples, self.generation)
        out = gather_columns(self.columns, self.specs, idx, out)
        return codec.unflatten_batch(self.schema, out)

    def close(self) -> None:
        pass  # arrays are shared with readers; they go with the last reference


class MemoryStaging(StagingData):
    """The samples already in an in-RAM staging area."""

    def __init__(self, staging: _Staging, allow_pickle: bool) -> None:
        self.staging = staging
        self.allow_pickle = allow_pickle

    def read(self, index: int) -> Sample:
        st = self.staging
        if index in st.samples or st.schema is None:
            treedef, leaves = st.samples[index]
        else:  # in its row of the columns
            treedef, leaves = st.schema, [col[index] for col in st.columns]
        return self.sample(index, treedef, [np.array(leaf) for leaf in leaves], where=st.token.path)


class MemoryBackend(Backend):
    """Generations in this process's memory: nothing on disk, gone when the store is closed.

    Written only from the process (and :class:`~cachestore.Store` object) that opened
    the writer: shard writers cannot cross processes, so loader workers hand their
    samples to the training process. Fixed-layout samples go straight into their
    final columns; others are kept one by one.
    """

    name = "memory"
    supports_multiprocess_write = False
    supports_zero_copy = True
    persistent = False

    def __init__(self, root: str, *, compression: str | None, allow_pickle: bool, verify: bool) -> None:
        super().__init__(root, compression=compression, allow_pickle=allow_pickle, verify=verify)
        self._meta: StoreMeta | None = None
        self._gens: dict[int, MemoryGeneration] = {}
        self._staging: dict[str, _Staging] = {}

    def read_meta(self) -> StoreMeta | None:
        return self._meta

    def write_meta(self, meta: StoreMeta) -> None:
        self._meta = dict(meta)

    def generations(self) -> list[GenerationInfo]:
        infos = [GenerationInfo(id=g.generation, num_samples=g.num_samples, nbytes=0, committed=True,
                                created=g.created, layout="fixed" if g.schema is not None else "records",
                                raw_bytes=g.nbytes, stored_bytes=g.nbytes)
                 for g in self._gens.values()]
        infos += [GenerationInfo(id=s.token.generation, num_samples=s.count(), nbytes=0, committed=False,
                                 created=s.created, raw_bytes=s.raw_bytes, stored_bytes=s.raw_bytes)
                  for s in self._staging.values()]
        return sorted(infos, key=lambda g: (g.id, g.committed))

    def begin(self, generation: int, budget: Budget, num_samples: int | None) -> StagingToken:
        if generation in self._gens:
            raise GenerationCommitted(f"generation {generation} of memory store {self.root} is already committed")
        token = StagingToken(f"memory:{next(_tokens)}", generation, budget, num_samples, False, self.allow_pickle)
        self._staging[token.path] = _Staging(token)
        return token

    def shard_writer(self, token: StagingToken, shard_id: str) -> ShardWriter:
        staging = self._staging.get(token.path)
        if staging is None:
            raise CacheStoreError("a memory store can only be written from the process (and Store object) "
                                  "that opened the writer; use the memmap or lmdb backend to write from workers")
        return MemoryShard(staging, self.allow_pickle)

    def commit(self, token: StagingToken, num_samples: int | None, extra: dict[str, object]) -> GenerationInfo:
        staging = self._staging[token.path]
        token.write_budget().check_usage(token.generation, staging.raw_bytes)  # all shards together
        n = check_complete(staging.indices() + staging.rewritten, num_samples,
                           f"generation {token.generation} of {self.root}")
        gen = MemoryGeneration(token.generation, staging, n, self.allow_pickle)
        del self._staging[token.path]
        self._gens[token.generation] = gen
        return GenerationInfo(id=gen.generation, num_samples=n, nbytes=0, committed=True, created=gen.created,
                              raw_bytes=gen.nbytes, stored_bytes=gen.nbytes, extra=extra)

    def discard(self, token: StagingToken) -> None:
        self._staging.pop(token.path, None)

    # partial generations (within this Store object only) ----------------------
    def record_staging(self, token: StagingToken, record: ProducerRecord) -> None:
        self._staging[token.path].record = dict(record)

    def keep(self, token: StagingToken) -> None:
        staging = self._staging.get(token.path)
        if staging is not None:
            staging.kept = True

    def adopt(self, generation: int, num_samples: int | None, record: ProducerRecord) -> StagingToken | None:
        if generation in self._gens:
            return None
        for staging in self._staging.values():
            if staging.kept and staging.token.generation == generation and staging.record == {
                    **record, "generation": generation}:
                staging.kept = False
                return staging.token
        return None

    def with_budget(self, token: StagingToken, budget: Budget) -> StagingToken:
        token = dataclasses.replace(token, budget=budget)
        self._staging[token.path].token = token
        return token

    def present(self, token: StagingToken) -> npt.NDArray[np.int64]:
        return np.array(sorted(self._staging[token.path].indices()), dtype=np.int64)

    def open_staging(self, token: StagingToken) -> StagingData:
        return MemoryStaging(self._staging[token.path], self.allow_pickle)

    def debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
               keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        return [(s.token.path, s.raw_bytes) for s in self._staging.values()
                if s.kept and s.token.path not in keep_paths and not (
                    keep_record is not None and s.record is not None
                    and all(s.record.get(k) == v for k, v in keep_record.items()))]

    def remove_debris(self, keep_pid: int | None = None, keep_record: ProducerRecord | None = None,
                      keep_paths: Collection[str] = ()) -> list[tuple[str, int]]:
        found = self.debris(keep_pid, keep_record, keep_paths)
        doomed = {path for path, _ in found}
        for path in doomed:
            self._staging.pop(path, None)
        return found

    def open_generation(self, generation: int) -> GenerationData:
        gen = self._gens.get(generation)
        if gen is None:
            staging = any(s.token.generation == generation for s in self._staging.values())
            raise GenerationNotFoundError(missing_generation(generation, f"memory store {self.root}", staging))
        return gen

    def remove_generation(self, generation: int) -> int:
        self._gens.pop(generation, None)
        return 0

    def close(self) -> None:
        self._gens.clear()
        self._staging.clear()
