"""No import circles inside `medha/`, between modules or between its packages (`medha.core`,
`medha.perf`, ...), and no import of the simulator by the router.

The graph is read from the source with `ast`, not from a running interpreter, so it counts
every import statement wherever it stands: at module level, inside a function (a lazy import
still ties the two modules together) and under `if TYPE_CHECKING:` (a type-only back-reference
is still a layer that knows the one above it). Imports by string (`importlib.import_module`,
the registries' discovery of their variants) are not seen.

Run it as a script to print the graph's cycles, of modules and of packages:
`python tests/test_imports.py [ROOT]`.
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


def write_tree(root: Path, files: dict[str, str]) -> Path:
    """`root` with `files` (path under it -> text) written, for the checks' own fixtures."""
    for name, text in files.items():
        path = root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    return root


def test_the_check_finds_a_cycle(tmp_path):
    # It must be able to fail: a function-level import and a type-only one close circles too.
    pkg = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "sub/__init__.py": "from pkg.sub.b import B\n",
            "a.py": "def f():\n    from pkg.sub import b\n",
            "sub/b.py": "from typing import TYPE_CHECKING\nB = 1\n"
            "if TYPE_CHECKING:\n    from ..a import f\n",
            "c.py": "import pkg.a\n",
        },
    )
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


def test_nothing_in_medha_imports_the_test_fixtures():
    """medha/testing is the test suite's: no other package of medha/ imports it (what bench/
    shares with the tests lives in medha/benchmark)."""
    graph = {m: t for m, t in import_graph().items() if not _under(m, "medha.testing")}
    assert imports_between(graph, "medha", "medha.testing") == []


def test_the_layer_check_finds_an_import(tmp_path):
    # It must be able to fail: a function-level import and `from pkg import sim` count too.
    pkg = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            **{f"{sub}/__init__.py": "" for sub in ("route", "sim", "simple")},
            "sim/config.py": "X = 1\n",
            "simple/x.py": "Y = 1\n",
            "route/a.py": "def f():\n    from pkg.sim.config import X\n",
            "route/b.py": "from pkg import sim\nfrom pkg.simple import x\n",
        },
    )
    assert imports_between(import_graph(pkg), "pkg.route", "pkg.sim") == [
        "pkg.route.a -> pkg.sim.config",
        "pkg.route.b -> pkg.sim",
    ]


def package_of(module: str) -> str:
    """The package `module` belongs to, one level under the root: `medha.core.config` ->
    `medha.core`; a module directly under the root (`medha.demo`) is its own, the root's
    `__init__` is `medha`."""
    return ".".join(module.split(".")[:2])


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Package -> the other packages its modules import (the module graph, coarsened)."""
    packages: dict[str, set[str]] = {}
    for module, targets in graph.items():
        source = package_of(module)
        packages.setdefault(source, set()).update(
            package_of(t) for t in targets if package_of(t) != source
        )
    return packages


def test_medha_has_no_package_cycles():
    """The packages of medha/ form layers: no two of them import each other, module by module
    (perf/ prices a core/ Batch, so core/ imports nothing of perf/, not even in a function)."""
    assert cycles(package_graph(import_graph())) == []


def test_the_package_check_finds_a_cycle(tmp_path):
    # It must be able to fail: two sibling packages whose modules import each other only
    # inside functions, and through different modules, so no module lies on a circle.
    pkg = write_tree(
        tmp_path / "pkg",
        {
            "__init__.py": "",
            "core/__init__.py": "",
            "core/batch.py": "B = 1\n",
            "core/config.py": "def f():\n    from pkg.perf.price import P\n",
            "perf/__init__.py": "",
            "perf/price.py": "P = 1\n",
            "perf/predictor.py": "def g():\n    from pkg.core import batch\n",
        },
    )
    graph = import_graph(pkg)
    assert report(pkg) == []  # no module cycle
    assert package_graph(graph) == {
        "pkg": set(),
        "pkg.core": {"pkg.perf"},
        "pkg.perf": {"pkg.core"},
    }
    assert cycles(package_graph(graph)) == [["pkg.core", "pkg.perf"]]


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


if __name__ == "__main__":
    root = Path(sys.argv[1]) if len(sys.argv) > 1 else ROOT
    lines = report(root)
    lines += [f"packages: {' <-> '.join(c)}" for c in cycles(package_graph(import_graph(root)))]
    print("\n".join(lines) or "no import cycles")
    sys.exit(1 if lines else 0)
