"""Turning tasks into batches: call the dataset, write the generation, read the store.

A :class:`BatchProducer` runs wherever tasks run: in a worker process or
thread (:mod:`loader.executors.process.worker`), in a Ray actor
(:mod:`loader.executors.ray`), and in the training process itself
(``nb_worker=0``, cached epochs gathered there).
"""

from __future__ import annotations

import functools
import logging
import sys
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cachestore import Put, PutResult, Reader, SampleSink
from cachestore.errors import BudgetExceededError, CacheStoreError, CorruptSampleError
from cachestore.format import codec
from cachestore.format.collate import stack_samples
from cachestore.format.records import encode_record

from ..dataset import Batch, CollateFn, Dataset, ReadTransform, Sample, is_stream
from ..errors import SampleError, add_note, tag_sample_index
from ..settings import BudgetPolicy, EpochMode
from . import messages as m
from .seeds import GLOBAL_RANDOM, global_states, restore_globals, seed_globals, seeded_draws

log = logging.getLogger(__name__)


@dataclass
class Produced:
    """What one task produced: the batch, and what it wrote into the generation."""

    batch: Batch
    written: int = 0  # samples written into the task's shard
    records: list[m.Record] | None = None  # encoded samples for the training process to write
    budget_error: str | None = None  # why writing stopped, when the budget ran out
    staged: int = 0  # samples read back from the staging area instead of computed
    waited: int = 0  # of those, samples another process was computing when this task needed them


def transform(fn: ReadTransform, sample: Sample, seed: int, epoch: int, index: int, serve: int = 0,
              fresh: bool = False) -> Sample:
    """``fn(sample, rng)``, every random stream seeded by ``(seed, epoch, index)``.

    `rng` is a ``numpy.random.Generator`` of that triple; Python's and torch's
    global generators in this process are seeded from it too, so torchvision's
    random transforms draw the same numbers in any worker, thread or process,
    and after a resume, and given back their state after the call (the
    training loop's draws, with ``nb_worker=0`` or threads, do not depend on
    the transform). `serve` numbers the later serves of one sample in a
    rotation epoch (each draws anew). `fn` gets a copy of `sample`'s arrays
    and tensors unless the caller says they are `fresh` (its own): an
    in-place ``img *= -1`` must not change the dataset's arrays
    (``TensorDataset`` returns views of them), a store's or a rotation window's.

    Raises
    ------
    SampleError
        `fn` raised (the cause is the user's own exception).
    """
    key = [seed, epoch, index] if serve == 0 else [seed, epoch, index, serve]
    sequence = np.random.SeedSequence(key)
    # The global generators are the process's: worker threads take turns, or one would reseed them
    # under another's draws. (Worker processes never wait here.)
    if not fresh:
        sample = private_copy(sample)
    with GLOBAL_RANDOM:
        saved = global_states()
        seed_globals(sequence)
        try:
            return fn(sample, np.random.default_rng(sequence))
        except Exception as exc:
            raise SampleError(index, exc, "read_transform") from exc
        finally:
            restore_globals(saved)


def private_copy(sample: Sample) -> Sample:
    """`sample` with its numpy arrays and torch tensors copied (only their own elements: a view's
    base is not), through dicts, lists and tuples (named ones too); other values as they are."""
    if isinstance(sample, np.ndarray):
        return sample.copy()
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(sample, torch.Tensor):
        return sample.clone()
    if type(sample) is dict:
        return {key: private_copy(value) for key, value in sample.items()}
    if type(sample) is list:
        return [private_copy(value) for value in sample]
    if isinstance(sample, tuple):
        items = [private_copy(value) for value in sample]
        return type(sample)(*items) if hasattr(sample, "_fields") else type(sample)(items)
    return sample


def owned(batch: Batch) -> Batch:
    """`batch` with every numpy array that is not its own, writable memory copied (views of a store,
    and ``np.memmap`` s), as plain ``ndarray`` s."""
    treedef, leaves = codec.flatten(batch, allow_pickle=True)

    def own(leaf: np.ndarray) -> bool:
        return type(leaf) is np.ndarray and leaf.flags.owndata and leaf.flags.writeable

    if all(own(leaf) for leaf in leaves):
        return batch
    return codec.unflatten(treedef, [leaf if own(leaf) else np.array(leaf) for leaf in leaves], allow_pickle=True)


class BatchProducer:
    """Turns tasks into batches: call the dataset, write the generation, read the store."""

    def __init__(self, dataset: Dataset, collate_fn: CollateFn | None, shard_id: str, allow_pickle: bool,
                 hands_out: bool = False, read_transform: ReadTransform | None = None) -> None:
        self.dataset = dataset
        self.collate = collate_fn or stack_samples
        self.custom_collate = collate_fn is not None
        self.shard_id = shard_id
        self.allow_pickle = allow_pickle
        # Its batches go to the caller as they are (the training process's producer); a worker's
        # are copied into a shared-memory slot anyway.
        self.hands_out = hands_out
        self.read_transform = read_transform
        self._sink: SampleSink | None = None  # where the generation being written gets this process's samples
        self._reader: Reader | None = None
        self._reader_key: m.ReadSource | None = None

    # generation sinks ----------------------------------------------------
    def _sink_for(self, task: m.Task) -> SampleSink | None:
        """Where the samples of `task` are put (kept open from task to task of one generation); ``None``
        when it writes nothing from here (a compute task, or records sent to the training process)."""
        if task.mode != EpochMode.GENERATE or task.shard is None:
            return None
        stop = task.on_budget != BudgetPolicy.ERROR
        sink = self._sink
        if sink is None or sink.closed or sink.token != task.shard.token or sink.stop_when_full != stop:
            self.close_shard()
            sink = self._sink = task.shard.sink(self.shard_id, stop_when_full=stop)
        return sink

    def close_shard(self) -> None:
        """Close the shard of the generation being written (its final flush), give its claims back."""
        sink, self._sink = self._sink, None
        if sink is not None:
            sink.close()

    # reading ---------------------------------------------------------------
    def reader(self, key: m.ReadSource | None) -> Reader:
        """A reader of the committed generation `key` names, kept open from task to task."""
        if key is None:
            raise ValueError("a read task names the generation it reads")
        if self._reader_key != key:
            if self._reader is not None:
                self._reader.close()
            spec, generation, _ = key
            self._reader = None  # a failed open must not leave the closed reader behind
            self._reader = Reader.open(spec, generation)
            self._reader_key = key
        assert self._reader is not None
        return self._reader

    # tasks -----------------------------------------------------------------
    def compute(self, task: m.Task) -> Produced:
        """Samples of `task` from the dataset, put into the generation if asked, collated.

        Each sample is put through the store's :class:`~cachestore.SampleSink`, which computes it only
        when it is this process's to write, and says otherwise that it is in the generation already
        (read back) or that another process computes it now: those are waited for once this task's
        own samples are written and flushed (nothing is held while waiting; see :mod:`cachestore.write.sink`).
        """
        if task.keys:
            return self._whole(task)
        sink = self._sink_for(task)
        out = Produced(None, records=[] if task.send_records else None)
        stopped = sink.budget_error if sink is not None else None
        got: dict[int, Sample] = {}  # position -> sample: a position drawn twice in a task is served once
        try:
            samples, later = self._first_pass(task, sink, out, got)
            if sink is not None:
                sink.flush()
                for k in later:  # nothing is held now: waiting cannot deadlock with another waiter
                    index, pos = int(task.indices[k]), int(task.stored_at[k])
                    if pos in got:
                        out.staged += 1
                    else:
                        put = sink.wait(pos, functools.partial(self._call, index))
                        out.waited += put.result is PutResult.PRESENT
                        got[pos] = self._outcome(put, sink, index, pos, out)
                    samples[k] = got[pos]
        except BaseException:
            if sink is not None:
                sink.release()  # samples not written: another process computes them
            raise
        if sink is not None and sink.budget_error != stopped:
            out.budget_error = sink.budget_error  # writing stopped in this task (the budget policy)
        samples = self.transformed(task, samples)
        out.batch = self.collate(samples) if task.collate else samples
        return out

    def _whole(self, task: m.Task) -> Produced:
        """The batch of a task whose indices are one list a sampler yielded: ``dataset[list]``, called once
        and served as it is, as torch's loading without auto-collation (never written: the planner refuses
        a cache with such a sampler)."""
        keys = task.indices.tolist()
        try:
            sample = self.dataset[keys]
        except Exception as exc:
            raise SampleError(keys[0] if keys else -1, exc) from exc
        samples = self.transformed(task, [sample])
        return Produced(self.collate(samples) if task.collate else samples)

    def _first_pass(self, task: m.Task, sink: SampleSink | None, out: Produced,
                    got: dict[int, Sample]) -> tuple[list[Sample], list[int]]:
        """Every sample of `task` that need not wait for another process, in order; the places of those
        that must (``None`` until they are waited for)."""
        present = task.present.tolist() if task.present is not None else None
        samples: list[Sample] = []
        later: list[int] = []
        for k, (index, pos) in enumerate(zip(task.indices.tolist(), task.stored_at.tolist())):
            if pos in got:
                out.staged += 1
            elif present is not None and present[k]:
                # Already in the generation (written before an interruption, or by an earlier batch of this
                # epoch): served, never rewritten.
                got[pos] = self._read_back(sink, index, pos, out)
            elif sink is None:
                got[pos] = self._computed(index, pos, out)
            else:
                put = sink.put(pos, functools.partial(self._call, index))
                if put.result is PutResult.WAIT:
                    later.append(k)
                    samples.append(None)
                    continue
                got[pos] = self._outcome(put, sink, index, pos, out)
            samples.append(got[pos])
        return samples, later

    def _outcome(self, put: Put, sink: SampleSink, index: int, pos: int, out: Produced) -> Sample:
        """The sample a put answered for: the one computed here, or the generation's."""
        if put.result is PutResult.PRESENT:
            return self._read_back(sink, index, pos, out)
        out.written += put.result is PutResult.WRITTEN
        return put.sample

    def _read_back(self, sink: SampleSink | None, index: int, pos: int, out: Produced) -> Sample:
        """Sample `pos` read back from the generation being written (computed when it cannot be read)."""
        sample = sink.read(pos) if sink is not None else None
        if sample is None:
            return self._call(index)
        out.staged += 1
        return owned(sample) if self.hands_out else sample

    def _computed(self, index: int, pos: int, out: Produced) -> Sample:
        """Sample `index` computed here, and encoded for the training process when it writes the records."""
        sample = self._call(index)
        if out.records is not None:
            out.records.append((pos, encode_record(*codec.flatten(sample, self.allow_pickle))))
        return sample

    def _call(self, index: int) -> Sample:
        try:
            return self.dataset[index]
        except Exception as exc:
            raise SampleError(index, exc) from exc

    def samples(self, indices: Iterable[int] | np.ndarray, epoch: int) -> list[Sample]:
        """``dataset[i]`` for each of `indices`, in this process: a dataset error is raised as itself,
        with the index (``sample_index``) and a note saying where, as every other path does."""
        out = []
        for index in (int(i) for i in indices):
            try:
                out.append(self.dataset[index])
            except Exception as exc:
                tag_sample_index(exc, index)
                add_note(exc, f"raised by the dataset while computing sample {index} of epoch {epoch}")
                raise
        return out

    def read(self, task: m.Task, reader: Reader | None = None) -> Batch:
        """The batch from the committed generation; a corrupt record is a miss: recompute the batch."""
        try:
            return self.gather(task, reader if reader is not None else self.reader(task.reader))
        except CorruptSampleError as exc:
            return self.recompute(task, exc)

    def gather(self, task: m.Task, reader: Reader) -> Batch:
        """The samples of read task `task` from `reader`, collated unless the task says not to.

        What is handed out from the training process belongs to the caller
        (``hands_out``): never a view of the store, which another epoch serves
        again (an in-RAM store's arrays themselves, a read-only mapping).

        Raises
        ------
        CorruptSampleError
            A record failed its checksum.
        """
        own = self.hands_out
        if not self.gathers_whole(task):
            # A transform may change a sample in place: it gets the caller's own copy, never the store's.
            samples = self.transformed(task, self.rows(task, reader), fresh=True) if self.transforms(task) else \
                [reader.get(int(i), copy=own) for i in task.stored_at]
            return self.collate(samples) if task.collate else samples
        batch = reader.get_batch(task.stored_at)
        return owned(batch) if own else batch

    @staticmethod
    def rows(task: m.Task, reader: Reader) -> list[Sample]:
        """The samples of `task`, each in memory of its own: one verified gather of the batch into new
        arrays, split into rows, where the generation has a fixed layout (a copy and a checksum call
        per sample cost twice as much), else one own copy per sample."""
        layout = reader.batch_layout()
        if layout is None:
            return [reader.get(int(i), copy=True) for i in task.stored_at]
        treedef, specs = layout
        count = len(task.stored_at)
        leaves = [np.empty((count, *shape), dtype=dtype) for dtype, shape in specs]
        reader.get_batch(task.stored_at, out=leaves)
        # leaf[r, ...]: a 0-d array for a scalar leaf (leaf[r] is a numpy scalar, no tensor can be made of it)
        return [codec.unflatten(treedef, [leaf[r, ...] for leaf in leaves]) for r in range(count)]

    def recompute(self, task: m.Task, exc: CorruptSampleError) -> Batch:
        built = getattr(self.dataset, "built", None)  # a worker's dataset, built at its first use
        if is_stream(built() if callable(built) else self.dataset):
            error = CorruptSampleError(
                f"{exc}. A stream's samples cannot be computed again by index: remove the damaged generation "
                "(cachestore prune PREFIX --keep 0) and the next epoch iterates the stream again")
            error.generation, error.index = exc.generation, exc.index
            raise error from exc
        log.warning("%s; computing this batch from the dataset instead", str(exc))
        samples = self.transformed(task, [self._call(index) for index in task.indices.tolist()])
        return self.collate(samples) if task.collate else samples

    def gathers_whole(self, task: m.Task) -> bool:
        """Whether the batch of read task `task` is what the store gives for its rows, collated by the
        default collate: one verified gather of the whole batch (into a worker's slot, a thread's
        buffer, new arrays), not sample by sample. The one place this is decided, for every read path
        (docs/ARCHITECTURE.md, "The path of a batch")."""
        return task.collate and not self.custom_collate and not self.transforms(task)

    def transforms(self, task: m.Task) -> bool:
        """Whether the samples of `task` go through ``read_transform``."""
        return self.read_transform is not None and task.transform_seed is not None

    def transformed(self, task: m.Task, samples: list[Sample], fresh: bool = False) -> list[Sample]:
        """`samples` through ``read_transform``, each with its own random streams (see :func:`transform`;
        `fresh`: the samples are this call's own, not the dataset's or the store's)."""
        if not self.transforms(task):
            return samples
        assert self.read_transform is not None and task.transform_seed is not None
        return [transform(self.read_transform, sample, task.transform_seed, task.epoch, int(index), fresh=fresh)
                for sample, index in zip(samples, task.indices.tolist())]

    def produce(self, task: m.Task) -> Produced:
        """Run `task` in this process (read, or compute and maybe write)."""
        if task.mode == EpochMode.READ:
            return Produced(self.read(task))
        if task.draws_seed is not None:  # a dataset whose randomness is its state: see loader.executors.seeds
            with seeded_draws(task.draws_seed, task.epoch, task.indices):
                return self.compute(task)
        return self.compute(task)

    def close(self) -> None:
        try:
            self.close_shard()
        finally:
            if self._reader is not None:
                self._reader.close()
                self._reader = None


def task_failure(exc: BaseException, task: m.Task | None, worker_id: int) -> m.TaskFailed:
    epoch, seq, part = (task.epoch, task.seq, task.part) if task is not None else (-1, -1, -1)
    if isinstance(exc, SampleError):
        return m.TaskFailed.from_exception(exc.cause, epoch=epoch, seq=seq, part=part, worker_id=worker_id,
                                           index=exc.index, kind="read_transform" if exc.stage == "read_transform"
                                           else "dataset")
    kind: m.FailureKind = "budget" if isinstance(exc, BudgetExceededError) else (
        "store" if isinstance(exc, CacheStoreError) else "dataset")
    failed = m.TaskFailed.from_exception(exc, epoch=epoch, seq=seq, part=part, worker_id=worker_id,
                                         index=None, kind=kind)
    if isinstance(exc, BudgetExceededError) and exc.fits_samples is not None:
        failed.extra["fits_samples"] = exc.fits_samples
    return failed

