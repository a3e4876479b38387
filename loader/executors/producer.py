"""Turning tasks into batches: call the dataset, write the generation, read the store.

A :class:`BatchProducer` runs wherever tasks run: in a worker process or
thread (:mod:`loader.executors.process.worker`), in a Ray actor
(:mod:`loader.executors.ray`), and in the training process itself
(``nb_worker=0``, cached epochs gathered there).
"""

from __future__ import annotations

import logging
import os
import random
import secrets
import sys
import threading
from dataclasses import dataclass
from typing import Iterable

import numpy as np

from cachestore import Reader, ShardSpec, codec
from cachestore.records import encode_record
from cachestore.backends.base import ShardWriter
from cachestore.backends.reading import StagingData
from cachestore.claims import Claims
from cachestore.collate import stack_samples
from cachestore.errors import BudgetExceededError, CacheStoreError, CorruptSampleError

from ..dataset import Batch, CollateFn, Dataset, ReadTransform, Sample
from ..errors import SampleError, add_note, tag_sample_index
from ..settings import BudgetPolicy, EpochMode
from . import messages as m

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


_GLOBAL_RANDOM = threading.Lock()


def _seed_globals(sequence: np.random.SeedSequence) -> None:
    """Seed Python's and torch's global generators of this process from `sequence`."""
    state = int(sequence.generate_state(2, np.uint32).astype(np.uint64) @ np.array([1 << 32, 1], np.uint64))
    random.seed(state)
    torch = sys.modules.get("torch")
    if torch is not None:
        # The CPU generator alone: torch.manual_seed also goes through every accelerator's
        # (lazily), which costs a hundred times more than seeding the CPU's.
        torch.default_generator.manual_seed(state & 0x7FFF_FFFF_FFFF_FFFF)
        if torch.cuda.is_initialized():
            torch.cuda.manual_seed_all(state & 0x7FFF_FFFF_FFFF_FFFF)


def seed_worker(seed: int, worker_id: int) -> None:
    """Seed a worker process's global generators from ``(seed, worker_id)``, as torch seeds its workers.

    Python's, numpy's legacy and torch's generators: workers forked from one
    process would otherwise draw the same random numbers in ``__getitem__``.
    Runs before ``worker_init_fn``, which may reseed them its own way.
    """
    sequence = np.random.SeedSequence([seed, worker_id])
    _seed_globals(sequence)
    np.random.seed(sequence.generate_state(4))


def transform(fn: ReadTransform, sample: Sample, seed: int, epoch: int, index: int, serve: int = 0) -> Sample:
    """``fn(sample, rng)``, every random stream seeded by ``(seed, epoch, index)``.

    `rng` is a ``numpy.random.Generator`` of that triple; Python's and torch's
    global generators in this process are seeded from it too, so torchvision's
    random transforms draw the same numbers in any worker, thread or process,
    and after a resume. `serve` numbers the later serves of one sample in a
    rotation epoch (each draws anew).

    Raises
    ------
    SampleError
        `fn` raised (the cause is the user's own exception).
    """
    key = [seed, epoch, index] if serve == 0 else [seed, epoch, index, serve]
    sequence = np.random.SeedSequence(key)
    # The global generators are the process's: worker threads take turns, or one would reseed them
    # under another's draws. (Worker processes never wait here.)
    with _GLOBAL_RANDOM:
        _seed_globals(sequence)
        try:
            return fn(sample, np.random.default_rng(sequence))
        except Exception as exc:
            raise SampleError(index, exc, "read_transform") from exc


def _write_failed(task: m.Task, exc: OSError) -> CacheStoreError:
    """A store error (not the dataset's) for a write that failed: the generation's files went away."""
    where = task.shard.token.path if task.shard is not None else "the generation"
    return CacheStoreError(f"writing into {where} failed ({type(exc).__name__}: {exc}); was the cache "
                           "directory removed while it was written?")


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
        self._shard: ShardWriter | None = None
        self._shard_token: object = None
        self._shard_name = shard_id  # the shard's name in its staging area (unique per process when shared)
        self._claims: Claims | None = None  # a shared staging area's claims (cachestore.claims)
        self._staging: StagingData | None = None  # reads back samples a partial generation already holds
        self._staging_token: object = None
        self._writing = True
        self._reader: Reader | None = None
        self._reader_key: m.ReadSource | None = None

    # generation shards ---------------------------------------------------
    def _shard_for(self, spec: ShardSpec) -> ShardWriter | None:
        if self._shard_token != spec.token:
            self.close_shard()
            # Other processes write a shared area too, with workers of the same numbers: a name of its own.
            self._shard_name = (f"{self.shard_id}-p{os.getpid()}-{secrets.token_hex(3)}" if spec.token.shared
                                else self.shard_id)
            self._shard = spec.open(self._shard_name)
            self._shard_token = spec.token
            self._writing = True
            if spec.token.shared and spec.token.num_samples is not None:
                self._claims = Claims(spec.token.path, spec.token.num_samples)
        return self._shard if self._writing else None

    def close_shard(self) -> None:
        shard, self._shard, self._shard_token = self._shard, None, None
        claims, self._claims = self._claims, None
        if claims is not None:
            claims.close()
        self._writing = True
        staging, self._staging, self._staging_token = self._staging, None, None
        if staging is not None:
            staging.close()
        if shard is not None:
            shard.close()

    def _staged(self, spec: ShardSpec | None, pos: int) -> Sample | None:
        """Sample `pos` as the generation being written already holds it, ``None`` when it cannot be read here."""
        if spec is None:
            return None  # records travel to the training process: nothing to read from here
        if self._staging_token != spec.token:
            if self._staging is not None:
                self._staging.close()
            self._staging, self._staging_token = spec.open_staging(), spec.token
        if self._staging is None:
            return None
        try:
            sample = self._staging.read(pos)
            return owned(sample) if self.hands_out else sample
        except CacheStoreError as exc:
            if spec.token.shared and not os.path.lexists(spec.token.path):
                # Committed by another process writing it together (its files moved into the generation).
                return self.reader((spec.spec, spec.token.generation, None)).get(pos, copy=True)
            # Adoption checked every record: this is damage since. Serve a computed sample; the
            # stored one stays (it must not be written twice) and a cached read recomputes it.
            log.warning("%s; computing it from the dataset instead", exc)
            return None

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
        """Samples of `task` from the dataset, written to the shard if asked, collated.

        In a shared staging area (several processes write the generation) each
        sample is claimed before it is computed: one another process holds is
        waited for and read back once written, after this task's own samples
        (nothing is held while waiting), one it finished is read back.
        """
        try:
            shard = (self._shard_for(task.shard) if task.mode == EpochMode.GENERATE and task.shard is not None
                     else None)
        except (CacheStoreError, FileNotFoundError):
            if self._committed_meanwhile(task.shard):
                return self._from_committed(task)
            if task.shard is None or not task.shard.token.shared:
                raise
            # The shared area is gone or broken (its files removed, a member killed inside its commit):
            # the batch is served all the same, computed and not written; the generation is written
            # again when an epoch needs it (docs/ARCHITECTURE.md, "Writing together").
            self.close_shard()
            log.warning("the shared staging area %s went away or broke while it was written; computing this "
                        "batch without writing it", task.shard.token.path)
            computed = self.transformed(task, [self._call(int(i)) for i in task.indices])
            return Produced(self.collate(computed) if task.collate else computed)
        claims = self._claims if shard is not None else None
        positions = task.stored_at.tolist()
        samples: list[Sample] = []
        out = Produced(None)
        records: list[m.Record] | None = [] if task.send_records else None
        present = task.present.tolist() if task.present is not None else None
        done: dict[int, Sample] = {}  # a position drawn twice in this task (a sampler's): computed once
        later: list[int] = []  # positions another process computes now
        try:
            for k, (index, pos) in enumerate(zip(task.indices.tolist(), positions)):
                if pos in done:
                    samples.append(done[pos])
                    out.staged += 1
                    continue
                if (present is not None and present[k]) or (claims is not None and not claims.try_claim(pos)
                                                            and claims.done(pos)):
                    # Already in the generation (written before an interruption, by an earlier batch of this
                    # epoch, or by another process): served, never rewritten.
                    samples.append(done.setdefault(pos, self._served_staged(task, index, pos, out)))
                    continue
                if claims is not None and pos not in claims.held:
                    later.append(k)
                    samples.append(None)
                    continue
                shard = self._put(task, index, pos, shard, samples, done, out, records)
            shard = self._flush(task, shard, out, claims)
            for k in later:  # nothing is held now: waiting cannot deadlock with another waiter
                index, pos = int(task.indices[k]), positions[k]
                assert claims is not None
                if claims.wait_claim(pos):  # its holder died before writing it: ours to compute
                    shard = self._put(task, index, pos, shard, samples, done, out, records, at=k)
                    shard = self._flush(task, shard, out, claims)
                else:
                    samples[k] = done.setdefault(pos, self._served_staged(task, index, pos, out))
                    out.waited += 1
        finally:
            if claims is not None:
                claims.release()  # claims of samples not written (an error): someone else computes them
        samples = self.transformed(task, samples)
        out.batch = self.collate(samples) if task.collate else samples
        out.records = records
        return out

    def _committed_meanwhile(self, spec: ShardSpec | None) -> bool:
        """Whether the shared area `spec` names is gone because another process writing it together
        committed it (every sample was in): not a removal."""
        if spec is None or not spec.token.shared or os.path.lexists(spec.token.path):
            return False
        self.close_shard()
        try:
            self.reader((spec.spec, spec.token.generation, None))
        except CacheStoreError:
            return False
        return True

    def _from_committed(self, task: m.Task) -> Produced:
        """Task `task` of a generate epoch served from the generation another process committed."""
        assert task.shard is not None
        reader = self.reader((task.shard.spec, task.shard.token.generation, None))
        samples: list[Sample] = [reader.get(pos, copy=True) for pos in task.stored_at.tolist()]
        samples = self.transformed(task, samples)
        return Produced(self.collate(samples) if task.collate else samples, staged=len(samples))

    def _served_staged(self, task: m.Task, index: int, pos: int, out: Produced) -> Sample:
        """Sample `pos` read back from the generation being written (computed when it cannot be read)."""
        sample = self._staged(task.shard, pos)
        if sample is None:
            return self._call(index)
        out.staged += 1
        return sample

    def _put(self, task: m.Task, index: int, pos: int, shard: ShardWriter | None, samples: list[Sample],
             done: dict[int, Sample], out: Produced, records: list[m.Record] | None,
             at: int | None = None) -> ShardWriter | None:
        """Compute sample `index`, serve it (append, or at `at`), write it at `pos`; the shard, ``None``
        once writing stopped (the budget)."""
        sample = self._call(index)
        if at is None:
            samples.append(done.setdefault(pos, sample))
        else:
            samples[at] = done.setdefault(pos, sample)
        if shard is not None:
            try:
                shard.put(pos, sample)
                out.written += 1
            except BudgetExceededError as exc:
                out.budget_error = self._stop_writing(task, exc)
                shard = None
            except OSError as exc:
                raise _write_failed(task, exc) from exc
        if records is not None:
            records.append((pos, encode_record(*codec.flatten(sample, self.allow_pickle))))
        return shard

    def _flush(self, task: m.Task, shard: ShardWriter | None, out: Produced,
               claims: Claims | None) -> ShardWriter | None:
        """Flush the shard (before the result is sent: what was delivered is on disk), then mark the
        claimed samples done; the shard, ``None`` once writing stopped."""
        if shard is None:
            if claims is not None:
                # Writing stopped (the budget): what this task computed is not written, and claims
                # held while it waits for other processes' samples would deadlock with theirs.
                claims.release()
            return None
        try:
            shard.flush()
        except BudgetExceededError as exc:
            # A buffering backend (lmdb) meets the full disk here, not in put().
            out.budget_error = self._stop_writing(task, exc)
            if claims is not None:
                claims.release()
            return None
        except OSError as exc:
            raise _write_failed(task, exc) from exc
        if claims is not None:
            claims.finish(list(claims.held), self._shard_name)
        return shard

    def _call(self, index: int) -> Sample:
        try:
            return self.dataset[index]
        except Exception as exc:
            raise SampleError(index, exc) from exc

    def _stop_writing(self, task: m.Task, exc: BudgetExceededError) -> str:
        """The generation does not fit: raise (policy "error") or stop writing it and keep serving."""
        if task.on_budget == BudgetPolicy.ERROR:
            raise exc
        self._writing = False
        return str(exc)

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
        if not task.collate or self.custom_collate or self.transforms(task):
            # A transform may change a sample in place: it gets the caller's own copy, never the store's.
            samples = self.transformed(task, self.rows(task, reader) if self.transforms(task) else
                                       [reader.get(int(i), copy=own) for i in task.stored_at])
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
        return [codec.unflatten(treedef, [leaf[r] for leaf in leaves]) for r in range(count)]

    def recompute(self, task: m.Task, exc: CorruptSampleError) -> Batch:
        log.warning("%s; computing this batch from the dataset instead", str(exc))
        samples = self.transformed(task, [self._call(index) for index in task.indices.tolist()])
        return self.collate(samples) if task.collate else samples

    def transforms(self, task: m.Task) -> bool:
        """Whether the samples of `task` go through ``read_transform``."""
        return self.read_transform is not None and task.transform_seed is not None

    def transformed(self, task: m.Task, samples: list[Sample]) -> list[Sample]:
        """`samples` through ``read_transform``, each with its own random streams (see :func:`transform`)."""
        if not self.transforms(task):
            return samples
        assert self.read_transform is not None and task.transform_seed is not None
        return [transform(self.read_transform, sample, task.transform_seed, task.epoch, int(index))
                for sample, index in zip(samples, task.indices.tolist())]

    def produce(self, task: m.Task) -> Produced:
        """Run `task` in this process (read, or compute and maybe write)."""
        if task.mode == EpochMode.READ:
            return Produced(self.read(task))
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

