"""The imports between megatron_dapo's top-level packages and modules form no cycle.

Every import counts, function-local ones too (they still tie the two packages together). A cycle
means two layers each need the other: the rule, the error type or the constant both use belongs one
layer down (errors.py, compat/, distributed/, model/). Before issue 25, seven packages formed one
knot (actor, config, data, doctor, model, plan, rollout)."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "megatron_dapo"


def package_imports(root: Path = PACKAGE) -> dict[tuple[str, str], list[str]]:
    """(importing top-level name, imported top-level name) -> the files that import so."""
    edges: dict[tuple[str, str], list[str]] = {}
    for path in sorted(root.rglob("*.py")):
        source = path.relative_to(root).parts[0].removesuffix(".py")
        if source == "__init__":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module] if node.module != "megatron_dapo" else [f"megatron_dapo.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for name in names:
                parts = name.split(".")
                if parts[0] == "megatron_dapo" and len(parts) > 1 and parts[1] != source:
                    edges.setdefault((source, parts[1]), []).append(str(path.relative_to(root.parent)))
    return edges


def cycles(edges) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
    graph: dict[str, set[str]] = {}
    for a, b in edges:
        graph.setdefault(a, set()).add(b)
        graph.setdefault(b, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                other = stack.pop()
                component.append(other)
                if other == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_package_layers_have_no_import_cycle():
    edges = package_imports()
    assert ("trainer", "actor") in edges and ("rollout", "model") in edges  # the scan sees imports
    knots = cycles(edges)
    detail = [f"{a} -> {b}: {sorted(set(files))[:3]}" for knot in knots for (a, b), files in sorted(edges.items())
              if a in knot and b in knot]  # fmt: skip
    assert not knots, f"import cycles between top-level packages {knots}:\n" + "\n".join(detail)


def test_the_cycle_finder_finds_a_knot():
    assert cycles({("a", "b"): [], ("b", "c"): [], ("c", "a"): [], ("c", "d"): []}) == [["a", "b", "c"]]
    assert cycles({("a", "b"): [], ("b", "c"): []}) == []
