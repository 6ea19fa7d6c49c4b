"""medha/benchmark/suites.py and bench/run.py: every script of bench/ is a suite, by subject,
and `python bench/run.py NAME ARGS` runs it as its own command line would."""

import subprocess
import sys
from pathlib import Path

import pytest

from medha.benchmark import suites

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
RUN = BENCH / "run.py"


def test_every_script_in_a_subject_folder_is_a_suite_and_every_suite_is_a_script():
    on_disk = {
        p.relative_to(ROOT).as_posix()
        for p in BENCH.glob("*/*")
        if p.suffix in (".py", ".sh") and p.parent.name in suites.SUBJECTS
    }
    assert on_disk == {s.path for s in suites.SUITES.values()}
    assert {p.parent.name for p in BENCH.glob("*/*.py")} <= set(suites.SUBJECTS)
    # bench/'s top holds the two scripts that serve every suite, nothing else
    assert sorted(p.name for p in BENCH.glob("*.py")) == ["run.py", "tables.py"]


def test_every_suite_says_what_it_measures():
    for s in suites.SUITES.values():
        assert s.description, s.path
        assert "\n" not in s.description
    assert suites.SUITES["sim_chunking"].description.startswith(
        "Adaptive vs static chunking (Medha Fig. 4, 10)"
    )
    assert suites.script("sim_pla_serve") == "bench/paper/sim_pla_serve.py"
    assert suites.SUITES["gpu_session"].command == ("bash", "bench/gpu/gpu_session.sh")


def test_the_tables_run_registered_suites():
    sys.path.insert(0, str(BENCH))
    import tables

    paths = {s.path for s in suites.SUITES.values()}
    assert {t.command[0] for t in tables.TABLES.values()} <= paths


def test_the_readme_has_a_line_for_every_suite():
    text = (BENCH / "README.md").read_text()
    for s in suites.SUITES.values():
        assert f"| {s.name} | " in text and f"`python bench/run.py {s.name}` ({s.path})" in text
    for subject in suites.SUBJECTS:
        assert f"\n## {subject}: " in text


def _run(*args):
    return subprocess.run(
        [sys.executable, str(RUN), *args], cwd=ROOT, capture_output=True, text=True, timeout=120
    )


def test_the_listing_names_every_suite_under_its_subject():
    out = _run().stdout
    assert out == _run("--list").stdout
    for subject in suites.SUBJECTS:
        assert f"\n{subject}: " in "\n" + out
    for name in suites.SUITES:
        assert f"  {name} " in out


def test_an_unknown_name_is_an_error_that_names_the_close_ones():
    run = _run("sim_pla", "--help")
    assert run.returncode == 2
    assert "no suite 'sim_pla'" in run.stderr and "sim_pla_serve" in run.stderr


def test_a_suite_runs_as_its_script_with_its_arguments(monkeypatch):
    sys.path.insert(0, str(BENCH))
    import run

    calls = []
    monkeypatch.setattr(run.os, "execv", lambda exe, argv: calls.append(argv))
    monkeypatch.setattr(run.os, "execvp", lambda exe, argv: calls.append(argv))
    run.main(["sim_pla_serve", "--only", "fig7"])
    run.main(["gpu_session.sh", "dry"])
    assert calls == [
        [sys.executable, str(BENCH / "paper" / "sim_pla_serve.py"), "--only", "fig7"],
        ["bash", str(BENCH / "gpu" / "gpu_session.sh"), "dry"],
    ]


@pytest.mark.parametrize("args, rc", [(["--help"], 0), (["--no-such-flag"], 2)])
def test_the_suites_exit_status_is_the_runs(args, rc):
    run = _run("sim_spp_vs_cp", *args)
    assert run.returncode == rc, run.stderr
