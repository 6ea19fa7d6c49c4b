"""The Medha paper's reproduction benches run (CI runs one figure's --quick form) and show what
the figure shows: short requests escape the convoy that non-preemptive FCFS puts them in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_convoy_quick_shows_the_convoy():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/paper/sim_convoy_effect.py"),
            "--quick",
            "--configs",
            "medha",
            "non-preemptive fcfs, 2 x TP8",
        ],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
    ).stdout
    rows = [line for line in out.splitlines() if line.startswith("| 0.25 | non-preemptive")]
    assert len(rows) == 1, out
    cells = [c.strip() for c in rows[0].strip("|").split("|")]
    p50, p99 = (float(re.sub("x$", "", c)) for c in cells[2:4])
    # the long prompts of the quick run hold the FCFS replicas for tens of seconds while medha
    # serves short requests within its iteration budget
    assert p99 > 50, out
    assert p50 >= 0.5, out
    assert cells[4] == "yes", out  # 0.25 QPS is below saturation


# ---- the generated tables of docs/reproductions.md (bench/tables.py) -------------------------
def tables(*args, doc=None):
    extra = ["--doc", str(doc)] if doc else []
    return subprocess.run(
        [sys.executable, str(ROOT / "bench/tables.py"), *args, *extra],
        capture_output=True,
        text=True,
        timeout=900,
    )


def test_the_quick_tables_match_the_docs():
    """The committed quick tables are what the code produces now (a change that moves a number
    must rerun `python bench/tables.py --only NAME` and commit the table)."""
    run = tables("--check", "--quick")
    assert run.returncode == 0, run.stdout + run.stderr
    assert "table(s) match" in run.stdout


def test_a_planted_change_of_one_number_fails_the_check_and_a_rewrite_is_byte_identical(tmp_path):
    sys.path.insert(0, str(ROOT / "bench"))
    import tables as t

    doc = tmp_path / "reproductions.md"
    text = (ROOT / "docs/reproductions.md").read_text()
    start, end, body = t.parse(text)["pla-fig7-1"]
    row = next(line for line in body.splitlines() if line.startswith("| 20 |"))
    planted = re.sub(r"\d+\.\d%", lambda m: f"{float(m[0][:-1]) + 0.1:.1f}%", row, count=1)
    assert planted != row
    doc.write_text(text.replace(row, planted, 1))
    run = tables("--check", "--only", "pla-fig7-1", doc=doc)
    assert run.returncode == 1, run.stdout + run.stderr
    assert "stale: pla-fig7-1" in run.stdout and planted in run.stdout
    # written twice at one commit: byte for byte the same, and the planted number gone
    first = tables("--only", "pla-fig7-1", doc=doc)
    assert first.returncode == 0, first.stderr
    once = doc.read_bytes()
    assert tables("--only", "pla-fig7-1", doc=doc).returncode == 0
    assert doc.read_bytes() == once
    assert planted not in once.decode() and row in once.decode()


@pytest.mark.parametrize(
    "change, error",
    [
        (lambda s: s.replace("<!-- end table pla-fig5 -->", ""), "has no `<!-- end table"),
        (lambda s: s.replace("table pla-fig5:", "table pla-fig99:", 1), "not in bench/tables.py"),
        (lambda s: s.replace("--think-ms 500 (at", "--think-ms 20 (at", 1), "bench/tables.py runs"),
    ],
)
def test_a_broken_marker_is_an_error_not_a_silent_skip(tmp_path, change, error):
    doc = tmp_path / "reproductions.md"
    doc.write_text(change((ROOT / "docs/reproductions.md").read_text()))
    run = tables("--check", "--only", "pla-fig7-1", doc=doc)
    assert run.returncode == 2 and error in run.stderr, run.stderr


def test_every_table_the_script_writes_has_its_place_in_the_doc():
    """A table in `TABLES` without its markers would never be checked (only the tables asked
    for are looked up): each has one place, and each names the commit its numbers are from."""
    sys.path.insert(0, str(ROOT / "bench"))
    import tables as t

    text = (ROOT / "docs/reproductions.md").read_text()
    assert sorted(t.parse(text)) == sorted(t.TABLES)
    for line in text.splitlines():
        m = t.START.match(line)
        if m:
            assert re.fullmatch(r"[0-9a-f]{10}", m["commit"]), line
