"""The memory backend's buffers: fixed-shape samples go straight into the committed columns,
and a closed store lets its arrays go."""

from __future__ import annotations

import gc
import weakref

from cachestore import open_store

from .helpers import assert_same, check_generation, fixed_sample, variable_sample, write_generation


def test_fixed_samples_are_written_into_the_committed_columns(tmp_path):
    store = open_store(tmp_path / "m", "memory")
    writer = store.writer(0, 6)
    for i in range(6):
        writer.put(i, fixed_sample(0, i))
    (staging,) = store.backend._staging.values()
    columns = list(staging.columns)
    writer.commit()
    data = store.backend.open_generation(0)
    assert all(a is b for a, b in zip(data.columns, columns))  # no second copy at commit
    check_generation(store.reader(), 0, 6, fixed_sample)
    store.close()


def test_a_sample_of_another_structure_after_fixed_ones(tmp_path):
    def mixed(generation: int, index: int):
        return variable_sample(generation, index) if index == 4 else fixed_sample(generation, index)

    store = open_store(tmp_path / "m", "memory")
    write_generation(store, 0, 6, mixed)
    reader = store.reader()
    assert reader.batch_layout() is None
    for i in range(6):
        assert_same(mixed(0, i), reader[i])
    store.close()


def test_closing_the_store_returns_its_arrays(tmp_path):
    store = open_store(tmp_path / "m", "memory")
    write_generation(store, 0, 8, fixed_sample)
    column = weakref.ref(store.backend.open_generation(0).columns[0])
    store.close()
    gc.collect()
    assert column() is None
