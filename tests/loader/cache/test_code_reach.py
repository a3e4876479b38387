"""The fingerprint follows what the dataset's code reaches: the module-level values and helper functions
its transforms and methods use, in the training script and in other modules (loader/cache/reach.py)."""

from __future__ import annotations

import functools
import json
import re
import subprocess
import sys
import textwrap
import threading
import types
from pathlib import Path

import numpy as np
import pytest

from cachestore import FingerprintError
from loader.cache.fingerprint import _source_hash, dataset_fingerprint, params_hash
from loader.cache.reach import installed_version
from loader.dataset import DatasetSource

REPO = Path(__file__).resolve().parents[3]

# ---------------------------------------------------------------------------- served values (real runs)
SCRIPT = """
import json, os, sys
import numpy as np
from loader import CachedLoader
{imports}
SCALE = {scale}


{dataset}

if __name__ == "__main__":
    with CachedLoader({build}, batch_size=3, nb_worker=0, shuffle=False,
                      cache_setting={{"prefix": sys.argv[1], "on_mismatch": sys.argv[2]}}) as loader:
        values = [b.tolist() for b in loader]
        print(json.dumps({{"values": values, "mode": loader.epoch_stats[0].mode}}))
"""
#: Where the constant is read: a transform function of the script given to a dataset class of another
#: module, or the dataset class's own method (its module source unchanged: the value comes from the
#: environment, as from a config file or the command line).
CASES = {
    "transform": dict(imports="from tests.loader.datasets import TableDataset", dataset="""
def transform(x):
    return x * SCALE
""", build="TableDataset(np.arange(12, dtype=np.float32).reshape(6, 2), transform)"),
    "method": dict(imports="", dataset="""
class Scaled:
    def __len__(self):
        return 6

    def __getitem__(self, i):
        return np.full(2, i * SCALE)
""", build="Scaled()"),
}


def _run(tmp_path: Path, source: str, mismatch: str = "error", env: dict | None = None) -> subprocess.CompletedProcess:
    script = tmp_path / "train.py"
    script.write_text(source)
    # -B: no bytecode cache, whose timestamp check cannot tell two edits within a second apart.
    return subprocess.run([sys.executable, "-B", str(script), str(tmp_path / "cache"), mismatch],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path,
                          env={**env_of_repo(), **(env or {})})


def env_of_repo() -> dict:
    import os

    return {**os.environ, "PYTHONPATH": str(REPO), "PYTHONDONTWRITEBYTECODE": "1"}


def _served(done: subprocess.CompletedProcess) -> dict:
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("where", list(CASES))
def test_a_changed_constant_of_the_training_script_is_not_served_from_the_old_cache(tmp_path, where):
    case = CASES[where]

    def source(scale: float) -> str:
        value = "float(os.environ['SCALE'])" if where == "method" else repr(scale)
        return SCRIPT.format(scale=value, **case)

    first = _served(_run(tmp_path, source(2.0), env={"SCALE": "2.0"}))
    assert first["mode"] == "generate"
    again = _served(_run(tmp_path, source(2.0), env={"SCALE": "2.0"}))
    assert again == {**first, "mode": "read"}  # the same code and values: the cache is reused

    refused = _run(tmp_path, source(3.0), env={"SCALE": "3.0"})
    assert refused.returncode != 0 and "FingerprintMismatchError" in refused.stderr, refused.stdout
    said = "state" if where == "transform" else "code"
    assert f"the dataset's {said}" in refused.stderr, refused.stderr

    changed = _served(_run(tmp_path, source(3.0), mismatch="regenerate", env={"SCALE": "3.0"}))
    assert changed["mode"] == "generate"
    assert np.allclose(np.array(changed["values"]), 1.5 * np.array(first["values"]))


HELPER = """
def scale(x):
    return x * {factor}
"""
HELPER_SCRIPT = """
import json, sys
import numpy as np
from loader import CachedLoader
from tests.loader.datasets import TableDataset
import helpers
from helpers import scale


def transform(x):
    return {call}(x) + 1


if __name__ == "__main__":
    dataset = TableDataset(np.arange(12, dtype=np.float32).reshape(6, 2), transform)
    with CachedLoader(dataset, batch_size=3, nb_worker=0, shuffle=False,
                      cache_setting={{"prefix": sys.argv[1], "on_mismatch": sys.argv[2]}}) as loader:
        print(json.dumps({{"values": [b.tolist() for b in loader], "mode": loader.epoch_stats[0].mode}}))
"""


@pytest.mark.timeout(300)
@pytest.mark.parametrize("call", ["helpers.scale", "scale"])
def test_an_edited_helper_in_another_module_is_not_served_from_the_old_cache(tmp_path, call):
    (tmp_path / "helpers.py").write_text(HELPER.format(factor="2.0"))
    script = HELPER_SCRIPT.format(call=call)
    first = _served(_run(tmp_path, script))
    assert _served(_run(tmp_path, script))["mode"] == "read"
    (tmp_path / "helpers.py").write_text(HELPER.format(factor="3.0"))  # the same size: only the body differs
    refused = _run(tmp_path, script)
    assert refused.returncode != 0 and "FingerprintMismatchError" in refused.stderr, refused.stdout
    changed = _served(_run(tmp_path, script, mismatch="regenerate"))
    assert np.allclose(np.array(changed["values"]) - 1, 1.5 * (np.array(first["values"]) - 1))


# ---------------------------------------------------------------------------- in one process
def _module(tmp_path: Path, name: str, source: str) -> types.ModuleType:
    """A module of user code (a file outside site-packages) named `name`, as a fresh import makes it."""
    module = types.ModuleType(name)
    module.__file__ = str(tmp_path / f"{name}.py")
    (tmp_path / f"{name}.py").write_text(source)
    sys.modules[name] = module
    exec(compile(source, module.__file__, "exec"), module.__dict__)
    return module


@pytest.fixture
def user_modules(tmp_path):
    made: list[str] = []

    def make(name: str, source: str) -> types.ModuleType:
        made.append(name)
        return _module(tmp_path, name, textwrap.dedent(source))

    yield make
    for name in made:
        sys.modules.pop(name, None)


def test_a_global_a_function_reads_is_hashed_by_value(user_modules):
    script = user_modules("reach_script", """
        import numpy as np
        SCALE = 2.0
        TABLE = np.arange(5.0)
        def transform(x):
            return x * SCALE + TABLE[int(x) % 5]
        def unrelated(x):
            return x
    """)
    before = params_hash({"t": script.transform})
    script.SCALE = 3.0
    assert params_hash({"t": script.transform}) != before
    script.SCALE = 2.0
    assert params_hash({"t": script.transform}) == before
    script.TABLE[3] = -1  # an array the function reads, changed in place
    assert params_hash({"t": script.transform}) != before
    script.TABLE[3] = 3.0
    other = params_hash({"t": script.unrelated})
    script.SCALE = 4.0  # a global it does not read
    assert params_hash({"t": script.unrelated}) == other


def test_helpers_in_other_modules_are_followed(user_modules):
    helper_source = """
        def normalize(x):
            return inner(x) / {d}
        def inner(x):
            return x - {m}
    """
    user_modules("reach_helpers", helper_source.format(d=2, m=1))
    script = user_modules("reach_script2", """
        import reach_helpers
        from reach_helpers import inner
        def by_attribute(x):
            return reach_helpers.normalize(x)
        def by_name(x):
            return inner(x)
    """)
    before = {name: params_hash({"t": getattr(script, name)}) for name in ("by_attribute", "by_name")}
    # The helper module edited: its function bodies change (the script's names are rebound as a fresh
    # run's import would bind them).
    helpers = user_modules("reach_helpers", helper_source.format(d=3, m=1))
    script.reach_helpers, script.inner = helpers, helpers.inner
    assert params_hash({"t": script.by_attribute}) != before["by_attribute"]  # normalize's body
    assert params_hash({"t": script.by_name}) == before["by_name"]  # inner did not change
    helpers = user_modules("reach_helpers", helper_source.format(d=3, m=2))
    script.reach_helpers, script.inner = helpers, helpers.inner
    assert params_hash({"t": script.by_attribute}) != before["by_attribute"]
    assert params_hash({"t": script.by_name}) != before["by_name"]  # inner, called by normalize too


def test_the_dataset_class_methods_reach_counts(user_modules):
    module = user_modules("reach_dataset", """
        import numpy as np
        OFFSET = 1
        def shift(x):
            return x + OFFSET
        class Shifted:
            def __len__(self):
                return 4
            def __getitem__(self, i):
                return np.full(2, shift(i))
    """)
    before = _source_hash(module.Shifted)
    module.OFFSET = 2  # the module's source is the same: the value differs
    assert _source_hash(module.Shifted) != before
    module.OFFSET = 1
    assert _source_hash(module.Shifted) == before


def test_cycles_and_shared_helpers_are_hashed_once_and_stably(user_modules):
    source = """
        LIMIT = {limit}
        def even(n):
            return n == 0 or odd(n - 1)
        def odd(n):
            return n != 0 and even(n - 1) and n < LIMIT
        def both(x):
            return even(x), odd(x), even(x + 1)
        class Node:
            def walk(self):
                return Node, both(1)
    """
    first = user_modules("reach_cycles", source.format(limit=10))
    a = params_hash({"f": first.both, "c": first.Node, "o": first.Node()})
    second = user_modules("reach_cycles", source.format(limit=10))  # the same code, objects anew
    assert params_hash({"f": second.both, "c": second.Node, "o": second.Node()}) == a
    third = user_modules("reach_cycles", source.format(limit=11))  # a value two calls away
    assert params_hash({"f": third.both, "c": third.Node, "o": third.Node()}) != a


def test_installed_code_is_named_with_its_version_not_hashed():
    import numpy

    assert installed_version("numpy") == f"numpy {numpy.__version__}"
    assert installed_version("json").startswith("python ")
    assert installed_version(__name__) is None  # this test module is user code

    def uses_numpy(x):
        return np.mean(np.log1p(x)) + json.dumps(x)

    assert params_hash({"f": uses_numpy}) == params_hash({"f": uses_numpy})


def test_an_unhashable_global_counts_by_its_type_and_does_not_refuse_the_dataset(user_modules):
    module = user_modules("reach_lock", """
        import threading
        LOCK = threading.Lock()
        def guarded(x):
            with LOCK:
                return x
    """)
    assert params_hash({"f": module.guarded}) == params_hash({"f": module.guarded})
    # In the dataset's own state, a lock still asks for an explicit fingerprint (it is the data).
    with pytest.raises(FingerprintError, match="lock"):
        params_hash({"lock": threading.Lock()})


def test_a_long_chain_of_calls_is_followed_to_its_end(user_modules):
    def chain(end: int) -> types.ModuleType:
        lines = [f"def f0(x):\n    return x + {end}\n"]
        lines += [f"def f{i}(x):\n    return f{i - 1}(x)\n" for i in range(1, 3000)]  # past Python's stack
        return user_modules("reach_chain", "".join(lines))

    first = params_hash({"f": chain(1).f2999})
    assert params_hash({"f": chain(1).f2999}) == first
    assert params_hash({"f": chain(2).f2999}) != first


# ---------------------------------------------------------------------------- what pickle reduces through copyreg
@pytest.mark.parametrize("a, b", [
    (np.log1p, np.expm1),
    (functools.partial(np.multiply, 2.0), functools.partial(np.multiply, 3.0)),
    (re.compile(r"\d+"), re.compile(r"\w+")),
    (re.compile("a", re.IGNORECASE), re.compile("a")),
], ids=["ufunc", "partial-ufunc", "pattern", "pattern-flags"])
def test_what_pickles_through_copyreg_is_hashed_by_its_reduce_value(a, b):
    assert params_hash({"p": a}) == params_hash({"p": a})
    assert params_hash({"p": a}) != params_hash({"p": b})


def test_a_dataset_holding_ufuncs_and_patterns_is_fingerprinted():
    from ..datasets import TableDataset

    transform = [np.log1p, functools.partial(np.multiply, 2.0), re.compile(r"x+")]
    first = dataset_fingerprint(DatasetSource.of(TableDataset(np.zeros(3), transform), None), 3, (0, 1))
    same = dataset_fingerprint(DatasetSource.of(TableDataset(np.zeros(3), list(transform)), None), 3, (0, 1))
    assert first == same


def test_a_random_generator_reached_by_name_counts_by_its_type(user_modules):
    import torch

    source = """
        import random
        import numpy as np
        import torch
        RNG, LEGACY, PY, TORCH = np.random.default_rng(), np.random.RandomState(), random.Random(), torch.Generator()
        def augment(x):
            return x + RNG.random() + LEGACY.rand() + PY.random() + TORCH.initial_seed()
    """
    first = params_hash({"f": user_modules("reach_rng", source).augment})
    torch.manual_seed(0)
    # Another run draws other unseeded states: the same dataset.
    assert params_hash({"f": user_modules("reach_rng", source).augment}) == first


def test_code_constants_are_hashed_the_same_in_every_run(tmp_path):
    # ``x in {"a", "b"}`` keeps a frozenset constant, whose repr orders strings by their hash (seeded
    # anew in each process).
    code = ("import sys; sys.path.insert(0, {repo!r}); from loader.cache.fingerprint import params_hash\n"
            "def pick(x):\n    return x in {{'alpha', 'beta', 'gamma', 'delta', 'epsilon'}}\n"
            "print(params_hash({{'f': pick}}))\n").format(repo=str(REPO))
    hashes = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True,
                             env={**env_of_repo(), "PYTHONHASHSEED": str(seed)}).stdout for seed in (1, 2, 3)}
    assert len(hashes) == 1, hashes


def test_caches_python_sets_on_a_class_later_do_not_change_its_hash():
    from ..datasets import ArangeDataset

    class Fresh(ArangeDataset):
        pass

    before = _source_hash(Fresh)
    Fresh(3).__reduce_ex__(4)  # sets Fresh.__slotnames__ (copyreg), as pickling the dataset for workers does
    assert vars(Fresh)["__slotnames__"] == []
    assert _source_hash(Fresh) == before


def test_a_helper_whose_closure_holds_a_lock_still_counts_by_its_code(user_modules):
    source = """
        import threading
        def make(lock):
            def guarded(x):
                with lock:
                    return x * {factor}
            return guarded
        helper = make(threading.Lock())
        def transform(x):
            return helper(x)
    """
    first = params_hash({"f": user_modules("reach_closure", source.format(factor=2)).transform})
    assert params_hash({"f": user_modules("reach_closure", source.format(factor=2)).transform}) == first
    assert params_hash({"f": user_modules("reach_closure", source.format(factor=3)).transform}) != first
