"""A damaged generation is found, reported, removable and replaceable - never silently invisible.

Each case damages generation 0 of a store that also holds a sound generation 1
the way a user or a crash would (a manifest deleted or edited, a data, index or
schema file truncated or overwritten, a generation directory swapped for a symlink),
then checks what the catalog, a reader, ``verify``, the CLI, ``prune`` and a new
writer of generation 0 make of it.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from cachestore import CorruptSampleError, open_store
from cachestore.cli import main

from .helpers import check_generation, fixed_sample, variable_sample, write_generation

N = 16


def _truncate(path: Path) -> None:
    os.truncate(path, path.stat().st_size // 2)


def _same_size_garbage(path: Path) -> None:
    path.write_bytes(b"\x07" * path.stat().st_size)


def _edit_count(gen_dir: Path) -> None:
    manifest = json.loads((gen_dir / "manifest.json").read_text())
    manifest["num_samples"] += 3
    (gen_dir / "manifest.json").write_text(json.dumps(manifest))


def _manifest_symlink(gen_dir: Path) -> None:
    copy = gen_dir.parent.parent / "manifest-copy.json"
    (gen_dir / "manifest.json").rename(copy)
    (gen_dir / "manifest.json").symlink_to(copy)  # a valid manifest: following it would "work"


def _gen_dir_symlink(gen_dir: Path) -> None:
    elsewhere = gen_dir.parent.parent / "elsewhere"
    gen_dir.rename(elsewhere)
    gen_dir.symlink_to(elsewhere, target_is_directory=True)  # a whole, sound generation behind it


def _one(gen_dir: Path, pattern: str) -> Path:
    (path,) = gen_dir.glob(pattern)
    return path


# name -> (backends, sample maker, damage(gen_dir) -> the file the report must name)
CASES = {
    "manifest-deleted": (("memmap", "lmdb"), fixed_sample,
                         lambda d: (d / "manifest.json").unlink() or "manifest.json"),
    "manifest-garbage": (("memmap", "lmdb"), fixed_sample,
                         lambda d: (d / "manifest.json").write_bytes(b"\x00garbage{") and "manifest.json"),
    "manifest-symlink": (("memmap", "lmdb"), fixed_sample, lambda d: _manifest_symlink(d) or "manifest.json"),
    "manifest-count-memmap": (("memmap",), fixed_sample, lambda d: _edit_count(d) or "index.npy"),
    "manifest-count-lmdb": (("lmdb",), fixed_sample, lambda d: _edit_count(d) or "manifest.json"),
    "generation-dir-symlink": (("memmap", "lmdb"), fixed_sample, lambda d: _gen_dir_symlink(d) or "gen-000000"),
    "columns-truncated": (("memmap",), fixed_sample, lambda d: _truncate(d / "col-0.bin") or "col-0.bin"),
    "records-truncated": (("memmap",), variable_sample,
                          lambda d: _truncate(path := _one(d, "*.seg")) or path.name),
    "index-garbage": (("memmap",), fixed_sample,
                      lambda d: (d / "index.npy").write_bytes(b"garbage") and "index.npy"),
    "schema-garbage": (("memmap",), fixed_sample, lambda d: _same_size_garbage(d / "schema.json") or "schema.json"),
    "shards-deleted": (("memmap",), fixed_sample, lambda d: (d / "shards.json").unlink() or "shards.json"),
    "lmdb-truncated": (("lmdb",), fixed_sample, lambda d: _truncate(d / "data.mdb") or "data.mdb"),
}
PARAMS = [(name, backend) for name, (backends, _, _) in CASES.items() for backend in backends]


@pytest.fixture(params=PARAMS, ids=[f"{n}-{b}" for n, b in PARAMS])
def damaged(request, store_path):
    """``(store, backend, make, file named)``: generation 0 damaged, generation 1 sound."""
    name, backend = request.param
    _, make, damage = CASES[name]
    store = open_store(store_path, backend)
    write_generation(store, 0, N, make)
    write_generation(store, 1, N, make)
    named = damage(Path(store_path) / "gen-000000")
    yield store, backend, make, named
    store.close()


def test_catalog_lists_it_as_damaged_naming_the_file(damaged):
    store, _, _, named = damaged
    gen0, gen1 = store.generations()
    assert (gen0.id, gen0.committed) == (0, False) and named in gen0.damaged
    assert (gen1.id, gen1.committed, gen1.damaged) == (1, True, None)
    assert store.latest() == 1
    check_generation(store.reader(), 1, N, damaged[2])


def test_opening_it_raises_corrupt_sample_error_naming_the_file(damaged):
    store, _, _, named = damaged
    with pytest.raises(CorruptSampleError, match="generation 0 .* is damaged") as info:
        store.reader(0)
    assert named in str(info.value)
    assert (info.value.generation, info.value.index) == (0, None)
    (bad,) = store.verify()
    assert (bad.generation, bad.index) == (0, None) and named in str(bad)


def test_inspect_verify_exits_1_naming_generation_and_file(damaged, store_path, capsys):
    named = damaged[3]
    assert main(["inspect", store_path]) == 0
    out = capsys.readouterr().out
    assert "damaged" in out and named in out
    assert main(["inspect", store_path, "--verify"]) == 1
    out, err = capsys.readouterr()
    assert "generation 0, whole generation" in out and named in out
    assert "1 damaged generation" in err


@pytest.mark.parametrize("keep", [0, 5])
def test_prune_removes_it_whatever_keep_says(damaged, store_path, capsys, keep):
    store = damaged[0]
    outside = {p: p.read_bytes() for p in Path(store_path).parent.rglob("*")
               if p.is_file() and not p.is_symlink() and store_path not in str(p)}
    assert main(["prune", store_path, "--keep", str(keep), "--dry-run"]) == 0
    assert "would remove  damaged" in capsys.readouterr().out
    assert os.path.lexists(Path(store_path) / "gen-000000")
    assert main(["prune", store_path, "--keep", str(keep)]) == 0
    assert "removed  damaged" in capsys.readouterr().out
    assert not os.path.lexists(Path(store_path) / "gen-000000")
    assert [g.id for g in store.generations()] == ([1] if keep else [])
    # a symlinked generation or manifest went as a link: what it pointed at is intact
    assert {p: p.read_bytes() for p in outside} == outside


def test_a_writer_of_that_generation_replaces_it(damaged):
    store, _, make, _ = damaged
    write_generation(store, 0, N, make)
    assert [(g.id, g.committed, g.damaged) for g in store.generations()] == [(0, True, None), (1, True, None)]
    check_generation(store.reader(0), 0, N, make)
    assert store.verify() == []


def test_damage_only_opening_finds_is_replaced_by_a_writer(store_path):
    # An LMDB file of the right size full of garbage: listing cannot see it, opening does.
    # (Garbage in a memmap data file is per-sample corruption: checksums name each sample.)
    store = open_store(store_path, "lmdb")
    write_generation(store, 0, N)
    _same_size_garbage(Path(store_path) / "gen-000000" / "data.mdb")
    assert store.generations()[0].committed
    (bad,) = store.verify()
    assert (bad.generation, bad.index) == (0, None) and "data.mdb" in str(bad)
    write_generation(store, 0, N)
    check_generation(store.reader(0), 0, N)
    store.close()


def test_a_foreign_entry_with_a_generation_name_is_damage_not_a_crash(store_path):
    store = open_store(store_path, "memmap")
    write_generation(store, 1, 4)
    (Path(store_path) / "gen-000000").write_text("not a directory")
    (info, _) = store.generations()
    assert "is a file" in info.damaged
    write_generation(store, 0, 4)
    check_generation(store.reader(0), 0, 4)
    store.close()


def test_a_generation_removed_while_listing_is_skipped_not_damaged(store_path):
    # Listing races with prune's rename: a generation that vanished is skipped, not reported damaged.
    store = open_store(store_path, "memmap")
    write_generation(store, 0, 4)
    gen_dir = Path(store_path) / "gen-000000"
    shutil.rmtree(gen_dir)
    assert store.backend._generation_info(gen_dir) is None
    store.close()
