"""The core tier needs no torch: run with `import torch` failing, it collects and passes.

torch is made unimportable by a `sitecustomize` on PYTHONPATH that puts a finder in front of
the import system, refusing `torch` and its submodules as if they were not installed; the
subprocesses that tests start inherit PYTHONPATH and so the refusal. These tests are in the
engine tier: the whole run takes as long as the core tier itself.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from medha.engine.cpu_threads import usable_cores

ROOT = Path(__file__).resolve().parent.parent

NO_TORCH = '''\
import sys


class _NoTorch:
    """Refuses torch as if it were not installed (tests/test_tiers.py)."""

    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ModuleNotFoundError(f"No module named {name!r} (blocked)", name=name)
        return None


sys.meta_path.insert(0, _NoTorch())
'''


def without_torch(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    """`python *args` in the repository with torch unimportable."""
    (tmp_path / "sitecustomize.py").write_text(NO_TORCH)
    paths = [str(tmp_path), str(ROOT), os.environ.get("PYTHONPATH", "")]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in paths if p))
    return subprocess.run(
        [sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=900
    )


def pytest_core(tmp_path: Path, *args: str) -> tuple[subprocess.CompletedProcess, dict]:
    """The core tier run by pytest without torch, and the counts of its last line. It runs on
    every core this process may use, where pytest-xdist is installed (the test extra; its
    workers inherit the refusal with PYTHONPATH): the run that starts it only waits, and on one
    core it took 4.4 minutes of CI's 28 (Ice Lake Xeon, 2 cores). A full run runs the core
    tests here only (tests/conftest.py CoreRunsOnce)."""
    spread = ["-n", str(usable_cores())] if importlib.util.find_spec("xdist") is not None else []
    out = without_torch(
        tmp_path, "-m", "pytest", "-m", "core", "-q", "-p", "no:cacheprovider", *spread, *args
    )
    last = out.stdout.strip().splitlines()[-1] if out.stdout.strip() else ""
    return out, summary_counts(last)


def summary_counts(last: str) -> dict[str, int]:
    """{word: count} of pytest's summary line, e.g. {"passed": 300, "warnings": 2}."""
    return {word: int(n) for n, word in re.findall(r"(\d+)(?:/\d+)? (\w+)", last)}


# What a run whose every collected test ran and passed may say: warnings are no outcome (a
# library's deprecation or a late-closed socket warns on some machines and not on others).
ALL_PASSED = {"passed", "deselected", "warning", "warnings"}


def all_passed(counts: dict[str, int]) -> bool:
    return counts.get("passed", 0) > 0 and set(counts) <= ALL_PASSED


def check_torch_is_blocked(tmp_path: Path) -> None:
    out = without_torch(tmp_path, "-c", "import torch")
    assert out.returncode == 1 and "No module named 'torch' (blocked)" in out.stderr, out.stderr


def test_the_core_tier_passes_without_torch(tmp_path):
    check_torch_is_blocked(tmp_path)
    out, counts = pytest_core(tmp_path)
    tail = out.stdout[-3000:] + out.stderr[-3000:]
    assert out.returncode == 0, tail
    # every collected core test ran and passed: none skipped for want of torch
    assert counts.get("passed", 0) > 200 and all_passed(counts), tail


def collected(*args: str) -> list[str]:
    """The test ids `pytest --collect-only` selects with `args`, and its report's other lines."""
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    return out.stdout.splitlines()


def test_a_run_with_the_torch_free_core_run_runs_core_tests_only_there():
    """tests/conftest.py CoreRunsOnce: the core tests of a run that holds the torch-free run
    are left to it; without it (or with `-m core`) they run in the run itself."""
    core = "tests/test_simulator.py"
    alone = [line for line in collected(core) if line.startswith(core + "::")]
    assert len(alone) > 5
    both = collected("tests/test_tiers.py", core)
    assert not [line for line in both if line.startswith(core + "::")]
    assert "tests/test_tiers.py::test_the_core_tier_passes_without_torch" in both
    assert any(line.startswith(f"{len(alone)} core tests run once, without torch") for line in both)
    # -k leaving out the torch-free run leaves the core tests here
    kept = collected("tests/test_tiers.py", core, "-k", "not core_tier_passes")
    assert [line for line in kept if line.startswith(core + "::")] == alone


@pytest.mark.parametrize(
    "last,passed",
    [
        ("300 passed, 40 deselected in 50.20s", True),
        ("300 passed, 40 deselected, 1 warning in 50.20s", True),
        ("300 passed, 40 deselected, 12 warnings in 62.00s (0:01:02)", True),
        ("1 failed, 299 passed, 40 deselected in 50.20s", False),
        ("299 passed, 1 skipped, 40 deselected, 1 warning in 50.20s", False),
        ("299 passed, 1 xfailed, 40 deselected in 50.20s", False),
        ("299 passed, 1 xpassed, 40 deselected in 50.20s", False),
        ("299 passed, 1 error in 50.20s", False),
        ("298 passed, 2 errors in 50.20s", False),
        ("no tests ran in 0.01s", False),
        ("", False),
    ],
)
def test_the_core_runs_summary_is_read_whatever_warns(last, passed):
    assert all_passed(summary_counts(last)) == passed


def test_a_core_module_that_loads_torch_stops_a_core_run(tmp_path):
    """What a new test module that imports torch, left out of MODULE_TIERS, meets in a core
    run with torch installed: a collection error that says what to do."""
    from conftest import MODULE_TIERS

    tests = tmp_path / "tests"
    tests.mkdir()
    shutil.copy(ROOT / "tests" / "conftest.py", tests)
    for name in MODULE_TIERS:  # the copy checks that its table names real modules
        (tests / name).write_text("")
    (tests / "test_new.py").write_text("import torch\n\n\ndef test_it():\n    assert torch\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    env = dict(
        os.environ,
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
    )
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-m",
            "core",
            "-q",
            "-p",
            "no:cacheprovider",
            "-c",
            "pytest.ini",
            "tests",
        ],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 2, out.stdout + out.stderr
    assert "test_new.py has core tests but importing it loads torch" in out.stdout


def test_a_command_that_needs_torch_names_its_extra(tmp_path):
    """`pip install medha` has no torch (pyproject's engine and serve extras bring it): the
    commands and names that need it say which extra to install, instead of a traceback."""
    cases = [
        (("-m", "medha", "generate", "--prompt", "hi"), "'engine' extra"),
        (("-m", "medha", "serve", "--port", "1"), "'serve' extra"),
        (("-m", "medha", "profile", "--quick"), "'engine' extra"),
    ]
    for args, extra in cases:
        out = without_torch(tmp_path, *args)
        assert out.returncode == 2 and "needs 'torch'" in out.stderr and extra in out.stderr, (
            args,
            out.stderr[-2000:],
        )
        assert "Traceback" not in out.stderr
    out = without_torch(tmp_path, "-c", "from medha import LLM")
    assert out.returncode == 1 and "medha.LLM needs 'torch'" in out.stderr, out.stderr[-2000:]
    assert "pip install 'medha[engine]'" in out.stderr
    # the torch-free commands still run
    out = without_torch(tmp_path, "-m", "medha", "chunks", "--prompt-len", "4096")
    assert out.returncode == 0, out.stderr[-2000:]


def test_only_a_missing_extra_is_named():
    """A ModuleNotFoundError that no extra answers (a bug, a typo) is not dressed up as an
    install problem: the CLI re-raises it."""
    from medha.extras import missing_extra

    assert missing_extra(ModuleNotFoundError("x", name="medha.no_such"), "medha x") is None
    message = missing_extra(ModuleNotFoundError("x", name="aiohttp.client"), "medha route")
    assert "'route' extra" in message
    # a command documented to need `serve` names it for torch too (serve includes engine)
    message = missing_extra(ModuleNotFoundError("x", name="torch"), "medha serve", "serve")
    assert "'serve' extra" in message and "torch==2.13.0" in message
