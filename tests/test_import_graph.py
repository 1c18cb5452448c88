"""The diagnoser package's import graph has no circles.

Built statically from the source: every `import` and `from ... import` of a diagnoser module counts, wherever it sits
in the file (module level, inside a function, under `if TYPE_CHECKING:`). A function-level import that only dodges a
circle at run time is still a circle in the design, so it counts too.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

PACKAGE_ROOT = Path(__file__).resolve().parents[1] / "diagnoser"

# Circles known and kept for now, each an exact set of modules with the reason it is not broken yet. An entry must
# still be a circle: once it is broken, the test says to remove it. (traces.analysis <-> traces.ranks was broken by
# moving TraceAnalysis to traces/result.py.)
ALLOWED: dict[frozenset[str], str] = {}


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Module name -> (file, whether it is a package's __init__), for every .py file under root, and every compiled
    module by its stub (.pyi: traces/_scan)."""
    found: dict[str, tuple[Path, bool]] = {}
    sources = sorted(root.rglob("*.py"))
    stubs = [p for p in sorted(root.rglob("*.pyi")) if not p.with_suffix(".py").exists()]
    for path in sources + stubs:
        parts = [package, *path.relative_to(root).with_suffix("").parts]
        is_package = parts[-1] == "__init__"
        if is_package:
            parts = parts[:-1]
        found[".".join(parts)] = (path, is_package)
    return found


def _targets(node: ast.Import | ast.ImportFrom, module: str, is_package: bool, known: set[str]) -> Iterator[str]:
    """The dotted names an import statement loads: for `from X import y`, X.y when that is a module, else X."""
    if isinstance(node, ast.Import):
        yield from (alias.name for alias in node.names)
        return
    base = node.module or ""
    if node.level:  # relative: resolved against this module's package
        package = (module if is_package else module.rpartition(".")[0]).split(".")
        anchor = package[: len(package) - (node.level - 1)]
        base = ".".join([*anchor, base] if base else anchor)
    for alias in node.names:
        sub = f"{base}.{alias.name}"
        yield sub if sub in known else base


def import_graph(root: Path = PACKAGE_ROOT, package: str = "diagnoser") -> dict[str, set[str]]:
    """Module -> the package's modules it imports anywhere in its source."""
    known = modules(root, package)
    names = set(known)

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in known}
    for module, (path, is_package) in known.items():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for name in _targets(node, module, is_package, names):
                target = resolve(name) if name == package or name.startswith(package + ".") else None
                if target is not None and target != module:
                    graph[module].add(target)
    return graph


def circles(graph: dict[str, set[str]]) -> list[frozenset[str]]:
    """The strongly connected components of two modules or more (Tarjan's algorithm, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[frozenset[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work: list[tuple[str, Iterator[str]]] = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, successors = work[-1]
            for nxt in successors:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = set()
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.add(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        found.append(frozenset(component))
    return found


def one_cycle(graph: dict[str, set[str]], component: frozenset[str]) -> list[str]:
    """A path around the circle, from its first module back to it, to name in a failure."""
    start = min(component)
    paths: dict[str, list[str]] = {start: [start]}
    queue = [start]
    while queue:  # breadth first inside the component: the shortest way back to start
        node = queue.pop(0)
        for nxt in sorted(graph[node] & component):
            if nxt == start:
                return [*paths[node], start]
            if nxt not in paths:
                paths[nxt] = [*paths[node], nxt]
                queue.append(nxt)
    raise AssertionError(f"{sorted(component)} is not a circle")


def _describe(graph: dict[str, set[str]], component: frozenset[str]) -> str:
    return " -> ".join(one_cycle(graph, component)) + f" (all {len(component)}: {', '.join(sorted(component))})"


def test_the_package_has_no_import_circles() -> None:
    graph = import_graph()
    found = circles(graph)
    new = [c for c in found if c not in ALLOWED]
    assert not new, "import circles: " + "; ".join(_describe(graph, c) for c in new)
    stale = [sorted(c) for c in ALLOWED if c not in found]
    assert not stale, f"no longer circles, remove them from ALLOWED: {stale}"


def test_the_graph_sees_imports_at_every_level() -> None:
    graph = import_graph()
    assert "diagnoser.characterise" in graph["diagnoser.evidence_build"]  # module level
    assert "diagnoser.reports.redact" in graph["diagnoser.fleet.run"]  # inside a function
    assert "diagnoser.capture" in graph["diagnoser.characterise"]  # under TYPE_CHECKING
    assert "diagnoser.collectors.dcgm_exporter" in graph["diagnoser.collectors.dcgm_collect"]
    assert "diagnoser.fleet.model" in graph["diagnoser.reports.model"]  # `from package.module import name`


def test_a_circle_through_a_function_level_import_is_found(tmp_path: Path) -> None:
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n")
    (pkg / "c.py").write_text("def f() -> None:\n    from pkg.a import f  # dodges the circle at run time\n")
    (pkg / "d.py").write_text("from . import a\nimport pkg.c\n")  # imports into the circle, not part of it
    graph = import_graph(pkg, "pkg")
    assert graph["pkg.d"] == {"pkg.a", "pkg.c"}
    [component] = circles(graph)
    assert component == {"pkg.a", "pkg.sub.b", "pkg.c"}
    assert one_cycle(graph, component) == ["pkg.a", "pkg.sub.b", "pkg.c", "pkg.a"]
