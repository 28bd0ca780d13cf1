"""The benchmarks' import graph, drawn by import name as ``test_layers`` draws the product's (every
``import`` in a module's source): what more than one benchmark uses lives in the harness
(``benchmarks.harness``), and each benchmark is a script over it. A benchmark (``benchmarks/NAME.py``,
or the package ``benchmarks/retrieval/``) imports the harness, the product and its own package, never
another benchmark; the harness imports no benchmark; a test takes a name from the module that
defines it, not from a benchmark that imported it."""

from __future__ import annotations

import ast
import functools

from tests.conftest import ROOT
from tests.test_layers import cycles, imported

HARNESS = "benchmarks.harness"


def name_of(path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@functools.cache
def modules() -> dict[str, ast.Module]:
    """Every module under benchmarks/ but the results' own scripts, by import name."""
    found = {}
    for path in sorted((ROOT / "benchmarks").rglob("*.py")):
        if "results" not in path.relative_to(ROOT / "benchmarks").parts:
            found[name_of(path)] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def import_graph() -> dict[str, set[str]]:
    trees = modules()
    return {name: imported(tree, trees) - {name} for name, tree in trees.items()}


def benchmark(module: str) -> str | None:
    """The benchmark ``module`` belongs to (``benchmarks.NAME``, or ``benchmarks.retrieval`` for the
    modules of that package); None for the harness and the package ``benchmarks`` itself."""
    parts = module.split(".")
    if module == "benchmarks" or module.startswith(HARNESS):
        return None
    return ".".join(parts[:2])


def test_every_top_level_module_of_benchmarks_is_a_benchmark_with_a_main():
    """What is not a benchmark lives in the harness: every ``benchmarks/NAME.py`` is run as
    ``python -m benchmarks.NAME``."""
    trees = modules()
    scripts = [name for name in trees if name.count(".") == 1 and benchmark(name) and name != "benchmarks.retrieval"]
    assert scripts
    without = [
        name
        for name in scripts
        if not any(isinstance(node, ast.FunctionDef) and node.name == "main" for node in trees[name].body)
    ]
    assert without == []


def test_no_benchmark_imports_another_and_the_harness_imports_none():
    graph = import_graph()
    assert any(target.startswith(HARNESS) for targets in graph.values() for target in targets)
    crossing = sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if benchmark(target) is not None and benchmark(target) != benchmark(module)
    )
    assert crossing == []


def test_the_harness_has_no_circles():
    graph = import_graph()
    harness = {module: targets for module, targets in graph.items() if module.startswith(HARNESS)}
    assert len(harness) > 1 and cycles(harness) == []


def test_tests_take_a_benchmark_name_from_the_module_that_defines_it():
    """A test may import the benchmark it tests; what the benchmark only imported (from the harness
    or the product) it takes where it is defined."""
    trees = modules()

    def defines(module: str) -> set[str]:
        names = set()
        for node in trees[module].body:
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                names.add(node.name)
            elif isinstance(node, ast.Assign):
                names.update(target.id for target in node.targets if isinstance(target, ast.Name))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
        return names

    borrowed = []
    for path in sorted((ROOT / "tests").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.ImportFrom) and node.module in trees and node.level == 0:
                names = defines(node.module)
                borrowed += [
                    (path.name, f"{node.module}.{alias.name}")
                    for alias in node.names
                    if alias.name not in names and f"{node.module}.{alias.name}" not in trees
                ]
    assert borrowed == []
