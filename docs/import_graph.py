"""Print the layers of cachestore and the loader, as their imports make them.

``python docs/import_graph.py`` reads every module's imports (statically, with
``ast``), groups the modules into the rooms of ``docs/ARCHITECTURE.md`` and
prints them top-down: a room imports only rooms printed below it. A cycle
between rooms is an error (exit status 1), so the picture in
ARCHITECTURE.md cannot drift from the code unnoticed; ``--modules`` lists
each module's imports inside the project.
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cachestore", "loader")
#: Rooms by module prefix, the longest prefix first. The loader's top level holds its facade
#: (which builds everything) and the small modules every room shares (settings, errors, ...).
#: Package modules (``__init__``) that belong to a room of their own, not their prefix's.
EXACT = {"loader": "loader (facade)", "cachestore": "cachestore (store)"}
ROOMS = [
    ("loader.compat", "loader/compat"),
    ("loader.api", "loader (facade)"),
    ("loader.attributes", "loader (facade)"),
    ("loader.arguments", "loader (facade)"),
    ("loader.state", "loader (facade)"),
    ("loader.device", "loader (facade)"),
    ("loader.epochs", "loader/epochs"),
    ("loader.cache", "loader/cache"),
    ("loader.executors.process", "loader/executors/process"),
    # The executors' seam (the protocol, the messages, the producer every executor runs) sits
    # below the process machinery that implements it; the Ray executor and the host above it.
    ("loader.executors.base", "loader/executors (seam)"),
    ("loader.executors.messages", "loader/executors (seam)"),
    ("loader.executors.producer", "loader/executors (seam)"),
    ("loader.executors.transport", "loader/executors (seam)"),
    ("loader.executors.worker_info", "loader/executors (seam)"),
    ("loader.executors", "loader/executors"),
    ("loader.resources", "loader (shared)"),
    ("loader", "loader (shared)"),
    ("loader.distributed", "loader (shared)"),
    ("cachestore.cli", "cachestore (cli)"),
    ("cachestore.remote", "cachestore/remote"),
    ("cachestore.__main__", "cachestore (cli)"),
    ("cachestore.store", "cachestore (store)"),
    ("cachestore.reader", "cachestore (store)"),
    ("cachestore.writer", "cachestore (store)"),
    ("cachestore.sink", "cachestore (store)"),
    ("cachestore.spec", "cachestore (store)"),
    ("cachestore.shared", "cachestore (store)"),
    ("cachestore.pruning", "cachestore (store)"),
    ("cachestore.backends", "cachestore/backends"),
    ("cachestore", "cachestore (core)"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only(tree: ast.Module) -> set[int]:
    """Ids of the import nodes under ``if TYPE_CHECKING:`` (annotations only: no dependency at run time)."""
    skipped: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            skipped.update(id(inner) for inner in ast.walk(node))
    return skipped


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Project modules `path` imports at run time (relative imports resolved; ``from X import name``
    of a submodule counts as that submodule, of anything else as X)."""
    name = module_name(path)
    package = name if path.name in ("__init__.py", "__init__.pyi") else name.rpartition(".")[0]
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_only(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in type_only:
            continue
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base for alias in node.names]
        else:
            continue
        found.update(t for t in targets if t.split(".")[0] in PACKAGES)
    return found


def room_of(module: str) -> str:
    if module in EXACT:
        return EXACT[module]
    for prefix, room in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return room
    raise ValueError(f"{module} belongs to no room: add it to ROOMS")


def graph() -> tuple[dict[str, set[str]], set[str]]:
    # Stubs stand for compiled modules (cachestore._gather).
    modules = {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py*"))
               if p.suffix in (".py", ".pyi")}
    edges: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges[name] = {m for m in imports_of(path, set(modules)) if m in modules and m != name}
    return edges, set(modules)


def layers(edges: dict[str, set[str]]) -> list[list[str]]:
    """Rooms from the top (imported by none) down; raises on a cycle between rooms."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        rooms[room_of(module)].update(room_of(t) for t in targets if room_of(t) != room_of(module))
    remaining = {room: set(deps) for room, deps in rooms.items()}
    order: list[list[str]] = []
    while remaining:
        imported = set().union(*remaining.values())
        top = sorted(room for room in remaining if room not in imported)
        if not top:
            cycle = ", ".join(f"{r} -> {sorted(d & set(remaining))}" for r, d in sorted(remaining.items()))
            raise SystemExit(f"a cycle between rooms: {cycle}")
        order.append(top)
        for room in top:
            del remaining[room]
    return order


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="list each module's project imports")
    args = parser.parse_args(argv)
    edges, _ = graph()
    if args.modules:
        for module in sorted(edges):
            print(f"{module}: {', '.join(sorted(edges[module])) or '-'}")
        return 0
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        rooms[room_of(module)].update(room_of(t) for t in targets if room_of(t) != room_of(module))
    for level in layers(edges):
        for room in level:
            below = ", ".join(sorted(rooms[room])) or "-"
            print(f"{room:<28} imports {below}")
        print("   |")
    print("numpy, lmdb, zstandard, psutil, xxhash (torch and ray only where asked for)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
