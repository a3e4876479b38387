"""The layers of docs/ARCHITECTURE.md hold in the code: no cycle between rooms, and the store never
imports the loader."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _import_graph():
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "docs" / "import_graph.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rooms_form_layers_and_the_store_never_imports_the_loader():
    graph = _import_graph()
    edges, modules = graph.graph()
    assert {"loader.api", "loader.epochs.runner", "cachestore.store"} <= modules
    layers = graph.layers(edges)  # exits on a cycle between rooms
    assert any("loader/compat" in level for level in layers[:1])
    for module, targets in edges.items():
        if module.startswith("cachestore"):
            assert not any(t.startswith("loader") for t in targets), (module, targets)


def test_a_cycle_between_rooms_is_reported():
    graph = _import_graph()
    edges = {"loader.epochs.runner": {"loader.cache.controller"}, "loader.cache.controller": {"loader.epochs.plan"},
             "loader.epochs.plan": set()}
    try:
        graph.layers(edges)
    except SystemExit as exc:
        assert "cycle" in str(exc)
    else:
        raise AssertionError("a cycle between loader/epochs and loader/cache went unnoticed")
