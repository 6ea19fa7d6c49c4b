"""Lists bench/'s suites by subject, and runs one of them by its name.

    python bench/run.py                          # every suite, by subject (or --list)
    python bench/run.py sim_pla_serve --help     # a suite's own flags
    python bench/run.py sim_pla_serve --only fig7 --replicas 1

A suite runs as its script would from the same directory (`python bench/paper/sim_pla_serve.py
--only fig7 ...`), with this Python, its arguments as given and its exit status as the run's.
The suites are medha/benchmark/suites.py's; bench/README.md says what each measures.
"""

from __future__ import annotations

import os
import signal
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's medha, where this runs without an install

from medha.benchmark.suites import SUBJECTS, SUITES, close_matches  # noqa: E402


def listing() -> str:
    lines = []
    for subject, (about, _) in SUBJECTS.items():
        lines.append(f"{subject}: {about}")
        for suite in (s for s in SUITES.values() if s.subject == subject):
            about_it = textwrap.shorten(suite.description, 100, placeholder=" ...")
            lines.append(f"  {suite.name:<28} {about_it}")
        lines.append("")
    lines.append("python bench/run.py NAME [ARGS...] runs one; NAME --help gives its flags")
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    if not argv or argv[0] in ("--list", "-l", "--help", "-h"):
        print(listing())
        return 0
    name, args = argv[0], argv[1:]
    suite = SUITES.get(name.removesuffix(".py").removesuffix(".sh"))
    if suite is None:
        near = close_matches(name)
        hint = f"; did you mean {', '.join(near)}?" if near else ""
        print(f"bench/run.py: no suite {name!r}{hint} (--list names them all)", file=sys.stderr)
        return 2
    script = ROOT / suite.path
    # the suite replaces this process: signals reach it, its exit status is the run's, its
    # output goes straight where this one's went
    if suite.path.endswith(".sh"):
        os.execvp("bash", ["bash", str(script), *args])
    else:
        os.execv(sys.executable, [sys.executable, str(script), *args])
    return 0  # not reached: the suite's own exit is the run's


if __name__ == "__main__":
    # `python bench/run.py | head` ends quietly, as a shell command would
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    sys.exit(main(sys.argv[1:]))
