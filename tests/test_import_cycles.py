"""No import circles among the modules of the service (``service/services`` among them),
the worker (``worker/agent``) or the torchyard package (the contract, the client and the
CLI). Imports made only for type checking, or inside functions, count: a circle of them is
a circle of the design all the same."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("service", "worker", "torchyard")


def _reachable(graph: grimp.ImportGraph, start: str, inside: set[str]) -> set[str]:
    seen: set[str] = set()
    todo = [start]
    while todo:
        for target in graph.find_modules_directly_imported_by(todo.pop()) & inside:
            if target not in seen:
                seen.add(target)
                todo.append(target)
    return seen


def _circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The groups of two or more modules below ``package`` that import each other, directly
    or through others."""
    inside = {m for m in graph.modules if m.startswith(package + ".")}
    reach = {m: _reachable(graph, m, inside) for m in inside}
    groups = {tuple(sorted({m} | {o for o in reach[m] if m in reach[o]})) for m in inside if m in reach[m]}
    return sorted(list(g) for g in groups)


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("service", "worker", "torchyard", cache_dir=None)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(graph: grimp.ImportGraph, package: str) -> None:
    assert _circles(graph, package) == []


def test_a_circle_is_found() -> None:
    """The check itself: a graph with a circle of two modules fails it."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _circles(graph, "pkg") == [["pkg.a", "pkg.b"]]
