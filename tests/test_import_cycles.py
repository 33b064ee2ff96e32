"""No import circles among the modules of the service (``service/services`` among them),
the worker (``worker/agent``) or the torchyard package (the contract, the client and the
CLI), nor among their packages. Imports made only for type checking, or inside functions,
count: a circle of them is a circle of the design all the same.

A package is a module's two-level prefix (``service.services``, ``service.engines``,
``worker.agent``, ``torchyard.contract``...; a subpackage such as ``service.services.kinds``
counts as its package). Two packages are in a circle when a module of one imports a module
of the other and, through any modules and packages, the other comes back: the packages of
every root form one graph, so a circle through ``service`` and ``torchyard`` is found too.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable

import grimp
import pytest

PACKAGES = ("service", "worker", "torchyard")

# Package circles known today and being removed: each entry lets exactly that set of
# packages import each other, nothing more (a circle that grows to a third package fails).
# Delete an entry once its circle is gone (test_known_package_circles_still_exist says when).
KNOWN_PACKAGE_CIRCLES_TO_REMOVE: list[frozenset[str]] = []


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


# --- packages ------------------------------------------------------------------------------------


def package_of(module: str) -> str:
    """The package a module counts in: its first two name parts (``service.services.kinds.base``
    is in ``service.services``; ``service.config`` is a package of its own)."""
    return ".".join(module.split(".")[:2])


def _own_modules(graph: grimp.ImportGraph, roots: Iterable[str]) -> list[str]:
    roots = tuple(roots)
    return sorted(m for m in graph.modules if m.split(".")[0] in roots)


def package_imports(
    graph: grimp.ImportGraph, roots: Iterable[str]
) -> dict[tuple[str, str], list[tuple[str, str]]]:
    """``(importing package, imported package)`` → the direct module imports that make it,
    sorted; imports within one package and of modules outside ``roots`` are left out."""
    modules = _own_modules(graph, roots)
    own = set(modules)
    found: dict[tuple[str, str], list[tuple[str, str]]] = {}
    for importer in modules:
        for imported in sorted(graph.find_modules_directly_imported_by(importer) & own):
            pair = (package_of(importer), package_of(imported))
            if pair[0] != pair[1]:
                found.setdefault(pair, []).append((importer, imported))
    return found


def package_circles(graph: grimp.ImportGraph, roots: Iterable[str]) -> list[list[str]]:
    """The groups of two or more packages that import each other, directly or through other
    packages (the strongly connected parts of the package graph), each sorted."""
    edges = package_imports(graph, roots)
    after: dict[str, set[str]] = {}
    for a, b in edges:
        after.setdefault(a, set()).add(b)
    reach: dict[str, set[str]] = {}
    for start in after:
        seen: set[str] = set()
        todo = [start]
        while todo:
            for nxt in after.get(todo.pop(), ()):
                if nxt not in seen:
                    seen.add(nxt)
                    todo.append(nxt)
        reach[start] = seen
    groups = {
        tuple(sorted({p} | {o for o in reach[p] if p in reach.get(o, set())})) for p in reach if p in reach[p]
    }
    return sorted(list(g) for g in groups)


def _way_back(graph: grimp.ImportGraph, home: str, members: set[str]) -> list[str] | None:
    """The shortest chain of module imports from a module of package ``home`` through the
    other packages of ``members`` back to a module of ``home``; the first in name order."""
    todo = deque(
        [m, t]
        for m in sorted(m for m in graph.modules if package_of(m) == home)
        for t in sorted(graph.find_modules_directly_imported_by(m))
        if package_of(t) in members - {home}
    )
    seen = {path[-1] for path in todo}
    while todo:
        path = todo.popleft()
        for t in sorted(graph.find_modules_directly_imported_by(path[-1])):
            if package_of(t) == home:
                return [*path, t]
            if package_of(t) in members and t not in seen:
                seen.add(t)
                todo.append([*path, t])
    return None


def round_trip(graph: grimp.ImportGraph, circle: list[str]) -> list[str] | None:
    """The shortest chain of module imports that leaves a package of ``circle`` and comes back
    to it through the circle's other packages (None when the packages import each other only
    through modules that do not reach one another: the circle is one of packages only)."""
    chains = [c for c in (_way_back(graph, home, set(circle)) for home in circle) if c is not None]
    return min(chains, key=len) if chains else None


def describe_circle(graph: grimp.ImportGraph, circle: list[str], roots: Iterable[str]) -> str:
    """What makes a circle of packages: a chain of imports around it, and every package edge
    inside it with the module imports that make it."""
    lines = [" ⇄ ".join(circle)]
    chain = round_trip(graph, circle)
    if chain is not None:
        lines.append("  a chain: " + " → ".join(chain))
    members = set(circle)
    for (a, b), imports in sorted(package_imports(graph, roots).items()):
        if a in members and b in members:
            shown = ", ".join(f"{m} → {t}" for m, t in imports[:5])
            more = f" and {len(imports) - 5} more" if len(imports) > 5 else ""
            lines.append(f"  {a} → {b}: {shown}{more}")
    return "\n".join(lines)


def unexpected_circles(circles: list[list[str]], allowed: list[frozenset[str]]) -> list[list[str]]:
    """The circles that no allowance names exactly."""
    return [c for c in circles if frozenset(c) not in allowed]


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph("service", "worker", "torchyard", cache_dir=None)


@pytest.mark.parametrize("package", PACKAGES)
def test_no_import_circles(graph: grimp.ImportGraph, package: str) -> None:
    assert _circles(graph, package) == []


def test_no_package_circles(graph: grimp.ImportGraph) -> None:
    found = unexpected_circles(package_circles(graph, PACKAGES), KNOWN_PACKAGE_CIRCLES_TO_REMOVE)
    report = "\n".join(describe_circle(graph, circle, PACKAGES) for circle in found)
    assert not found, f"packages that import each other:\n{report}"


def test_known_package_circles_still_exist(graph: grimp.ImportGraph) -> None:
    """An allowance outlives its circle only by mistake: delete it once the circle is gone."""
    circles = {frozenset(c) for c in package_circles(graph, PACKAGES)}
    gone = [sorted(known) for known in KNOWN_PACKAGE_CIRCLES_TO_REMOVE if known not in circles]
    assert not gone, (
        f"delete these entries of KNOWN_PACKAGE_CIRCLES_TO_REMOVE, their circles are gone: {gone}"
    )


# --- the checks themselves ---------------------------------------------------------------------------


def _graph(*imports: str) -> grimp.ImportGraph:
    """A graph of ``"importer > imported"`` pairs (and their parent packages)."""
    graph = grimp.ImportGraph()
    pairs = [tuple(i.split(" > ")) for i in imports]
    for module in sorted({m for pair in pairs for m in pair}):
        parts = module.split(".")
        for n in range(1, len(parts) + 1):
            graph.add_module(".".join(parts[:n]))
    for importer, imported in pairs:
        graph.add_import(importer=importer, imported=imported)
    return graph


def test_a_circle_is_found() -> None:
    """The check itself: a graph with a circle of two modules fails it."""
    graph = grimp.ImportGraph()
    for name in ("pkg", "pkg.a", "pkg.b", "pkg.c"):
        graph.add_module(name)
    graph.add_import(importer="pkg.a", imported="pkg.b")
    graph.add_import(importer="pkg.b", imported="pkg.a")
    graph.add_import(importer="pkg.c", imported="pkg.a")
    assert _circles(graph, "pkg") == [["pkg.a", "pkg.b"]]


def test_package_of_is_the_two_level_prefix() -> None:
    assert package_of("service.services.kinds.base") == "service.services"
    assert package_of("service.engines") == "service.engines"
    assert package_of("service.config") == "service.config"
    assert package_of("service") == "service"


def test_a_package_circle_is_found_with_its_chain() -> None:
    """No module circle, but ``app.a`` and ``app.b`` import each other (through a subpackage
    of ``app.b``); the allowance of another pair does not hide it, and the report names the
    chain and the imports."""
    graph = _graph(
        "app.a.x > app.b.y",
        "app.b.y > app.b.sub.z",
        "app.b.sub.z > app.a.w",
        "app.b.q > app.b.y",
        "app.c > app.a.x",
    )
    assert _circles(graph, "app") == []
    circles = package_circles(graph, ["app"])
    assert circles == [["app.a", "app.b"]]
    assert unexpected_circles(circles, [frozenset({"app.a", "app.c"})]) == [["app.a", "app.b"]]
    assert unexpected_circles(circles, [frozenset({"app.a", "app.b"})]) == []
    assert round_trip(graph, ["app.a", "app.b"]) == ["app.a.x", "app.b.y", "app.b.sub.z", "app.a.w"]
    assert describe_circle(graph, ["app.a", "app.b"], ["app"]).splitlines() == [
        "app.a ⇄ app.b",
        "  a chain: app.a.x → app.b.y → app.b.sub.z → app.a.w",
        "  app.a → app.b: app.a.x → app.b.y",
        "  app.b → app.a: app.b.sub.z → app.a.w",
    ]


def test_a_circle_through_three_packages_is_one_group_an_allowed_pair_does_not_cover() -> None:
    graph = _graph("app.a.m > app.b.m", "app.b.m > app.c.m", "app.c.m > app.a.n", "app.d > app.a.m")
    circles = package_circles(graph, ["app"])
    assert circles == [["app.a", "app.b", "app.c"]]
    assert unexpected_circles(circles, [frozenset({"app.a", "app.b"})]) == circles
    assert round_trip(graph, circles[0]) == ["app.a.m", "app.b.m", "app.c.m", "app.a.n"]


def test_imports_within_a_package_or_one_way_make_no_package_circle() -> None:
    graph = _graph(
        "app.a.x > app.a.sub.y",
        "app.a.sub.y > app.a.x",  # a module circle inside one package: the module check's
        "app.a.x > app.b.y",
        "app.b.y > other.z",
        "other.z > app.a.x",  # through a module outside the roots: not counted
    )
    assert package_circles(graph, ["app"]) == []
    assert _circles(graph, "app") == [["app.a.sub.y", "app.a.x"]]


def test_a_circle_of_packages_whose_modules_never_meet_has_no_chain() -> None:
    graph = _graph("app.a.x > app.b.y", "app.b.z > app.a.w")
    assert package_circles(graph, ["app"]) == [["app.a", "app.b"]]
    assert round_trip(graph, ["app.a", "app.b"]) is None
    assert "a chain" not in describe_circle(graph, ["app.a", "app.b"], ["app"])
