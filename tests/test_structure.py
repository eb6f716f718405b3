"""The package's import graph: imports run one way (cli → recipe → pipeline → calibration/operators/surgery
→ adapters) with no circle, and no module imports another inside a function to hide one, but the command
line: it imports the modules that do the work inside its commands, so that its help and its refusals of
bad options answer at once (tests/test_startup.py); those imports are its edges like any other."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import ghostlayers

PACKAGE = Path(ghostlayers.__file__).parent
DEFERRED = {"cli"}  # the one module allowed to import others inside functions


def imports(path: Path) -> tuple[set[str], set[str]]:
    """The ghostlayers modules ``path`` imports at module level, and those it imports inside functions."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: set[str] = set()
    for node in ast.walk(tree):
        names = []
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ghostlayers"):
            if node.module == "ghostlayers":
                names = [f"ghostlayers.{alias.name}" for alias in node.names]
            else:
                names = [node.module]
        elif isinstance(node, ast.Import):
            names = [a.name for a in node.names if a.name.startswith("ghostlayers.")]
        modules = {n for n in names if (PACKAGE / f"{n.split('.')[1]}.py").is_file()}
        (top if node in tree.body else nested).update(modules)
    return top, nested


def graph() -> dict[str, set[str]]:
    edges = {}
    for path in PACKAGE.glob("*.py"):
        if path.stem in ("__init__", "__main__"):
            continue
        top, nested = imports(path)
        assert not nested or path.stem in DEFERRED, f"{path.name} imports {sorted(nested)} inside a function"
        edges[f"ghostlayers.{path.stem}"] = (top | nested) - {f"ghostlayers.{path.stem}"}
    return edges


def test_no_import_circle_and_no_hidden_imports():
    edges = graph()
    done: set[str] = set()

    def visit(module: str, path: list[str]) -> None:
        if module in path:
            raise AssertionError("import circle: " + " → ".join([*path[path.index(module) :], module]))
        if module in done:
            return
        for target in edges.get(module, ()):
            visit(target, [*path, module])
        done.add(module)

    for module in edges:
        visit(module, [])


def test_imports_run_from_the_command_line_down_to_the_adapters():
    edges = graph()

    def reaches(a: str, b: str) -> bool:
        seen, todo = set(), [a]
        while todo:
            m = todo.pop()
            if m == b:
                return True
            if m not in seen:
                seen.add(m)
                todo += edges.get(m, ())
        return False

    chain = ["cli", "recipe", "pipeline", "calibration", "adapters"]
    for upper, lower in itertools.pairwise(chain):
        assert reaches(f"ghostlayers.{upper}", f"ghostlayers.{lower}")
        assert not reaches(f"ghostlayers.{lower}", f"ghostlayers.{upper}"), f"{lower} imports {upper}"
    for core in ("calibration", "operators", "surgery"):
        assert not reaches(f"ghostlayers.{core}", "ghostlayers.pipeline")


def test_the_numerical_core_never_imports_the_sources():
    """Fetching and parsing (``ghostlayers.sources``) stay apart from the numbers: the core sees token windows
    and models, not where they came from; neither it nor any module it imports reaches the sources."""
    edges = graph()
    reached, todo = set(), [f"ghostlayers.{core}" for core in ("calibration", "operators", "surgery", "pipeline")]
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += edges.get(module, ())
    for module in reached:
        tree = ast.parse((PACKAGE / f"{module.split('.')[1]}.py").read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if n.startswith("ghostlayers.sources")], f"{module} imports ghostlayers.sources"
