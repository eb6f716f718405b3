"""The package's import graph: subpackages in ranks (``RANKS``), each importing only from its own rank or lower
(cli → jobs → repair → store → measure → calibration → model → config → sources → files → numerics → registry
→ errors), with no circle, and no module imports another inside a function to hide one, but the command line:
it imports the modules that do the work inside its commands, so that its help and its refusals of bad options
answer at once (tests/test_startup.py); those imports are its edges like any other. The light modules (the
command line's own imports, and all they import) import neither torch nor transformers at module level."""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

import ghostlayers

PACKAGE = Path(ghostlayers.__file__).parent
DEFERRED = {"ghostlayers.cli"}  # the one module allowed to import others inside functions
RANKS = {  # a module may import from its own subpackage and from those of lower rank
    "errors": 0,
    "registry": 1,
    "numerics": 2,
    "files": 3,
    "sources": 4,
    "config": 5,
    "model": 6,
    "calibration": 7,
    "measure": 8,
    "store": 9,
    "repair": 10,
    "jobs": 11,
    "cli": 12,
    "__main__": 12,
}
LIGHT = ("ghostlayers.cli", "ghostlayers.config.settings", "ghostlayers.config.recipes", "ghostlayers.files.folders")
HEAVY = ("torch", "transformers", "lm_eval", "accelerate", "peft", "matplotlib")  # safetensors alone is light


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def is_module(name: str) -> bool:
    return (PACKAGE.parent / f"{name.replace('.', '/')}.py").is_file()


def imported(node: ast.AST) -> list[str]:
    """The ghostlayers modules one import statement names (a subpackage's module, or the module a name comes
    from)."""
    if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "ghostlayers":
        inner = [f"{node.module}.{alias.name}" for alias in node.names if is_module(f"{node.module}.{alias.name}")]
        return inner if inner else [node.module] if is_module(node.module) else []
    if isinstance(node, ast.Import):
        return [a.name for a in node.names if a.name.startswith("ghostlayers.") and is_module(a.name)]
    return []


def imports(path: Path) -> tuple[set[str], set[str]]:
    """The ghostlayers modules ``path`` imports at module level, and those it imports inside functions."""
    tree = ast.parse(path.read_text())
    top: set[str] = set()
    nested: set[str] = set()
    for node in ast.walk(tree):
        (top if node in tree.body else nested).update(imported(node))
    return top, nested


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__",)}


def graph(top_only: bool = False) -> dict[str, set[str]]:
    edges = {}
    for name, path in modules().items():
        top, nested = imports(path)
        assert not nested or name in DEFERRED, f"{name} imports {sorted(nested)} inside a function"
        edges[name] = (top if top_only else top | nested) - {name}
    return edges


def reaches(edges: dict[str, set[str]], a: str, b: str) -> bool:
    seen, todo = set(), [a]
    while todo:
        m = todo.pop()
        if m == b:
            return True
        if m not in seen:
            seen.add(m)
            todo += edges.get(m, ())
    return False


def closure(edges: dict[str, set[str]], start: list[str]) -> set[str]:
    reached, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module not in reached:
            reached.add(module)
            todo += edges.get(module, ())
    return reached


def rank(module: str) -> int:
    return RANKS[module.split(".")[1]]


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


def test_every_module_sits_in_a_ranked_subpackage():
    for name in modules():
        assert name.split(".")[1] in RANKS, f"{name} is in no subpackage of RANKS"


def test_no_module_imports_from_a_higher_rank():
    wrong = [
        f"{a} (rank {rank(a)}) imports {b} (rank {rank(b)})"
        for a, targets in graph().items()
        for b in targets
        if rank(b) > rank(a)
    ]
    assert not wrong, "\n".join(sorted(wrong))


def test_imports_run_from_the_command_line_down_to_the_adapters():
    edges = graph()
    chain = ["cli", "jobs.runs", "repair.pipeline", "calibration.passes", "model.adapters"]
    for upper, lower in itertools.pairwise(chain):
        assert reaches(edges, f"ghostlayers.{upper}", f"ghostlayers.{lower}")
        assert not reaches(edges, f"ghostlayers.{lower}", f"ghostlayers.{upper}"), f"{lower} imports {upper}"
    for core in ("calibration.passes", "numerics.fitting", "model.surgery"):
        assert not reaches(edges, f"ghostlayers.{core}", "ghostlayers.repair.pipeline")


def test_the_numerical_core_never_imports_the_sources():
    """Fetching and parsing (``ghostlayers.sources``) stay apart from the numbers: the core sees token windows
    and models, not where they came from; neither it nor any module it imports reaches the sources."""
    core = ["calibration.passes", "numerics.fitting", "model.surgery", "repair.pipeline"]
    for module in closure(graph(), [f"ghostlayers.{c}" for c in core]):
        tree = ast.parse(modules()[module].read_text())
        names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
        names += [f"{n.module}.{a.name}" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom) for a in n.names]
        names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
        assert not [n for n in names if n.startswith("ghostlayers.sources")], f"{module} imports ghostlayers.sources"


def test_light_modules_import_nothing_heavy_at_module_level():
    """The command line's module-level imports, and everything they import, load no torch (its commands import
    the heavy modules inside functions): the settings and recipes stay light so that its help is instant."""
    for module in closure(graph(top_only=True), list(LIGHT)):
        tree = ast.parse(modules()[module].read_text())
        names = [n.module or "" for n in tree.body if isinstance(n, ast.ImportFrom)]
        names += [a.name for n in tree.body if isinstance(n, ast.Import) for a in n.names]
        heavy = [n for n in names if n.split(".")[0] in HEAVY]
        assert not heavy, f"{module} (imported by the command line) imports {heavy} at module level"
