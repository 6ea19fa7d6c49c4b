"""No import circles inside `medha/`, and no import of the simulator by the router.

The graph is read from the source with `ast`, not from a running interpreter, so it counts
every import statement wherever it stands: at module level, inside a function (a lazy import
still ties the two modules together) and under `if TYPE_CHECKING:` (a type-only back-reference
is still a layer that knows the one above it). Imports by string (`importlib.import_module`,
the registries' discovery of their variants) are not seen.

Run it as a script to print the graph's cycles: `python tests/test_imports.py [ROOT]`.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent / "medha"


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file under the package directory `root`."""
    modules = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        modules[".".join(parts)] = path
    return modules


def _imported(node: ast.AST, module: str, is_package: bool, known: set[str]) -> list[str]:
    """The modules of `known` that one import statement in `module` loads."""
    if isinstance(node, ast.Import):
        return [alias.name for alias in node.names if alias.name in known]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:  # relative: from the package that holds `module`
        package = module.split(".")
        package = package[: len(package) - node.level + is_package]
        base = ".".join(package + ([base] if base else []))
    # `from a.b import c` loads a.b.c when c is a module, else it takes a name from a.b
    found = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known]
    if base in known and len(found) < len(node.names):
        found.append(base)
    return found


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """Module -> the modules of the same tree it imports anywhere in its source."""
    files = module_files(root)
    known = set(files)
    graph: dict[str, set[str]] = {}
    for module, path in files.items():
        tree = ast.parse(path.read_text(), str(path))
        is_package = path.name == "__init__.py"
        graph[module] = {
            target
            for node in ast.walk(tree)
            for target in _imported(node, module, is_package, known)
            if target != module
        }
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:  # recursion depth is bounded by the number of modules
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(found)


def shortest_cycle(graph: dict[str, set[str]], members: set[str], start: str) -> list[str]:
    """The shortest closed path from `start` through modules of `members` (breadth first)."""
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & members):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{start} lies on no cycle of {sorted(members)}")


def report(root: Path = ROOT) -> list[str]:
    """One line per cycle: the shortest through each module of each circle, without repeats."""
    graph = import_graph(root)
    lines: list[str] = []
    for component in cycles(graph):
        seen: set[tuple[str, ...]] = set()
        for m in component:
            path = shortest_cycle(graph, set(component), m)[:-1]
            first = path.index(min(path))
            canonical = tuple(path[first:] + path[:first])
            if canonical not in seen:
                seen.add(canonical)
                lines.append(" -> ".join(canonical + canonical[:1]))
    return lines


def test_medha_has_no_import_cycles():
    assert report() == []


def test_the_check_finds_a_cycle(tmp_path):
    # It must be able to fail: a function-level import and a type-only one close circles too.
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pkg.sub.b import B\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.sub import b\n")
    (pkg / "sub" / "b.py").write_text(
        "from typing import TYPE_CHECKING\nB = 1\nif TYPE_CHECKING:\n    from ..a import f\n"
    )
    (pkg / "c.py").write_text("import pkg.a\n")
    assert report(pkg) == ["pkg.a -> pkg.sub.b -> pkg.a"]


def _under(module: str, package: str) -> bool:
    return module == package or module.startswith(package + ".")


def imports_between(graph: dict[str, set[str]], source: str, target: str) -> list[str]:
    """`importer -> imported` for every import of a module of package `target` by one of
    package `source` (dotted names), sorted."""
    return sorted(
        f"{m} -> {t}"
        for m, targets in graph.items()
        if _under(m, source)
        for t in targets
        if _under(t, target)
    )


def test_the_router_imports_nothing_of_the_simulator():
    """The router and the simulator share the dispatchers through medha/dispatch: no module of
    medha/route imports one of medha/sim, not even inside a function or for type checking."""
    assert imports_between(import_graph(), "medha.route", "medha.sim") == []


def test_the_layer_check_finds_an_import(tmp_path):
    # It must be able to fail: a function-level import and `from pkg import sim` count too.
    pkg = tmp_path / "pkg"
    for sub in ("route", "sim", "simple"):
        (pkg / sub).mkdir(parents=True)
        (pkg / sub / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "sim" / "config.py").write_text("X = 1\n")
    (pkg / "simple" / "x.py").write_text("Y = 1\n")
    (pkg / "route" / "a.py").write_text("def f():\n    from pkg.sim.config import X\n")
    (pkg / "route" / "b.py").write_text("from pkg import sim\nfrom pkg.simple import x\n")
    assert imports_between(import_graph(pkg), "pkg.route", "pkg.sim") == [
        "pkg.route.a -> pkg.sim.config",
        "pkg.route.b -> pkg.sim",
    ]


if __name__ == "__main__":
    lines = report(Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT)
    print("\n".join(lines) or "no import cycles")
    sys.exit(1 if lines else 0)


def test_only_the_vllm_executor_imports_vllm():
    """vLLM is an optional dependency of one subpackage and of the engine's optional kernels
    (imported inside a function, where they are asked for): nothing else may import it."""
    offenders = []
    for module, path in module_files(ROOT).items():
        if module == "medha.vllm_executor" or module.startswith("medha.vllm_executor."):
            continue
        if module == "medha.engine.layers.vllm_kernels":
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            offenders += [f"{module}: {n}" for n in names if n.split(".")[0] == "vllm"]
    assert offenders == []
