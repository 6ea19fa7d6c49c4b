"""The house's size limits, so that a module, a class or a bench does not grow back into a room
nobody can walk (medha/route/app.py was 1,395 lines, llm_engine.py 667, bench/ 62 flat scripts):
no module of medha/ over 600 lines, no class over 450, no function over 80, the engine's module
at most 450; bench/ with its scripts in subject folders, none over 400 lines, and the flags every
bench shares defined in the harness alone. Read from the source, so it is core (no torch)."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODULE_LINES, CLASS_LINES, FUNCTION_LINES, BENCH_LINES = 600, 450, 80, 400


def _lines(path: Path) -> int:
    return path.read_text().count("\n")


def _oversized(paths, limit_module: int) -> list[str]:
    over = []
    for p in paths:
        rel = p.relative_to(ROOT).as_posix()
        if _lines(p) > limit_module:
            over.append(f"{rel}: {_lines(p)} lines")
        for node in ast.walk(ast.parse(p.read_text())):
            span = getattr(node, "end_lineno", 0) - getattr(node, "lineno", 0) + 1
            if isinstance(node, ast.ClassDef) and span > CLASS_LINES:
                over.append(f"{rel}: class {node.name} {span} lines")
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef) and span > FUNCTION_LINES:
                over.append(f"{rel}: {node.name}() {span} lines")
    return over


def test_no_module_class_or_function_of_medha_past_its_limit():
    assert _oversized(sorted((ROOT / "medha").rglob("*.py")), MODULE_LINES) == []
    assert _lines(ROOT / "medha" / "engine" / "llm_engine.py") <= 450


def test_bench_is_suites_in_folders_none_past_its_limit():
    top = sorted(p.name for p in (ROOT / "bench").iterdir() if p.suffix in (".py", ".sh"))
    assert len(top) <= 3, top
    assert (ROOT / "bench" / "README.md").exists()
    scripts = sorted((ROOT / "bench").rglob("*.py"))
    assert [f"{p}: {_lines(p)}" for p in scripts if _lines(p) > BENCH_LINES] == []


def test_the_shared_flags_are_defined_in_the_harness_alone():
    # a flag passed on to a subprocess's command line is fine; a flag a bench parses is not
    defined = re.compile(r"add_argument\(\s*\"--(seed|out|num-requests)\"")
    found = [
        p.relative_to(ROOT).as_posix()
        for p in [*(ROOT / "bench").rglob("*.py"), *(ROOT / "medha" / "benchmark").rglob("*.py")]
        if defined.search(p.read_text())
    ]
    assert found == ["medha/benchmark/harness.py"]
