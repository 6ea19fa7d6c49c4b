"""The Medha paper's reproduction benches run (CI runs one figure's --quick form) and show what
the figure shows: short requests escape the convoy that non-preemptive FCFS puts them in."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_convoy_quick_shows_the_convoy():
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "bench/sim_convoy_effect.py"),
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
