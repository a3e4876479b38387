"""Print the layers of cachestore and the loader, as their imports make them; check the repository's
modules for import circles and for private names read across modules.

``python docs/import_graph.py`` reads every module's imports (statically, with
``ast``: imports inside functions and under ``TYPE_CHECKING`` count too), groups
the modules of the two packages into the rooms of ``docs/ARCHITECTURE.md`` and
prints them top-down: a room imports only rooms printed below it. It fails
(exit status 1) on

* a cycle between rooms, so the picture in ARCHITECTURE.md cannot drift from
  the code unnoticed;
* a circle between modules anywhere in the repository (the packages,
  ``benchmarks/``, ``tests/``, ``docs/``);
* a module that reads another module's private name: ``from x import _name``,
  or ``obj._name`` where ``_name`` is private to another module of the project
  (a module-level name, or an attribute its classes define) and not to this one.
  A package may import its own private submodules (``cachestore.format._gather``), and a
  class may use what its bases define for subclasses (``self._name``).
  Test modules (``tests/``) may read the private names of the code they test
  (white-box checks, fault injection), not those of other test modules.

``--modules`` lists each module's imports inside the repository.
"""

from __future__ import annotations

import argparse
import ast
import functools
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
#: The packages drawn in rooms.
PACKAGES = ("cachestore", "loader")
#: Every directory of the repository's Python modules: checked for circles and private names.
SOURCES = (*PACKAGES, "benchmarks", "tests", "docs")
#: Modules whose circles and private names are known and being removed, by module prefix.
ALLOWED: dict[str, str] = {}
#: Rooms by module prefix, the longest prefix first. The loader's top level holds its facade
#: (which builds everything) and the small modules every room shares (settings, errors, ...).
#: Package modules (``__init__``) that belong to a room of their own, not their prefix's.
EXACT = {"loader": "loader (facade)", "cachestore": "cachestore (api)"}
ROOMS = [
    ("loader.compat", "loader/compat"),
    ("loader.api", "loader (facade)"),
    ("loader.attributes", "loader (facade)"),
    ("loader.arguments", "loader (facade)"),
    ("loader.state", "loader (facade)"),
    ("loader.lengths", "loader (facade)"),
    ("loader.resuming", "loader (facade)"),
    ("loader.device", "loader (facade)"),
    ("loader.epochs", "loader/epochs"),
    ("loader.cache", "loader/cache"),
    ("loader.executors.process", "loader/executors/process"),
    # The executors' seam (the protocol, the messages, the producer and the stream copy every
    # executor's workers run) sits below the process machinery that implements it; the Ray
    # executor, the host and a stream's turn above it.
    ("loader.executors.base", "loader/executors (seam)"),
    ("loader.executors.messages", "loader/executors (seam)"),
    ("loader.executors.positions", "loader/executors (seam)"),
    ("loader.executors.stream_copy", "loader/executors (seam)"),
    ("loader.executors.producer", "loader/executors (seam)"),
    ("loader.executors.seeds", "loader/executors (seam)"),
    ("loader.executors.transport", "loader/executors (seam)"),
    ("loader.executors.worker_info", "loader/executors (seam)"),
    ("loader.executors", "loader/executors"),
    ("loader.resources", "loader (facade)"),
    ("loader", "loader (shared)"),
    ("loader.distributed", "loader (shared)"),
    ("cachestore.cli", "cachestore (cli)"),
    ("cachestore.remote", "cachestore/remote"),
    ("cachestore.__main__", "cachestore (cli)"),
    ("cachestore.opening", "cachestore (api)"),
    ("cachestore.store", "cachestore (store)"),
    ("cachestore.pruning", "cachestore (store)"),
    ("cachestore.write", "cachestore/write"),
    ("cachestore.read", "cachestore/read"),
    ("cachestore.backends", "cachestore/backends"),
    ("cachestore.format", "cachestore/format"),
    ("cachestore.guard", "cachestore/guard"),
    ("cachestore.space", "cachestore/space"),
    ("cachestore", "cachestore (core)"),
]


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


@functools.lru_cache(maxsize=None)
def parse(path: Path) -> ast.Module:
    """The syntax tree of `path` (each file parsed once per run)."""
    return ast.parse(path.read_text(), str(path))


def imports_of(path: Path, modules: set[str]) -> set[str]:
    """Repository modules `path` imports, wherever the import statement stands (at the top, in a
    function, under ``TYPE_CHECKING``: an annotation ties two modules as much as a call does).
    Relative imports are resolved; ``from X import name`` of a submodule counts as that submodule,
    of anything else as X."""
    name = module_name(path)
    package = name if path.stem == "__init__" else name.rpartition(".")[0]
    tree = parse(path)
    found: set[str] = set()
    for node in ast.walk(tree):
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
        found.update(t for t in targets if t.split(".")[0] in SOURCES)
    return found


def room_of(module: str) -> str:
    if module in EXACT:
        return EXACT[module]
    for prefix, room in ROOMS:
        if module == prefix or module.startswith(prefix + "."):
            return room
    raise ValueError(f"{module} belongs to no room: add it to ROOMS")


def graph(sources: tuple[str, ...] = PACKAGES) -> tuple[dict[str, set[str]], set[str]]:
    """Each module of `sources` and the repository modules it imports."""
    # Stubs stand for compiled modules (cachestore.format._gather).
    modules = {module_name(p): p for package in sources for p in sorted((ROOT / package).rglob("*.py*"))
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


def allowed(module: str) -> bool:
    return any(module == prefix or module.startswith(prefix + ".") for prefix in ALLOWED)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The circles between modules: each strongly connected set of two or more modules, sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []
    for root in sorted(edges):
        if root in index:
            continue
        # Tarjan's algorithm, iteratively: (module, the targets left to visit).
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = len(index)
        stack.append(root)
        while work:
            module, targets = work[-1]
            target = next(targets, None)
            if target is not None:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    work.append((target, iter(sorted(edges.get(target, ())))))
                elif target in stack:
                    low[module] = min(low[module], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while True:
                    member = stack.pop()
                    group.append(member)
                    if member == module:
                        break
                if len(group) > 1:
                    found.append(sorted(group))
    return sorted(found)


def _private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _own_privates(tree: ast.Module) -> tuple[set[str], set[str]]:
    """The private names a module defines: at module level, and as attributes of its classes."""
    top: set[str] = set()
    for node in tree.body:
        targets: list[ast.expr] = []
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            top.add(node.name)
        elif isinstance(node, ast.Assign):
            targets = node.targets
        elif isinstance(node, ast.AnnAssign):
            targets = [node.target]
        top.update(t.id for t in targets if isinstance(t, ast.Name))
    attributes: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    attributes.add(item.name)
                elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    attributes.add(item.target.id)
                elif isinstance(item, ast.Assign):
                    attributes.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif (isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store)
              and isinstance(node.value, ast.Name) and node.value.id in ("self", "cls")):
            attributes.add(node.attr)
    return {n for n in top if _private(n)}, {n for n in attributes if _private(n)}


def _test(module: str) -> bool:
    return module.split(".")[0] == "tests"


def _own_object(node: ast.expr) -> bool:
    """Whether `node` is the object whose method runs (``self``, ``cls``, ``super()``): a class may use
    what its bases define for their subclasses."""
    if isinstance(node, ast.Name):
        return node.id in ("self", "cls")
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "super"


def private_reads(sources: tuple[str, ...] = SOURCES) -> list[str]:
    """Every place a module of `sources` reads a private name of another module of the project (see the
    module docstring), as ``module:line: what``."""
    paths = {module_name(p): p for package in sources for p in sorted((ROOT / package).rglob("*.py"))}
    return find_private_reads({name: (parse(path), path.stem == "__init__") for name, path in paths.items()})


def find_private_reads(sources: dict[str, tuple[ast.Module | str, bool]]) -> list[str]:
    """:func:`private_reads` of modules given as ``{name: (syntax tree or source, whether it is a package)}``."""
    trees = {name: tree if isinstance(tree, ast.Module) else ast.parse(tree, name)
             for name, (tree, _) in sources.items()}
    owned = {name: _own_privates(tree) for name, tree in trees.items()}
    everyone = set().union(*(top | attributes for top, attributes in owned.values()))
    # Tests may reach into the code they test, not into each other.
    of_tests = set().union(*(top | attributes for name, (top, attributes) in owned.items() if _test(name)))
    of_code = set().union(*(top | attributes for name, (top, attributes) in owned.items() if not _test(name)))
    found: list[str] = []
    for name, tree in sorted(trees.items()):
        if allowed(name):
            continue
        others = of_tests - of_code if _test(name) else everyone
        top, attributes = owned[name]
        package = name if sources[name][1] else name.rpartition(".")[0]
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                for alias in node.names:
                    # a package's own private submodule is fine; a test may import what it tests
                    if _private(alias.name) and base != package and (not _test(name) or _test(base)):
                        found.append(f"{name}:{node.lineno}: from {base} import {alias.name}")
            elif (isinstance(node, ast.Attribute) and _private(node.attr) and node.attr in others
                  and node.attr not in attributes and node.attr not in top and not _own_object(node.value)):
                found.append(f"{name}:{node.lineno}: {ast.unparse(node)}")
    return found


def layer_lines(edges: dict[str, set[str]]) -> list[str]:
    """The layers as ARCHITECTURE.md draws them: each room and the rooms it imports, top-down."""
    rooms: dict[str, set[str]] = defaultdict(set)
    for module, targets in edges.items():
        rooms[room_of(module)].update(room_of(t) for t in targets if room_of(t) != room_of(module))
    lines: list[str] = []
    for level in layers(edges):
        if lines:
            lines.append("   |")
        lines += [f"{room:<28} imports {', '.join(sorted(rooms[room])) or '-'}" for room in level]
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--modules", action="store_true", help="list each module's repository imports")
    args = parser.parse_args(argv)
    if args.modules:
        every, _ = graph(SOURCES)
        for module in sorted(every):
            print(f"{module}: {', '.join(sorted(every[module])) or '-'}")
        return 0
    print("\n".join(layer_lines(graph()[0])))
    print("   |")
    print("numpy, lmdb, zstandard, psutil, xxhash (torch and ray only where asked for)")
    circles = [c for c in cycles(graph(SOURCES)[0]) if not all(allowed(m) for m in c)]
    reads = private_reads()
    for circle in circles:
        print(f"import circle: {' -> '.join(circle)}", file=sys.stderr)
    for read in reads:
        print(f"private name read across modules: {read}", file=sys.stderr)
    return 1 if circles or reads else 0


if __name__ == "__main__":
    sys.exit(main())
