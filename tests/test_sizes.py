"""No function in the storage engine or the loader is longer than 80 lines (a reader understands a
function without scrolling; see docs/ARCHITECTURE.md)."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def long_functions(root: Path, base: Path = ROOT) -> list[str]:
    """``path:line name (lines)`` (paths from `base`) of every function under `root` longer than the limit."""
    found = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                lines = node.end_lineno - node.lineno + 1
                if lines > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(base)}:{node.lineno} {node.name} ({lines} lines)")
    return found


def test_no_function_is_longer_than_80_lines():
    assert long_functions(ROOT / "cachestore") + long_functions(ROOT / "loader") == []


def test_a_long_function_is_found(tmp_path):
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    (tmp_path / "m.py").write_text(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tmp_path, tmp_path) == ["m.py:5 long (81 lines)"]


MAX_MODULE_LINES = 450
#: The facade: what a reader opens first stays short enough to read whole.
MAX_FACADE_LINES = 300


def test_no_module_is_longer_than_450_lines_and_the_facade_300():
    long = [f"{p.relative_to(ROOT)} ({n} lines)" for root in ("cachestore", "loader")
            for p in sorted((ROOT / root).rglob("*.py")) if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES]
    assert long == []
    assert len((ROOT / "loader" / "api.py").read_text().splitlines()) <= MAX_FACADE_LINES
