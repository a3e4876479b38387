"""The backend conformance suite: every test runs unchanged against memmap, lmdb and memory, and
against ``plainfiles``, a backend of the tests' own plugged in through ``register_backend``
(tests/plain_backend.py).

The backend comes from the parametrised ``backend`` fixture (conftest.py's, with the plugged-in one
added here); compression is a second parameter where it changes the storage path. A test asks the
backend's capability flags, never its name, for what a backend may do differently.
"""

from __future__ import annotations

import fractions
import pickle
import time

import numpy as np
import pytest
import torch

from cachestore import (CacheStoreError, GenerationCommitted, GenerationNotFoundError, StoreLockedError,
                        UnsupportedSampleError, open_store, stack_samples)

from ..plain_backend import PlainFilesBackend
from .conftest import BACKENDS
from .helpers import (Opaque, assert_same, check_generation, fixed_sample, leftovers, variable_sample,
                      write_generation)

COMPRESSIONS = [None, "zstd"]


@pytest.fixture(params=[*BACKENDS, PlainFilesBackend.name])
def backend(request: pytest.FixtureRequest) -> str:
    return request.param


def every_kind(generation: int, index: int) -> dict:
    """One sample holding every kind the codec supports (not stackable: str, bytes, None)."""
    i = index + 10 * generation
    return {
        "f32": np.arange(12, dtype=np.float32).reshape(3, 4) + i,
        "f64_0d": np.array(i * 0.5),
        "u8": np.full(5, i % 256, dtype=np.uint8),
        "i64": np.arange(3, dtype=np.int64) * i,
        "f16": np.linspace(0, 1, 4, dtype=np.float16) + i,
        "bool": np.array([i % 2 == 0, True]),
        "c64": np.array([1 + 2j * i], dtype=np.complex64),
        "big_endian": np.arange(3, dtype=">i4") + i,
        "datetime": np.array([i, i + 1], dtype="datetime64[s]"),
        "strided": (np.arange(40, dtype=np.float32).reshape(4, 10) + i)[:, ::3],
        "fortran": np.asfortranarray(np.arange(6.0).reshape(2, 3) + i),
        "empty": np.zeros((0, 3), dtype=np.float32),
        "tensor": torch.arange(4, dtype=torch.float32) + i,
        "bf16": torch.full((2, 3), float(i), dtype=torch.bfloat16),
        "tensor_0d": torch.tensor(i),
        "tensor_strided": (torch.arange(12.0).reshape(3, 4) + i).t(),
        "np_scalar": np.float32(i) / 4,
        "int": i - 3,
        "big_int": 2**62 + i,
        "float": i / 3,
        "bool_": i % 2 == 1,
        "none": None,
        "str": f"sample-{i}-é",
        "bytes": bytes([i % 256]) * 3,
        "nested": [(np.int32(i), i), {"deep": [1.5 * i, True, "x" * i]}, ()],
    }


def stackable(generation: int, index: int) -> dict:
    """Fixed structure and shapes: arrays (several dtypes, 0-d, non-contiguous), tensors, scalars."""
    i = index + 10 * generation
    return {
        "image": (np.arange(2 * 3 * 8, dtype=np.float32).reshape(2, 3, 8) + i)[:, :, ::2],
        "zero_d": np.array(i, dtype=np.int16),
        "mask": np.array([i % 2 == 0, i % 3 == 0]),
        "when": np.array([i, 2 * i], dtype="datetime64[ms]"),
        "tensor": torch.full((2, 2), i, dtype=torch.float64),
        "bf16": torch.full((3,), i / 8, dtype=torch.bfloat16),
        "label": i,
        "score": i * 0.25,
        "flag": i % 2 == 0,
        "np_scalar": np.uint8(i),
        "nested": [(np.float16(i), {"k": np.arange(2, dtype=np.int8) + i})],
    }


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_every_kind_round_trips(make_store, backend, compression):
    store = make_store(backend, compression=compression)
    write_generation(store, 0, 5, every_kind)
    reader = store.reader()
    for i in range(5):
        got = reader[i]
        assert_same(every_kind(0, i), got, f"sample {i}")
        assert got["f32"].flags.writeable, "reader[i] promises writable copies"
    assert_same(stack_samples([every_kind(0, i) for i in [4, 0, 2]]), reader.get_batch([4, 0, 2]))


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_fixed_shape_dataset(make_store, backend, compression):
    store = make_store(backend, compression=compression)
    write_generation(store, 0, 20, stackable)
    reader = store.reader()
    check_generation(reader, 0, 20, stackable)
    if compression is None:
        # The columnar layout: a batch is one gather per leaf, optionally into the caller's arrays.
        layout = reader.batch_layout()
        assert layout is not None
        idx = [7, 3, 3, 19]
        out = [np.empty((len(idx), *shape), dtype=dtype) for dtype, shape in layout[1]]
        batch = reader.get_batch(idx, out=out)
        assert_same(stack_samples([stackable(0, i) for i in idx]), batch)
        assert np.shares_memory(batch["image"], out[0])
    else:
        assert reader.batch_layout() is None or not store.backend.persistent  # in RAM: nothing compressed


@pytest.mark.parametrize("compression", COMPRESSIONS)
def test_variable_shape_dataset(make_store, backend, compression):
    store = make_store(backend, compression=compression)
    write_generation(store, 0, 12, variable_sample)
    reader = store.reader()
    check_generation(reader, 0, 12, variable_sample)
    batch = reader.get_batch([1, 2, 3])
    assert isinstance(batch["tokens"], list)  # shapes differ: one array per sample
    assert isinstance(batch["weight"], np.ndarray) and batch["weight"].dtype == np.float32


def test_get_batch_equals_stacked_reads(store):
    write_generation(store, 0, 40, stackable)
    reader = store.reader()
    rng = np.random.default_rng(0)
    for idx in (rng.permutation(40)[:17], rng.integers(0, 40, 9), np.array([5]), [39, 0, 39]):
        expected = stack_samples([reader[int(i)] for i in idx])
        assert_same(expected, reader.get_batch(idx))
        assert_same(expected, reader.get_batch([int(i) for i in idx]))


def test_get_batch_of_mixed_structures(store):
    # Samples 0..4 fixed, 5..9 variable: no single layout covers the generation.
    make = lambda g, i: fixed_sample(g, i) if i < 5 else variable_sample(g, i)  # noqa: E731
    write_generation(store, 0, 10, make)
    reader = store.reader()
    for i in range(10):
        assert_same(make(0, i), reader[i])
    for idx in ([1, 3], [6, 9, 8]):  # a batch holds samples of one structure
        assert_same(stack_samples([make(0, i) for i in idx]), reader.get_batch(idx))


def test_out_of_range_index(store):
    write_generation(store, 0, 6)
    reader = store.reader()
    for bad in (6, 100, -7):
        with pytest.raises(IndexError):
            reader[bad]
        with pytest.raises(IndexError):
            reader.get_batch([0, bad])
    assert_same(fixed_sample(0, 5), reader[-1])
    assert_same(reader.get_batch([5, 4]), reader.get_batch([-1, -2]))
    for bad in (1.0, True):
        with pytest.raises(TypeError):
            reader[bad]
    with pytest.raises(TypeError):
        reader.get_batch([0, 1.5])


def test_reading_an_uncommitted_generation(store):
    with pytest.raises(GenerationNotFoundError):
        store.reader()  # nothing committed yet
    write_generation(store, 0, 4)
    writer = store.writer(1, 4)
    writer.put(0, fixed_sample(1, 0))
    with pytest.raises(GenerationNotFoundError, match="a staging area of generation 1 is there"):
        store.reader(1)
    with pytest.raises(GenerationNotFoundError, match="never committed, or was removed since") as missing:
        store.reader(9)
    assert "staging" not in str(missing.value)
    assert store.latest() == 0
    assert store.reader().generation == 0
    writer.abort()
    with pytest.raises(GenerationNotFoundError):
        store.reader(1)


def test_a_generation_removed_while_it_is_opened_is_not_found_not_damaged(store, monkeypatch):
    # A removal renames the directory away, then deletes it: an open between reading the manifest
    # and the files it names found schema.json gone and called the generation damaged.
    write_generation(store, 0, 4, stackable)
    backend = store.backend
    if not hasattr(backend, "_open"):
        pytest.skip(f"{type(backend).__name__} opens a generation in one step: no open to race")
    opened = backend._open

    def removed_meanwhile(gen_dir, manifest):
        assert backend.remove_generation(0) > 0
        return opened(gen_dir, manifest)

    monkeypatch.setattr(backend, "_open", removed_meanwhile)
    with pytest.raises(GenerationNotFoundError, match="never committed, or was removed since"):
        store.reader(0)
    monkeypatch.undo()
    write_generation(store, 0, 4, stackable)  # written again: its files are read, not the removed one's
    check_generation(store.reader(0), 0, 4, stackable)


def test_reader_pickles(store):
    write_generation(store, 0, 8)
    reader = store.reader()
    reader[0]  # open its handles before pickling
    clone = pickle.loads(pickle.dumps(reader))
    assert clone.generation == 0 and len(clone) == 8
    check_generation(clone, 0, 8)
    clone.close()
    check_generation(clone, 0, 8)  # reopens after close
    store.close()
    check_generation(pickle.loads(pickle.dumps(reader)), 0, 8)


def test_many_readers_of_one_generation(store):
    write_generation(store, 0, 6)
    first, second = store.reader(0), store.reader(0)
    check_generation(first, 0, 6)
    check_generation(second, 0, 6)
    assert store.verify() == []  # opens the generation once more
    first.close()
    check_generation(second, 0, 6)
    second.close()
    check_generation(second, 0, 6)


def test_writer_aborts_on_exception(store):
    write_generation(store, 0, 4)
    with pytest.raises(RuntimeError, match="boom"):
        with store.writer(1, 4) as writer:
            for i in range(4):
                writer.put(i, fixed_sample(1, i))
            raise RuntimeError("boom")
    assert writer.state == "aborted"
    assert [(g.id, g.committed) for g in store.generations()] == [(0, True)]
    assert store.latest() == 0
    with pytest.raises(GenerationNotFoundError):
        store.reader(1)
    write_generation(store, 1, 4)  # the lock was released
    check_generation(store.reader(1), 1, 4)


def test_incomplete_generation_is_not_committed(store):
    writer = store.writer(0, 4)
    for i in (0, 1, 3):
        writer.put(i, fixed_sample(0, i))
    with pytest.raises(CacheStoreError, match=r"never written \(e\.g\. \[2\]\)"):
        writer.commit()
    assert writer.state == "aborted"
    assert store.generations() == []


@pytest.mark.parametrize("shards", [1, 2], ids=["one-shard", "two-shards"])
@pytest.mark.parametrize("num_samples", [4, None], ids=["sized", "unsized"])
def test_an_index_written_twice_is_refused_at_commit(store, store_path, shards, num_samples):
    # One rule on every backend (see Backend): the second write of index 2 is a bug, not an update.
    write_generation(store, 0, 4)
    writer = store.writer(1, num_samples)
    spec = writer.shard_spec()
    writers = [spec.open(f"shard-{k}") for k in range(shards)]
    for i in range(4):
        writers[i % shards].put(i, fixed_sample(1, i))
    writers[-1].put(2, fixed_sample(1, 99))
    for shard in writers:
        shard.close()
    with pytest.raises(CacheStoreError, match=r"1 written more than once \(e\.g\. \[2\]\)"):
        writer.commit()
    assert writer.state == "aborted"
    assert [(g.id, g.committed) for g in store.generations()] == [(0, True)]
    if store.backend.persistent:
        assert leftovers(store_path) == []
    write_generation(store, 1, 4)  # the lock was released; the same samples once each commit
    check_generation(store.reader(1), 1, 4)


def test_a_dead_shard_tail_may_be_written_again(store):
    # What the loader does when a worker dies: drop what it wrote past its delivered batches,
    # and let the replacement write those indices (see loader.resources.discard_dead_shard).
    if not store.backend.supports_multiprocess_write:
        pytest.skip("workers never write into this backend: there is no dead shard to discard")
    writer = store.writer(0, 6)
    spec = writer.shard_spec()
    dead = spec.open("w0-i1")
    for i in range(4):
        dead.put(i, fixed_sample(0, 100 + i))  # indices 2 and 3 were never delivered
    dead.close()  # flushed, as a worker does after each batch; then it dies
    writer.discard_shard_tail("w0-i1", 2)
    replacement = spec.open("w0-i2")
    for i in range(2, 6):
        replacement.put(i, fixed_sample(0, i))
    replacement.close()
    writer.commit()
    reader = store.reader(0)
    assert [int(reader[i]["label"]) for i in range(6)] == [100, 101, 2, 3, 4, 5]
    assert float(reader[3]["image"][0, 0]) == 3.0


def test_one_writer_per_store(store):
    writer = store.writer(0, 2)
    with pytest.raises(StoreLockedError):
        store.writer(1, 2)
    writer.abort()
    store.writer(1, 2).abort()


def test_committed_generation_cannot_be_rewritten(store):
    write_generation(store, 0, 2)
    # GenerationCommitted: a loader that planned to write it (another process committed it since it
    # looked) reads it instead.
    with pytest.raises(GenerationCommitted, match="already committed"):
        store.writer(0, 2)
    write_generation(store, 1, 2)  # and the failed attempt released the lock


def test_generations_info(store):
    start = time.time()
    write_generation(store, 0, 5)
    write_generation(store, 1, 7)
    writer = store.writer(2, 3)
    writer.put(0, fixed_sample(2, 0))
    writer.put(1, fixed_sample(2, 1))
    end = time.time()
    infos = store.generations()
    assert [(g.id, g.committed) for g in infos] == [(0, True), (1, True), (2, False)]
    assert [g.num_samples for g in infos[:2]] == [5, 7]
    for g in infos:
        assert start - 1 <= g.created <= end + 1
        if not store.backend.persistent:
            assert g.nbytes == 0
        elif g.committed:
            assert g.nbytes > 0
    assert infos[0].created <= infos[1].created
    assert infos[1].stored_bytes > infos[0].stored_bytes > 0
    writer.abort()
    assert [g.id for g in store.generations()] == [0, 1]


def test_prune_keep_one(store):
    for g in range(3):
        write_generation(store, g, 3)
    planned = store.prune(keep=1, dry_run=True)
    assert sorted((r.kind, r.generation) for r in planned) == [("generation", 0), ("generation", 1)]
    assert [g.id for g in store.generations()] == [0, 1, 2]  # dry run removed nothing
    removed = store.prune(keep=1)
    assert sorted((r.kind, r.generation) for r in removed) == [("generation", 0), ("generation", 1)]
    assert [(r.path, r.nbytes) for r in removed] == [(r.path, r.nbytes) for r in planned]
    assert [g.id for g in store.generations()] == [2]
    check_generation(store.reader(), 2, 3)
    with pytest.raises(GenerationNotFoundError):
        store.reader(0)
    assert store.prune(keep=1) == []


def test_prune_keeps_open_readers_working(store):
    write_generation(store, 0, 4)
    reader = store.reader(0)
    reader[0]
    write_generation(store, 1, 4)
    store.prune(keep=1)
    check_generation(reader, 0, 4)  # maps and handles outlive the removal


class Unknown:
    pass


def test_unsupported_sample_type(store):
    writer = store.writer(0, 2)
    with pytest.raises(UnsupportedSampleError, match=r"test_conformance\.Unknown"):
        writer.put(0, {"x": np.zeros(2), "y": Unknown()})
    with pytest.raises(TypeError, match="frozenset"):
        writer.put(0, frozenset({1}))
    writer.put(0, {"x": np.zeros(2), "y": 1})  # the refused puts left nothing behind
    writer.put(1, {"x": np.ones(2), "y": 2})
    writer.commit()
    assert_same({"x": np.ones(2), "y": 2}, store.reader()[1])


def test_allow_pickle_round_trips(make_store, backend):
    store = make_store(backend, allow_pickle=True)
    samples = [{"obj": Opaque(i), "set": {i, i + 1}, "frac": fractions.Fraction(i, 3),
                "objects": np.array([None, i], dtype=object), "x": np.float32(i)} for i in range(3)]
    with store.writer(0, 3) as writer:
        for i, sample in enumerate(samples):
            writer.put(i, sample)
    reader = store.reader()
    for i, sample in enumerate(samples):
        got = reader[i]
        assert got["obj"] == sample["obj"] and got["set"] == sample["set"] and got["frac"] == sample["frac"]
        assert got["objects"].tolist() == [None, i]
        assert_same(sample["x"], got["x"])


def test_reads_never_write_through_to_the_store(store):
    write_generation(store, 0, 3, fixed_sample)
    write_generation(store, 1, 3, variable_sample)
    for g, make in ((0, fixed_sample), (1, variable_sample)):
        reader = store.reader(g)
        sample = reader[0]
        first = next(iter(sample.values()))
        first[...] = -1  # a writable copy
        batch = reader.get_batch([0, 1])
        for value in batch.values():
            for arr in value if isinstance(value, list) else [value]:
                if isinstance(arr, np.ndarray) and arr.flags.writeable:
                    arr[...] = -1
        view = reader.get(0, copy=False)
        for value in view.values():
            if isinstance(value, np.ndarray) and value.flags.writeable:
                value[...] = -1
        check_generation(reader, g, 3, make)


def test_memory_store_touches_no_disk(tmp_path):
    path = tmp_path / "mem"
    store = open_store(path, "memory")
    write_generation(store, 0, 3)
    store.prune(keep=0)
    store.close()
    assert not path.exists()
