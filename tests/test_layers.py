"""The layers of docs/ARCHITECTURE.md hold in the code: no cycle between rooms, the store never
imports the loader, no import circle anywhere in the repository, and no module reads another's
private name (docs/import_graph.py). The sections the code cites, and the links between the docs,
exist."""

from __future__ import annotations

import importlib.util
import re
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
    assert {"loader.cache.remote", "loader.epochs.windows"} <= edges["loader.resources"]  # TYPE_CHECKING
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


#: A section of the architecture page cited by title: its file name, then a comma or a space (and
#: maybe the word "section"), then the title in double quotes, on one line or wrapped.
CITATION = re.compile(r'ARCHITECTURE\.md`{0,2}(?:,\s*|\s+)(?:section\s+)?"([^"]+)"')
#: A line break inside a comment or docstring: the next line's indent and comment marks.
WRAP = re.compile(r"\n[ \t]*(?:#+:?|\*|//)?[ \t]*")
#: Where citations are looked for, and in which files.
CITING = ("loader", "cachestore", "benchmarks", "tests", "docs", "README.md")
CITING_SUFFIXES = (".py", ".pyi", ".c", ".md")


def cited_sections(text: str) -> list[str]:
    """The titles of the architecture page's sections that `text` cites."""
    return [" ".join(title.split()) for title in CITATION.findall(WRAP.sub(" ", text))]


def headings(markdown: str) -> list[str]:
    """The titles of `markdown`'s headings, outside its code blocks."""
    titles, fenced = [], False
    for line in markdown.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6}\s+(.+?)\s*#*\s*$", line)):
            titles.append(m.group(1))
    return titles


def citing_files() -> list[Path]:
    found = []
    for name in CITING:
        root = ROOT / name
        found += [root] if root.is_file() else sorted(
            p for p in root.rglob("*") if p.suffix in CITING_SUFFIXES and p.is_file())
    return [p for p in found if p != ROOT / "docs" / "ARCHITECTURE.md"]


def test_every_section_the_code_cites_exists():
    titles = set(headings((ROOT / "docs" / "ARCHITECTURE.md").read_text()))
    cited = {(str(p.relative_to(ROOT)), title) for p in citing_files() for title in cited_sections(p.read_text())}
    assert len(cited) > 50  # the scan finds the citations
    assert sorted(f"{path}: {title!r}" for path, title in cited if title not in titles) == []


def test_a_cited_section_is_found_wrapped_or_not():
    page = "ARCHITECTURE" + ".md"  # spelled apart: this file is scanned too
    text = (f'(see docs/{page}, "Untrusted stores")\n'
            f'    # the checksums (docs/{page},\n    # "Verified\n    # reads") and\n'
            f'    #: first (``docs/{page}``,\n    #: "Resuming")\n'
            f' * (docs/{page} "The path of a batch"); docs/{page}, section "Layers"\n'
            f'see docs/{page} for the rest; "not a citation"')
    assert cited_sections(text) == ["Untrusted stores", "Verified reads", "Resuming", "The path of a batch", "Layers"]
    assert headings("# Top\n## Untrusted stores\n```\n# not a heading\n```\n### Verified reads ##\n") == \
        ["Top", "Untrusted stores", "Verified reads"]


def slug(title: str, taken: dict[str, int]) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as dashes; a
    repeated one gets ``-1``, ``-2``, ..."""
    base = re.sub(r"[^\w\- ]", "", title.lower().replace("`", "")).replace(" ", "-")
    n = taken.get(base, 0)
    taken[base] = n + 1
    return f"{base}-{n}" if n else base


def anchors(markdown: str) -> set[str]:
    taken: dict[str, int] = {}
    return {slug(title, taken) for title in headings(markdown)} | set(re.findall(r'<a id="([^"]+)"', markdown))


def test_every_link_between_the_docs_resolves():
    broken = []
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = doc.read_text()
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue  # a URL
            path, _, anchor = target.partition("#")
            linked = (doc.parent / path).resolve() if path else doc
            if not linked.exists():
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
            elif anchor and linked.suffix == ".md" and anchor not in anchors(linked.read_text()):
                broken.append(f"{doc.relative_to(ROOT)}: {target}")
    assert broken == []
