"""What you put in is what you get back: every epoch serves the batches torch's DataLoader serves.

Hypothesis generates sample structures (nested dicts, lists and tuples of numpy arrays of any
numeric dtype and byte order, fixed or varying in shape from sample to sample, numpy scalars,
Python scalars, str, bytes, None: ``tests/loader/parity_datasets.py``) and the loader's
parameters; each example builds one loader and checks each of its epochs against
``torch.utils.data.DataLoader(dataset, batch_size, shuffle=False, collate_fn=C)`` with the same
collate function C:

- type for type (numpy vs tensor, list vs tuple, dict keys in order), dtype with its byte order,
  shape, and values bit for bit (NaN payloads and -0.0 included);
- every served array writable and the caller's own: after its epoch, each batch is compared
  again (no later batch reused its memory), then everything received is written to (arrays,
  and dicts and lists too), and the next epoch must still equal torch's;
- rotation epochs serve each sample R times in a random order, so each batch is split back
  into its samples, each batch compared with torch's collate of those samples, and each epoch
  checked to be R copies of the dataset.

The collates: the default (our loader left at its default, or given ``loader.default_collate``
by name, a drawn choice; torch's gets ``loader.default_collate``, as ours returns numpy arrays),
one that returns the list of samples, and a batch-level one (``{"n": len, "samples": ...}``).

``make test`` runs the explicit examples and a bounded number of generated ones per test case,
derandomized and without shrinking (about a minute on 2 cores). ``make parity`` is the long
run: ``PARITY_EXAMPLES`` generated examples per test case (default 200), seeded by
``PARITY_SEED``, each failure shrunk to a small example; ``PARITY_EXAMPLES=20 make parity``
for a short one.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import shutil
import struct
import tempfile
import traceback
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, seed, settings
from hypothesis import strategies as st

from loader import CachedLoader, default_collate

from ..marks import covering, long
from .conftest import leftovers, live_children, my_segments
from .parity_datasets import NAMEDTUPLES, ParityDataset, collate_batch_level, collate_list

# ----------------------------------------------------------------------------- run size
#: Examples per test case: a bounded run in `make test`, PARITY_EXAMPLES in `make parity`.
LONG_RUN = int(os.environ.get("PARITY_EXAMPLES", "0"))
SEED = os.environ.get("PARITY_SEED")
#: Seconds a loader may wait for one batch: a hang fails the example instead of the whole run.
BATCH_TIMEOUT = 30.0

BACKENDS = ["memmap", "lmdb", "memory"]
COLLATES: dict[str, Callable[[Sequence[Any]], Any]] = {
    "default": default_collate, "list": collate_list, "batch_level": collate_batch_level}


def parity(bounded: int, seconds_per_example: float) -> Callable[[Any], Any]:
    """Hypothesis settings and a pytest timeout: `bounded` examples, or PARITY_EXAMPLES."""
    examples = LONG_RUN or bounded
    # The bounded run starts with the explicit examples (small, readable regressions) and must
    # stay short even while a bug makes every example fail, so it does not shrink. The long run
    # explores: generated examples only (an explicit example that fails would stop it before
    # any), and what fails is shrunk.
    phases = [Phase.generate, Phase.shrink] if LONG_RUN else [Phase.explicit, Phase.generate]
    chosen = settings(max_examples=examples, deadline=None, database=None, derandomize=SEED is None,
                      phases=phases, print_blob=False, suppress_health_check=list(HealthCheck))
    limit = 60 + seconds_per_example * (examples + 3) + (900 if LONG_RUN else 0)

    def decorate(test: Any) -> Any:
        test = chosen(test)
        if SEED is not None:
            test = seed(int(SEED))(test)
        return pytest.mark.timeout(limit)(test)

    return decorate


# ----------------------------------------------------------------------------- generated structures
_CODES = ["i1", "i2", "i4", "i8", "u1", "u2", "u4", "u8", "f2", "f4", "f8", "c8", "c16", "b1"]
dtypes = st.builds(lambda code, order: np.dtype(order + code).str, st.sampled_from(_CODES), st.sampled_from("=><"))


@st.composite
def arrays(draw: st.DrawFn) -> dict[str, Any]:
    shape = draw(st.lists(st.sampled_from([1, 2, 3, 0]), max_size=3))
    varying = draw(st.booleans())
    vary = [draw(st.integers(0, 2)) if varying else 0 for _ in shape]
    return {"k": "array", "dtype": draw(dtypes), "shape": shape, "vary": vary,
            "layout": draw(st.sampled_from(["C", "F", "rev"]))}


_sized = st.builds(lambda kind, length, vary: {"k": kind, "len": length, "vary": vary},
                   st.sampled_from(["str", "bytes"]), st.integers(0, 4), st.integers(0, 2))
leaves = st.one_of(
    arrays(),
    st.builds(lambda dtype: {"k": "npscalar", "dtype": dtype}, dtypes),
    st.sampled_from([{"k": "int"}, {"k": "float"}, {"k": "bool"}, {"k": "none"}]),
    _sized,
)
_keys = st.sampled_from(["x", "y", "label", "", "é", "a b"])


def _containers(children: st.SearchStrategy[dict[str, Any]]) -> st.SearchStrategy[dict[str, Any]]:
    items = st.lists(children, max_size=3)
    return st.one_of(
        st.builds(lambda kind, xs: {"k": kind, "items": xs}, st.sampled_from(["list", "tuple", "namedtuple"]), items),
        st.lists(st.tuples(_keys, children), max_size=3, unique_by=lambda kv: kv[0]).map(
            lambda kvs: {"k": "dict", "items": [list(kv) for kv in kvs]}),
    )


structures = st.recursive(leaves, _containers, max_leaves=6)


@dataclass(frozen=True)
class Case:
    """One generated example: the dataset's spec and the loader's batch parameters."""

    spec: dict[str, Any]
    n: int
    batch_size: int
    drop_last: bool
    max_minibatch_length: int | None
    #: With the default collate: the loader is given ``collate_fn=loader.default_collate`` by name
    #: (else it is left to its default, which may take another path: batches read whole).
    default_by_name: bool = False

    def describe(self) -> str:
        return json.dumps(asdict(self))


cases = st.builds(Case, spec=st.builds(lambda root, s: {"seed": s, "root": root}, structures,
                                       st.integers(0, 2**32 - 1)),
                  n=st.integers(1, 13), batch_size=st.integers(1, 5), drop_last=st.booleans(),
                  max_minibatch_length=st.sampled_from([None, 2, 1, 3]), default_by_name=st.booleans())


def _array(dtype: str, shape: list[int], vary: list[int] | None = None) -> dict[str, Any]:
    return {"k": "array", "dtype": dtype, "shape": shape, "vary": vary or [0] * len(shape), "layout": "C"}


#: Small explicit examples, run first in every test case: the sample structures that broke before.
EXAMPLES = [
    # A list sample [x, y]: batches split between workers must keep each sample whole.
    Case({"seed": 1, "root": {"k": "list", "items": [_array("<f4", [2]), {"k": "int"}]}}, 7, 5, False, 2),
    # An array whose shape varies by index: the default collate keeps a list of arrays.
    Case({"seed": 2, "root": {"k": "dict", "items": [["x", _array("<i2", [1, 2], [2, 0])]]}}, 5, 2, False, None),
    # A big-endian leaf: every epoch serves the dtype torch serves (np.stack in the default
    # collate makes it native; the list collates keep it >f4).
    Case({"seed": 3, "root": {"k": "dict", "items": [["x", _array(">f4", [3])], ["y", {"k": "int"}]]}},
         6, 4, False, None),
    # A namedtuple sample: read back from the store as its class, collated into one of batches.
    Case({"seed": 4, "root": {"k": "namedtuple", "items": [_array("<f4", [2]), {"k": "str", "len": 1, "vary": 1}]}},
         5, 2, False, None),
]


def with_examples(test: Any) -> Any:
    for case in reversed(EXAMPLES):
        test = example(case=case)(test)
    return test


#: The tests with workers that draw their collate (fewer loaders to start) take each explicit
#: example with one collate.
collates = st.sampled_from(list(COLLATES))
EXAMPLE_COLLATES = ["batch_level", "default", "default"]


def with_collate_examples(test: Any) -> Any:
    for case, collate in reversed(list(zip(EXAMPLES, EXAMPLE_COLLATES))):
        test = example(case=case, collate=collate)(test)
    return test


# ----------------------------------------------------------------------------- comparing
class Mismatch(AssertionError):
    """A served batch differs from torch's (the message says where and how)."""


def assert_same(ours: Any, theirs: Any, path: str = "batch") -> None:
    """`ours` equals `theirs`: types, dict keys in order, dtypes with byte order, shapes, bits."""
    if isinstance(ours, np.ndarray) and isinstance(theirs, np.ndarray):
        _same_array(ours, theirs, path)  # an ndarray subclass is reported once its contents were compared
    if type(ours) is not type(theirs):
        raise Mismatch(f"{path}: {_type(ours)} where torch serves {_type(theirs)} ({_short(ours)} vs {_short(theirs)})")
    if isinstance(theirs, dict):
        if list(ours) != list(theirs):
            raise Mismatch(f"{path}: keys {list(ours)} where torch serves {list(theirs)}")
        for key in theirs:
            assert_same(ours[key], theirs[key], f"{path}[{key!r}]")
    elif isinstance(theirs, (list, tuple)):
        if len(ours) != len(theirs):
            raise Mismatch(f"{path}: {len(ours)} items where torch serves {len(theirs)} "
                           f"({_short(ours)} vs {_short(theirs)})")
        for i, (a, b) in enumerate(zip(ours, theirs)):
            assert_same(a, b, f"{path}[{i}]")
    elif isinstance(theirs, (np.ndarray, np.generic)):
        _same_array(ours, theirs, path)
    elif isinstance(theirs, torch.Tensor):
        if ours.dtype != theirs.dtype or ours.shape != theirs.shape:
            raise Mismatch(f"{path}: tensor {ours.dtype} {tuple(ours.shape)} where torch serves "
                           f"{theirs.dtype} {tuple(theirs.shape)}")
        if _bits(ours.numpy()) != _bits(theirs.numpy()):
            raise Mismatch(f"{path}: values {ours} where torch serves {theirs}")
    elif isinstance(theirs, float):
        if struct.pack("<d", ours) != struct.pack("<d", theirs):
            raise Mismatch(f"{path}: {ours!r} where torch serves {theirs!r}")
    elif ours != theirs:
        raise Mismatch(f"{path}: {ours!r} where torch serves {theirs!r}")


def _same_array(ours: np.ndarray | np.generic, theirs: np.ndarray | np.generic, path: str) -> None:
    if ours.dtype.str != theirs.dtype.str:
        raise Mismatch(f"{path}: dtype {ours.dtype.str} where torch serves dtype {theirs.dtype.str} "
                       f"(shape {ours.shape}, torch's {theirs.shape})")
    if ours.shape != theirs.shape:
        raise Mismatch(f"{path}: shape {ours.shape} where torch serves shape {theirs.shape}")
    if _bits(ours) != _bits(theirs):
        raise Mismatch(f"{path}: values {_short(ours)} where torch serves {_short(theirs)}")


def _bits(arr: np.ndarray | np.generic) -> bytes:
    return np.ascontiguousarray(arr).tobytes()


def _type(x: Any) -> str:
    t = type(x)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__name__}"


def _short(x: Any, limit: int = 160) -> str:
    text = repr(x).replace("\n", " ")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def arrays_in(x: Any) -> list[tuple[str, np.ndarray]]:
    """Every numpy array in `x`, with its path."""
    out: list[tuple[str, np.ndarray]] = []

    def walk(v: Any, path: str) -> None:
        if isinstance(v, np.ndarray):
            out.append((path, v))
        elif isinstance(v, dict):
            for k, c in v.items():
                walk(c, f"{path}[{k!r}]")
        elif isinstance(v, (list, tuple)):
            for i, c in enumerate(v):
                walk(c, f"{path}[{i}]")

    walk(x, "batch")
    return out


def assert_owned(batch: Any, where: str) -> None:
    """Every array of `batch` is writable: the caller may write into what it was served."""
    for path, arr in arrays_in(batch):
        if not arr.flags.writeable:
            raise Mismatch(f"{where}: {path} ({arr.dtype.str} {arr.shape}) is read-only; torch serves a writable array")


def scribble(batch: Any) -> None:
    """Write into everything `batch` holds: every array element changes, dicts and lists grow."""
    for _, arr in arrays_in(batch):
        if arr.size:
            with np.errstate(invalid="ignore"):  # a NaN is not 0, as meant (numpy warns for complex NaNs)
                arr[...] = np.where(arr == 0, 1, 0).astype(arr.dtype)

    def grow(v: Any) -> None:
        if isinstance(v, dict):
            for c in list(v.values()):
                grow(c)
            v["__scribbled__"] = True
        elif isinstance(v, (list, tuple)):
            for c in list(v):
                grow(c)
            if isinstance(v, list):
                v.append("__scribbled__")

    grow(batch)


# ----------------------------------------------------------------------------- running
def torch_batches(case: Case, collate: str, batch_sampler: list[list[int]] | None = None) -> list[Any]:
    """What torch's DataLoader serves: in order, or the batches of `batch_sampler`."""
    dataset: Any = ParityDataset(spec=case.spec, n=case.n)  # a map-style dataset, as torch takes any
    loader: torch.utils.data.DataLoader[Any]
    if batch_sampler is not None:
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=batch_sampler, collate_fn=COLLATES[collate])
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=case.batch_size, shuffle=False,
                                             collate_fn=COLLATES[collate], drop_last=case.drop_last)
    return list(loader)


def make_loader(case: Case, collate: str, nb_worker: int, **settings_: Any) -> CachedLoader:
    collate_fn = None if collate == "default" and not case.default_by_name else COLLATES[collate]
    return CachedLoader(ParityDataset, {"spec": case.spec, "n": case.n}, batch_size=case.batch_size,
                        nb_worker=nb_worker, shuffle=False, seed=0, drop_last=case.drop_last,
                        collate_fn=collate_fn, max_minibatch_length=case.max_minibatch_length,
                        timeout=BATCH_TIMEOUT, **settings_)


def serve_epoch(loader: CachedLoader, epoch: int, context: str) -> tuple[list[Any], str]:
    """The batches of `loader`'s next epoch and its mode; an exception says which epoch raised."""
    try:
        batches = list(loader)
    except Exception as exc:
        exc.add_note(f"raised while serving epoch {epoch} ({context})")
        raise
    return batches, str(loader.epoch_stats[-1].mode)


def check_epochs_in_order(case: Case, collate: str, loader: CachedLoader, epochs: int,
                          modes: list[str] | None, context: str) -> None:
    """`epochs` epochs of `loader`, each equal to torch's batches, writable, and scribbled on after."""
    expected = torch_batches(case, collate)
    served_modes = []
    for epoch in range(epochs):
        batches, mode = serve_epoch(loader, epoch, context)
        served_modes.append(mode)
        where = f"epoch {epoch} ({mode}), {context}"
        if len(batches) != len(expected):
            raise Mismatch(f"{where}: {len(batches)} batches where torch serves {len(expected)}")
        for j, (ours, theirs) in enumerate(zip(batches, expected)):
            _compare(ours, theirs, f"{where}, batch {j}")
        # Again, now that the whole epoch was served: no later batch may have reused an earlier one's memory.
        for j, (ours, theirs) in enumerate(zip(batches, expected)):
            _compare(ours, theirs, f"{where}, batch {j} once the epoch was over")
        for ours in batches:
            scribble(ours)
    if modes is not None and served_modes != modes:
        raise Mismatch(f"{context}: the epochs were {served_modes}, the suite means to check {modes}")


def _compare(ours: Any, theirs: Any, where: str) -> None:
    assert_owned(ours, where)
    try:
        assert_same(ours, theirs)
    except Mismatch as exc:
        # Where it happened goes into the message; the exception keeps the line that found the
        # difference, so Hypothesis reports each kind of difference as a distinct failure.
        exc.args = (f"{where}: {exc.args[0]}",)
        raise


@contextlib.contextmanager
def example_dir(root: Path) -> Iterator[str]:
    """A directory of its own for one example; once its loader is closed, nothing may be left:
    no process, no shared memory, no staging area, temp file, lock or rotation window.

    A failure's traceback would keep the served batches alive through the frames that held
    them (and the loader's shared memory with them): the frames' variables are cleared before
    the failure goes on, and what is left is only checked after an example that passed.
    """
    path = tempfile.mkdtemp(dir=root)
    try:
        yield path
    except BaseException as exc:
        seen: set[int] = set()
        chained: BaseException | None = exc
        while chained is not None and id(chained) not in seen:
            seen.add(id(chained))
            traceback.clear_frames(chained.__traceback__)
            chained = chained.__cause__ or chained.__context__
        raise
    else:
        gc.collect()
        children = live_children()
        for child in children:
            child.kill()
        left = [f"process {c.pid}" for c in children] + my_segments() + leftovers(path)
        left += [name for name in os.listdir(path) if name.startswith("rotation-")]
        if left:
            raise Mismatch(f"left behind once the loader was closed: {left}")
    finally:
        shutil.rmtree(path, ignore_errors=True)


# ----------------------------------------------------------------------------- cache epochs
def check_cache_epochs(root: Path, backend: str, nb_worker: int, collate: str, case: Case) -> None:
    """Generate (0), read (1), refresh: a new generation written in its own epoch (2), read (3)."""
    context = f"backend={backend} nb_worker={nb_worker} collate={collate} case={case.describe()}"
    with example_dir(root) as prefix, make_loader(
            case, collate, nb_worker, cache_setting={"prefix": prefix, "update_frequency": 2, "backend": backend,
                                                     "background_refresh": False}) as loader:
        check_epochs_in_order(case, collate, loader, 4, ["generate", "read", "generate", "read"], context)


@covering("backend,collate", BACKENDS, list(COLLATES))
@parity(bounded=2, seconds_per_example=1)
@with_examples
@given(case=cases)
def test_cache_epochs_without_workers_serve_what_torch_serves(tmp_path, backend, collate, case):
    check_cache_epochs(tmp_path, backend, 0, collate, case)


@covering("backend,collate", BACKENDS, list(COLLATES))
@parity(bounded=1, seconds_per_example=4)
@with_examples
@given(case=cases)
def test_cache_epochs_with_workers_serve_what_torch_serves(tmp_path, backend, collate, case):
    check_cache_epochs(tmp_path, backend, 2, collate, case)


@pytest.mark.parametrize("backend", [BACKENDS[0], *(pytest.param(b, marks=long) for b in BACKENDS[1:])])
@parity(bounded=1, seconds_per_example=4)
@with_collate_examples
@given(case=cases, collate=collates)
def test_background_refresh_epochs_serve_what_torch_serves(tmp_path, backend, case, collate):
    """With workers and background_refresh left at "auto": the refresh epoch reads a generation
    the workers wrote during the epochs before it."""
    context = f"backend={backend} nb_worker=2 background_refresh=auto collate={collate} case={case.describe()}"
    with example_dir(tmp_path) as prefix, make_loader(
            case, collate, 2, cache_setting={"prefix": prefix, "update_frequency": 2, "backend": backend}) as loader:
        check_epochs_in_order(case, collate, loader, 4, None, context)


# ----------------------------------------------------------------------------- rotation
def split_batch(batch: Any, collate: str, node: dict[str, Any], size: int) -> list[Any]:
    """The `size` samples a batch of `collate` was made of (for the default collate, the rows of
    each stacked leaf, guided by the spec's structure)."""
    if collate == "list":
        rows = batch
    elif collate == "batch_level":
        rows = batch["samples"]
    else:
        rows = _rows(batch, node, size)
    if len(rows) != size:
        raise Mismatch(f"{len(rows)} samples where the batch has {size}")
    return list(rows)


def _rows(batch: Any, node: dict[str, Any], size: int) -> list[Any]:
    kind = node["k"]
    if kind == "dict":
        columns = [_rows(batch[key], child, size) for key, child in node["items"]]
        return [{key: col[i] for (key, _), col in zip(node["items"], columns)} for i in range(size)]
    if kind in ("list", "tuple", "namedtuple"):
        columns = [_rows(batch[j], child, size) for j, child in enumerate(node["items"])]
        if kind == "namedtuple":
            return [NAMEDTUPLES[len(columns)](*(col[i] for col in columns)) for i in range(size)]
        make = list if kind == "list" else tuple
        return [make(col[i] for col in columns) for i in range(size)]
    if isinstance(batch, list):
        return batch
    if isinstance(batch, np.ndarray) and batch.ndim:
        return [batch[i : i + 1].reshape(batch.shape[1:]) for i in range(len(batch))]
    raise Mismatch(f"a {_type(batch)} where the batch should hold one row per sample: {_short(batch)}")


def match_key(x: Any) -> Any:
    """A hashable key of a sample, lenient on the kind of leaf and byte order: used only to tell
    which dataset sample a served one is (the strict comparison with torch's batch follows)."""
    if isinstance(x, dict):
        return ("d", tuple((k, match_key(v)) for k, v in x.items()))
    if isinstance(x, (list, tuple)):
        return ("s", tuple(match_key(v) for v in x))
    if isinstance(x, (np.ndarray, np.generic, bool, int, float)):
        arr = np.asarray(x)
        arr = arr.astype(arr.dtype.newbyteorder("="))
        return ("v", arr.dtype.str, arr.shape, arr.tobytes())
    if isinstance(x, torch.Tensor):
        return match_key(x.numpy())
    return ("o", type(x).__name__, x)


def rotation_sizes(n: int, rotation: int, batch_size: int, drop_last: bool) -> list[int]:
    total = rotation * n
    return [batch_size] * (total // batch_size) + ([total % batch_size] if total % batch_size and not drop_last else [])


rotation_cases = st.tuples(cases, st.sampled_from([2, 3]), st.integers(1, 15))
ROTATION_EXAMPLES = [
    (EXAMPLES[0], 2, 4), (EXAMPLES[1], 2, 3), (EXAMPLES[2], 3, 2),
    # Fewer serves than one batch, with drop_last: an epoch of no batch, as torch's.
    (Case({"seed": 4, "root": _array("|i1", [])}, 1, 5, True, None), 2, 1),
]
ROTATION_EXAMPLE_COLLATES = EXAMPLE_COLLATES + ["list"]


def with_rotation_examples(test: Any) -> Any:
    for rotation_case in reversed(ROTATION_EXAMPLES):
        test = example(rotation_case=rotation_case)(test)
    return test


def with_rotation_collate_examples(test: Any) -> Any:
    for rotation_case, collate in reversed(list(zip(ROTATION_EXAMPLES, ROTATION_EXAMPLE_COLLATES))):
        test = example(rotation_case=rotation_case, collate=collate)(test)
    return test


def check_rotation_epochs(root: Path, medium: str, nb_worker: int, collate: str,
                          rotation_case: tuple[Case, int, int]) -> None:
    """Two rotation epochs: each batch equals torch's collate of the samples it holds, and each
    epoch serves every sample R times (fewer where drop_last drops the end)."""
    case, rotation, size = rotation_case
    context = (f"rotation medium={medium} R={rotation} size={size} nb_worker={nb_worker} collate={collate} "
               f"case={case.describe()}")
    dataset = ParityDataset(spec=case.spec, n=case.n)
    # Which indices each served sample may be, from the rows torch's own collate gives back.
    by_key: dict[Any, list[int]] = {}
    for i in range(case.n):
        row = split_batch(COLLATES[collate]([dataset[i]]), collate, case.spec["root"], 1)[0]
        by_key.setdefault(match_key(row), []).append(i)
    with example_dir(root) as prefix, make_loader(case, collate, nb_worker, rotation_setting={
            "medium": medium, "rotation": rotation, "size": size, "prefix": prefix}) as loader:
        for epoch in range(2):
            check_rotation_epoch(loader, epoch, case, collate, rotation, by_key, context)


@covering("medium,collate", ["memory", "disk"], list(COLLATES))
@parity(bounded=2, seconds_per_example=1)
@with_rotation_examples
@given(rotation_case=rotation_cases)
def test_rotation_epochs_without_workers_serve_each_sample_r_times(tmp_path, medium, collate, rotation_case):
    check_rotation_epochs(tmp_path, medium, 0, collate, rotation_case)


@pytest.mark.parametrize("medium", ["memory", "disk"])
@parity(bounded=1, seconds_per_example=4)
@with_rotation_collate_examples
@given(rotation_case=rotation_cases, collate=collates)
def test_rotation_epochs_with_workers_serve_each_sample_r_times(tmp_path, medium, rotation_case, collate):
    check_rotation_epochs(tmp_path, medium, 2, collate, rotation_case)


def check_rotation_epoch(loader: CachedLoader, epoch: int, case: Case, collate: str, rotation: int,
                         by_key: dict[Any, list[int]], context: str) -> None:
    """Each batch is torch's collate of the samples it holds; the epoch serves each sample R times;
    then everything served is scribbled on."""
    batches, mode = serve_epoch(loader, epoch, context)
    where = f"epoch {epoch} ({mode}), {context}"
    if mode != "rotate":
        raise Mismatch(f"{where}: the suite means to check a rotation epoch")
    sizes = rotation_sizes(case.n, rotation, case.batch_size, case.drop_last)
    lengths = [_batch_len(b, collate, s) for b, s in zip(batches, sizes)]
    if len(batches) != len(sizes) or lengths != sizes:
        raise Mismatch(f"{where}: {len(batches)} batches of {lengths} samples where {sizes} are due")
    picked = []  # the dataset index of each served sample, batch by batch
    for j, (batch, size) in enumerate(zip(batches, sizes)):
        rows = _split(batch, collate, case, size, f"{where}, batch {j}")
        picked.append([_index_of(row, by_key, f"{where}, batch {j}") for row in rows])
    expected = torch_batches(case, collate, batch_sampler=picked) if picked else []
    for j, (ours, theirs) in enumerate(zip(batches, expected)):
        _compare(ours, theirs, f"{where}, batch {j} (dataset indices {picked[j]})")
    for j, (ours, theirs) in enumerate(zip(batches, expected)):
        _compare(ours, theirs, f"{where}, batch {j} (dataset indices {picked[j]}) once the epoch was over")
    _check_counts(picked, by_key, case, rotation, where)
    for batch in batches:
        scribble(batch)


def _batch_len(batch: Any, collate: str, due: int) -> int | None:
    """How many samples `batch` holds: known for the list collates, else taken as due."""
    if collate == "list":
        return len(batch) if isinstance(batch, list) else None
    if collate == "batch_level":
        return batch.get("n") if isinstance(batch, dict) else None
    return due


def _split(batch: Any, collate: str, case: Case, size: int, where: str) -> list[Any]:
    try:
        return split_batch(batch, collate, case.spec["root"], size)
    except (Mismatch, KeyError, IndexError, TypeError) as exc:
        raise Mismatch(f"{where}: cannot split the batch into its {size} samples ({exc!r}): {_short(batch, 400)}") \
            from None


def _index_of(row: Any, by_key: dict[Any, list[int]], where: str) -> int:
    found = by_key.get(match_key(row))
    if not found:
        raise Mismatch(f"{where}: serves a sample the dataset never returns: {_short(row, 400)}")
    return found[0]


def _check_counts(picked: list[list[int]], by_key: dict[Any, list[int]], case: Case, rotation: int,
                  where: str) -> None:
    """Each sample served R times (at most R times with drop_last), counted per distinct value."""
    served = Counter(i for batch in picked for i in batch)
    for indices in by_key.values():  # equal samples are told apart by count only
        got, due = served[indices[0]], rotation * len(indices)
        if got > due or (not case.drop_last and got != due):
            raise Mismatch(f"{where}: sample {indices[0]} (and its {len(indices) - 1} equals) served {got} times "
                           f"where {due} are due")
