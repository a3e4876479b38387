"""The data files a dataset names count by path, size and modification time (loader/cache/files.py)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from cachestore.format.native import native_gather
from loader.cache import files
from loader.cache.fingerprint import dataset_fingerprint
from loader.dataset import DatasetSource

REPO = Path(__file__).resolve().parents[3]

# An image folder as torchvision's ImageFolder keeps it: a list of (path, class) pairs, and a
# pathlib.Path root among its attributes. Each "image" is 16 bytes, decoded by reading the file.
_FOLDER = """
import json, os, sys
from pathlib import Path
import numpy as np
from loader import CachedLoader

class Folder:
    def __init__(self, root):
        self.root = Path(root)
        self.samples = [(str(p), int(p.parent.name)) for p in sorted(self.root.glob("*/*.bin"))]
        self.extra = {"labels": [os.path.join(root, "labels.txt")]}

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, i):
        path, label = self.samples[i]
        with open(os.path.join(os.environ["CALLS"], f"{os.getpid()}-{i}-{os.urandom(4).hex()}"), "w"):
            pass
        return np.fromfile(path, dtype=np.uint8), label

if __name__ == "__main__":
    prefix, mismatch = sys.argv[2], sys.argv[3]
    with CachedLoader(Folder(sys.argv[1]), batch_size=4, num_workers=2, shuffle=False,
                      cache_setting={"prefix": prefix, "on_mismatch": mismatch}) as loader:
        firsts = [int(x[0]) for xs, _ in loader for x in xs]
    print(json.dumps(firsts))
"""


def _make_folder(root: Path, value: int) -> list[Path]:
    paths = []
    for label in range(2):
        (root / str(label)).mkdir(parents=True, exist_ok=True)
        for k in range(4):
            path = root / str(label) / f"{k}.bin"
            path.write_bytes(bytes([value + 4 * label + k]) * 16)
            paths.append(path)
    (root / "labels.txt").write_text("0 1\n")
    return paths


def _run(tmp_path: Path, mismatch: str = "error") -> tuple[subprocess.CompletedProcess, int]:
    script = tmp_path / "train.py"
    script.write_text(_FOLDER)
    calls = tmp_path / "calls"
    calls.mkdir(exist_ok=True)
    before = len(os.listdir(calls))
    env = {**os.environ, "PYTHONPATH": str(REPO), "CALLS": str(calls)}
    done = subprocess.run([sys.executable, str(script), str(tmp_path / "data"), str(tmp_path / "cache"), mismatch],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    return done, len(os.listdir(calls)) - before


def _served(done: subprocess.CompletedProcess) -> list[int]:
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_an_image_rewritten_in_place_is_noticed_by_the_next_run(tmp_path):
    paths = _make_folder(tmp_path / "data", 0)
    first, calls = _run(tmp_path)
    assert _served(first) == list(range(8)) and calls == 8
    again, calls = _run(tmp_path)
    assert _served(again) == list(range(8)) and calls == 0, "the same files: the cache is read"
    # The same names and sizes, new content (as a regenerated data set is), a later modification time.
    paths[5].write_bytes(bytes([99]) * 16)
    stamp = os.stat(paths[5]).st_mtime_ns + 10**9
    os.utime(paths[5], ns=(stamp, stamp))
    refused, calls = _run(tmp_path)
    assert refused.returncode != 0 and calls == 0
    assert "FingerprintMismatchError" in refused.stderr and "data file" in refused.stderr
    regenerated, calls = _run(tmp_path, "regenerate")
    assert _served(regenerated) == [0, 1, 2, 3, 4, 99, 6, 7] and calls == 8


def test_a_file_named_in_a_nested_attribute_counts_too(tmp_path):
    _make_folder(tmp_path / "data", 0)
    assert _served(_run(tmp_path)[0]) == list(range(8))
    (tmp_path / "data" / "labels.txt").write_text("1 0\n")  # another size: a dict's list's path
    refused, calls = _run(tmp_path)
    assert refused.returncode != 0 and "FingerprintMismatchError" in refused.stderr and calls == 0


class _Named:
    def __init__(self, names: object) -> None:
        self.names = names

    def __len__(self) -> int:
        return 1

    def __getitem__(self, i: int) -> int:
        return i


def _files_part(names: object) -> tuple[object, object]:
    fp = dataset_fingerprint(DatasetSource.of(_Named(names), None), 1, (0, 1))
    return fp.get("files"), fp.get("files_sha256")


def test_only_regular_files_count_and_urls_are_unwrapped(tmp_path, monkeypatch):
    data = tmp_path / "a.bin"
    data.write_bytes(b"x")
    (tmp_path / "folder").mkdir()
    monkeypatch.chdir(tmp_path)
    assert _files_part(["label", str(tmp_path / "folder"), "http://host/a.bin", "pipe:cat a.bin"]) == (None, None)
    count, digest = _files_part([str(data), "a.bin", f"file://{data}", Path(data)])
    assert count == 2  # the absolute path (three ways) and the relative one
    assert _files_part([Path(data)])[0] == 1

    class Located:  # an os.PathLike of the user's own
        def __init__(self, where: str) -> None:
            self.backwards = where[::-1]  # names no file itself

        def __fspath__(self) -> str:
            return self.backwards[::-1]

    assert _files_part({"file": Located(str(data))})[0] == 1
    os.utime(data, ns=(1, 1))
    assert _files_part([str(data), "a.bin", f"file://{data}"]) == (2, _files_part([str(data), "a.bin"])[1])
    assert _files_part([str(data), "a.bin"])[1] != digest


def test_past_the_bound_one_line_says_the_rest_count_by_name(tmp_path, monkeypatch, caplog):
    names = []
    for k in range(5):
        path = tmp_path / f"{k}.bin"
        path.write_bytes(b"x" * k)
        names.append(str(path))
    monkeypatch.setattr(files, "MAX_FILES", 3)
    with caplog.at_level(logging.INFO, logger="loader.cache.files"):
        count, digest = files.files_identity(names)
    assert count == 3
    assert [r.getMessage() for r in caplog.records if "by name only" in r.getMessage()] != []
    (tmp_path / "4.bin").write_bytes(b"y" * 9)  # past the bound: not noticed, as the line says
    assert files.files_identity(names) == (3, digest)
    (tmp_path / "0.bin").write_bytes(b"y" * 9)
    assert files.files_identity(names) != (3, digest)


def test_the_bulk_hash_of_a_sample_list_is_the_per_item_hash():
    # _items writes plain scalars in one update: the bytes must be those feed() writes item by item.
    from loader.cache.fingerprint import _ValueHasher

    class PerItem(_ValueHasher):
        def sub(self):
            return PerItem(self.walk)

        def _items(self, items, where, depth):
            for i, item in enumerate(items):
                self.feed(item, f"{where}[{i}]", depth + 1)

        def digest_of(self, obj, where, depth):  # every part through a hasher of its own, as before
            return self._digest(obj, where, depth)

    samples = [("a/b.jpg", 1), ("q.jpg", -12), ("r" * 5000, 10**20), (True, 1), ("c.jpg", None), "x", 3, True, (1, (2, "y")), [1.5, "z"], np.int64(4), {"k": ["w"]},
               {"path": "d.jpg", "label": 2, "box": [0.5, 1]}]
    bulk, per_item = _ValueHasher(), PerItem()
    bulk.feed(samples, "s")
    per_item.feed(samples, "s")
    assert bulk.h.hexdigest() == per_item.h.hexdigest()
    assert sorted(bulk.walk.paths) == sorted(per_item.walk.paths) == ["a/b.jpg", "box", "c.jpg", "d.jpg", "k", "label", "path", "q.jpg", "r" * 5000, "w", "x", "y", "z"]


def test_the_compiled_stat_gives_the_digest_of_the_python_loop(tmp_path, monkeypatch):
    if native_gather() is None:
        pytest.skip("the compiled module is not built (no C compiler at install)")
    names = []
    for d in range(3):
        (tmp_path / str(d)).mkdir()
    for k in range(5000):  # past a thousand per thread: the compiled stat splits them between threads
        path = tmp_path / str(k % 3) / (f"{k}.bin" if k % 5 else f"{k}-é.bin")
        path.write_bytes(b"x" * (k % 7))
        names.append(str(path))
    names += [str(tmp_path), str(tmp_path / "gone"), "a\0b", "\udcff", "\ud800", str(tmp_path / "0" / "\udcff")]
    (tmp_path / "0").joinpath("\udcff").write_bytes(b"odd")  # a name that is not UTF-8 (surrogate-escaped)
    compiled = files.files_identity(names)
    monkeypatch.setattr(files, "native_gather", lambda: None)
    assert files.files_identity(reversed(names)) == compiled and compiled is not None and compiled[0] == 5001
