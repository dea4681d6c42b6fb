"""The planner is a floor of its own: it imports nothing above it (the public API, options,
markers' user functions, the runtime), and importing it loads neither orbax, Ray nor tqdm, so
it can be reused and tested alone."""

import ast
import pathlib
import subprocess
import sys

PLANNER = pathlib.Path(__file__).resolve().parent.parent / "planner"


def _imported_modules(path: pathlib.Path) -> set[str]:
    """Every module a file imports, at its top or inside functions."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_planner_modules_import_only_the_planner_from_autopar():
    above = {
        path.name: sorted(
            m
            for m in _imported_modules(path)
            if m.startswith("autopar.") and not m.startswith("autopar.planner")
        )
        for path in sorted(PLANNER.glob("*.py"))
    }
    assert {name: mods for name, mods in above.items() if mods} == {}
    assert len(above) > 30  # every planner module was read


def test_importing_the_planner_loads_neither_orbax_ray_nor_tqdm():
    modules = sorted(p.stem for p in PLANNER.glob("*.py") if p.stem != "__init__")
    code = (
        "import importlib, sys\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module('autopar.planner.' + name)\n"
        "print(sorted(m for m in ('orbax', 'ray', 'tqdm') if m in sys.modules))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=True
    )
    assert result.stdout.strip().splitlines()[-1] == "[]"
