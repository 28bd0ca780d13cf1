"""The import graph between the product's modules, drawn by import name (every ``import`` in a
module's source: at the top, in a function, under ``TYPE_CHECKING``): its arrows point one way.
The layers, lowest first: ``common`` and ``proto``; ``datastore``; ``build_index`` and
``drafter.core``; the engines ``drafter.hf``, ``drafter.vllm`` and ``drafter.llamacpp``, none of
which imports another; the modules of ``drafter`` itself (``outputs_corpus``); the commands,
``drafter.cli``; a ``__main__`` above all. A module imports its own layer or those below it."""

from __future__ import annotations

import ast
import functools
from collections.abc import Container

from tests.conftest import ROOT

FOLDERS = ("common", "proto", "datastore", "build_index", "drafter")
RANKS = {
    "common": 0,
    "proto": 0,
    "datastore": 1,
    "build_index": 2,
    "drafter.core": 2,
    "drafter.hf": 3,
    "drafter.vllm": 3,
    "drafter.llamacpp": 3,
    "drafter": 4,
    "drafter.cli": 5,
}


def modules() -> dict[str, ast.Module]:
    found = {}
    for folder in FOLDERS:
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if "v1" in parts:  # generated gRPC code
                continue
            name = ".".join(["rest_spec", *(parts[:-1] if parts[-1] == "__init__" else parts)])
            found[name] = ast.parse(path.read_text(encoding="utf-8"))
    return found


def imported(tree: ast.Module, known: Container[str]) -> set[str]:
    """The modules of ``known`` that ``tree`` imports (``from package import submodule`` names the submodule)."""
    targets = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                targets.add(submodule if submodule in known else node.module)
        elif isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
    return {target for target in targets if target in known}


@functools.cache
def import_graph() -> dict[str, set[str]]:
    """Each module -> the product's modules it imports."""
    trees = modules()
    return {name: imported(tree, trees) - {name} for name, tree in trees.items()}


def layer(module: str) -> str:
    parts = module.split(".")[1:]
    if parts[0] == "drafter" and len(parts) > 1 and f"drafter.{parts[1]}" in RANKS:
        return f"drafter.{parts[1]}"
    return parts[0]


def rank(module: str) -> int:
    return 99 if module.endswith(".__main__") else RANKS[layer(module)]


def cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The graph's strongly connected components of more than one module (Tarjan's)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def visit(module: str) -> None:
        index[module] = low[module] = len(index)
        stack.append(module)
        for target in sorted(graph[module]):
            if target not in index:
                visit(target)
                low[module] = min(low[module], low[target])
            elif target in stack:
                low[module] = min(low[module], index[target])
        if low[module] == index[module]:
            component = set()
            while not component or module not in component:
                component.add(stack.pop())
            if len(component) > 1:
                found.append(component)

    for module in sorted(graph):
        if module not in index:
            visit(module)
    return found


def test_every_module_has_a_layer():
    assert all(rank(module) >= 0 for module in import_graph())


def test_no_module_imports_a_layer_above_its_own_nor_another_engine():
    graph = import_graph()
    back = sorted(
        (module, target)
        for module, targets in graph.items()
        for target in targets
        if layer(module) != layer(target) and rank(target) >= rank(module)
    )
    assert back == []


def test_no_circles():
    """No module reaches itself through its imports: a registry or a front end (``build_index.corpora``,
    ``build_index.build``) and the modules that implement it (``build_index.pypi``,
    ``build_index.ray_build``) share the types of a module below both (``build_index.corpus``,
    ``build_index.job``)."""
    assert cycles(import_graph()) == []
