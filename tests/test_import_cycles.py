"""No import circles among the service's modules or the agent's (imports made only for
type checking count: a circle of them is a circle of the design all the same)."""

from __future__ import annotations

import grimp
import pytest

PACKAGES = ("service.services", "worker.agent")


def _circles(graph: grimp.ImportGraph, package: str) -> list[list[str]]:
    """The strongly connected groups of more than one module below ``package`` (Tarjan)."""
    modules = sorted(m for m in graph.modules if m.startswith(package + "."))
    inside = set(modules)
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(start: str) -> None:
        # Iterative, so a deep import chain cannot exhaust the recursion limit.
        work = [(start, iter(sorted(graph.find_modules_directly_imported_by(start) & inside)))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for target in edges:
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append(
                        (target, iter(sorted(graph.find_modules_directly_imported_by(target) & inside)))
                    )
                    break
                if target in on_stack:
                    low[node] = min(low[node], index[target])
            else:
                work.pop()
                if work:
                    parent = work[-1][0]
                    low[parent] = min(low[parent], low[node])
                if low[node] == index[node]:
                    group = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        group.append(member)
                        if member == node:
                            break
                    if len(group) > 1:
                        found.append(sorted(group))

    for module in modules:
        if module not in index:
            visit(module)
    return found


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
