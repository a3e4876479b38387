"""The wheel ships every module: built from this tree, unpacked, and each module imported from it."""

from __future__ import annotations

import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("cachestore", "loader")


def test_the_wheel_holds_and_imports_every_module(tmp_path):
    # Built from a copy: an in-tree build/ directory would carry modules that no longer exist.
    source = tmp_path / "src"
    skip = shutil.ignore_patterns(".git", ".venv", "build", "*.egg-info", "__pycache__", "*.so")

    def ignore(directory: str, names: list[str]) -> set[str]:
        # The demo's cache/ at the top only: loader/cache/ is a package.
        return set(skip(directory, names)) | ({"cache"} if Path(directory) == ROOT else set())

    shutil.copytree(ROOT, source, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--quiet",
                    "--wheel-dir", str(tmp_path / "dist"), str(source)], check=True, timeout=300)
    (wheel,) = (tmp_path / "dist").glob("cachestore-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        archive.extractall(tmp_path / "site")
    shipped = {n for n in names if n.endswith(".py") and n.split("/")[0] in PACKAGES}
    in_tree = {str(p.relative_to(ROOT)) for package in PACKAGES for p in (ROOT / package).rglob("*.py")}
    assert shipped == in_tree, f"modules missing from the wheel: {sorted(in_tree - shipped)}"
    assert {"cachestore/py.typed", "loader/py.typed"} <= set(names)
    # `python -m cachestore` runs the command line: it is not imported, it is run.
    modules = sorted(n[:-3].replace("/", ".").removesuffix(".__init__") for n in shipped
                     if not n.endswith("__main__.py"))
    script = textwrap.dedent(f"""
        import importlib, sys
        sys.path.insert(0, {str(tmp_path / "site")!r})
        for name in {modules!r}:
            module = importlib.import_module(name)
            assert module.__file__.startswith({str(tmp_path / "site")!r}), (name, module.__file__)
        assert "ray" not in sys.modules, "importing the loader must not import ray (an optional extra)"
        print(len({modules!r}))
    """)
    done = subprocess.run([sys.executable, "-c", script], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) == len(modules)
    cli = subprocess.run([sys.executable, "-m", "cachestore", "--help"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60, env={"PYTHONPATH": str(tmp_path / "site"), "PATH": "/usr/bin:/bin"})
    assert cli.returncode == 0 and "inspect" in cli.stdout, cli.stderr
