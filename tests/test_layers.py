"""The layers of docs/ARCHITECTURE.md hold in the code: no cycle between rooms, the store never
imports the loader, no import circle anywhere in the repository, and no module reads another's
private name (docs/import_graph.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rooms_form_layers_and_the_store_never_imports_the_loader(graph):
    edges, modules = graph.graph()
    assert {"loader.api", "loader.epochs.runner", "cachestore.store"} <= modules
    layers = graph.layers(edges)  # exits on a cycle between rooms
    assert any("loader/compat" in level for level in layers[:1])
    for module, targets in edges.items():
        if module.startswith("cachestore"):
            assert not any(t.startswith("loader") for t in targets), (module, targets)


def test_a_cycle_between_rooms_is_reported(graph):
    edges = {"loader.epochs.runner": {"loader.cache.controller"}, "loader.cache.controller": {"loader.epochs.plan"},
             "loader.epochs.plan": set()}
    with pytest.raises(SystemExit, match="cycle"):
        graph.layers(edges)


def test_no_import_circle_in_the_repository(graph):
    edges, modules = graph.graph(graph.SOURCES)
    assert {"benchmarks.__main__", "tests.chaos.runner", "docs.import_graph"} <= modules
    circles = [c for c in graph.cycles(edges) if not all(graph.allowed(m) for m in c)]
    assert circles == []


def test_imports_under_type_checking_and_in_functions_count(graph):
    edges, _ = graph.graph()
    assert {"loader.cache.build", "loader.epochs.windows"} <= edges["loader.resources"]  # TYPE_CHECKING
    assert "loader.executors.ray" in edges["loader.executors.host"]  # inside a function


def test_a_circle_between_modules_is_found(graph):
    edges = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}, "e": {"e2"}, "e2": set()}
    assert graph.cycles(edges) == [["a", "b", "c"]]


def test_no_module_reads_another_modules_private_name(graph):
    assert graph.private_reads() == []


def test_a_private_name_read_across_modules_is_found(graph):
    sources = {
        "pkg": ("", True),
        "pkg.a": ("_LIMIT = 3\nclass A:\n    def __init__(self):\n        self._hidden = 1\n"
                  "    def _step(self):\n        return self._hidden\n", False),
        "pkg.b": ("from pkg.a import _LIMIT\nfrom . import _native\n"
                  "def f(a):\n    return a._hidden + a._step() + a._unknown\n"
                  "class B(A):\n    def g(self):\n        return self._step()\n", False),
        "tests.helpers": ("def _fill(disk):\n    pass\n", False),
        "tests.test_a": ("from pkg.a import _LIMIT\nfrom tests.helpers import _fill\nimport tests.helpers as h\n"
                         "def test(a):\n    assert a._hidden\n    h._fill(a)\n", False),
    }
    assert graph.find_private_reads(sources) == [
        "pkg.b:1: from pkg.a import _LIMIT", "pkg.b:4: a._hidden", "pkg.b:4: a._step",
        # a test reads the internals of what it tests, not those of other tests
        "tests.test_a:2: from tests.helpers import _fill", "tests.test_a:6: h._fill"]


def test_the_loader_never_reads_a_staging_areas_claims_itself(graph):
    # What a generation being written holds is the writer's to say (SharedWriter.present), not a file of
    # its staging area the loader would parse.
    edges, _ = graph.graph()
    assert [m for m, targets in edges.items() if m.startswith("loader") and "cachestore.guard.claims" in targets] == []


def test_architecture_draws_the_layers_the_imports_make(graph):
    text = (ROOT / "docs" / "ARCHITECTURE.md").read_text()
    drawn = text.split("Today it prints:\n\n```\n", 1)[1].split("```", 1)[0].rstrip("\n").splitlines()
    assert drawn == graph.layer_lines(graph.graph()[0]), \
        "docs/ARCHITECTURE.md's layer graph is not the code's: paste `python docs/import_graph.py`'s output there"
