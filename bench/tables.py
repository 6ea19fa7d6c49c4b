"""Writes the generated tables of docs/reproductions.md, each the output of one bench command at
one commit, and checks that the committed tables are what the code produces.

    python bench/tables.py                      # run every table's command, write it in
    python bench/tables.py --only pla-fig7-8    # one table (or several)
    python bench/tables.py --check              # rerun, compare, exit 1 on any difference
    python bench/tables.py --check --quick      # the quick ones (CI: tests/test_reproductions.py)
    python bench/tables.py --list

A generated table sits between two markers in the doc; the first names the table, its command
and the commit its numbers come from:

    <!-- table spp-vs-cp: python bench/sim/sim_spp_vs_cp.py (at abc1234) -->
    ... the command's standard output, but for its wall-time line ...
    <!-- end table spp-vs-cp -->

Written text around the tables stays the author's. The simulator is deterministic, so two runs
at one commit write byte-identical tables; `--check` compares the tables' bodies, not the
commit they name. A table whose command is not in `TABLES`, or a marker without its end, is an
error, and so is a doc that lacks a table `TABLES` names.
"""

from __future__ import annotations

import argparse
import difflib
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # the checkout's medha, where this runs without an install

from medha.benchmark.suites import script  # noqa: E402

DOC = ROOT / "docs" / "reproductions.md"
PLA = script("sim_pla_serve")
ORCA = script("sim_orca_sarathi")
ALIGNED = script("sim_aligned_serve")
# the three cost models every AlignedServe reading is given under
ALIGNED_MODELS = ("roofline", "roofline-cta:4.4", "roofline-padded")


@dataclass(frozen=True)
class Table:
    command: tuple[str, ...]  # run from the repository's root with this Python
    quick: bool = False  # cheap enough for CI (seconds)

    @property
    def shown(self) -> str:
        return "python " + shlex.join(self.command)


TABLES: dict[str, Table] = {
    "convoy": Table((script("sim_convoy_effect"),)),
    "convoy-window": Table((script("sim_convoy_effect"), "--qps", "0.75", "--window", "3600")),
    # one-change runs of rows 2 and 16: LoongServe's macro iterations; its ring priced as the
    # plain contiguous ring (Fig. 14 as Fig. 5b's CP)
    "convoy-macro": Table(
        (script("sim_convoy_effect"), "--qps", "0.125", "0.25", "--configs", "medha")
        + ("loongserve, macro",)
    ),
    "convoy-window-ring": Table(
        (script("sim_convoy_effect"), "--qps", "0.75", "--window", "3600", "--configs")
        + ("medha", "loongserve, contiguous ring", "loongserve +reserv, contiguous ring")
    ),
    # LoongServe's macro iterations changed alone, short requests only
    "convoy-short-macro": Table(
        (script("sim_convoy_effect"), "--long-fraction", "0", "--qps", "0.25", "0.75", "1.25")
        + ("1.75", "--configs", "medha", "loongserve", "loongserve, macro")
    ),
    # the same with long requests, beside LoongServe as it is and LARS's other formula
    "convoy-macro-formula": Table(
        (script("sim_convoy_effect"), "--qps", "0.125", "0.25", "--configs", "medha")
        + ("loongserve", "loongserve, macro", "medha, s / w(t)")
    ),
    "capacity-500": Table((script("sim_capacity"), "--num-requests", "500")),
    "convoy-short": Table(
        (script("sim_convoy_effect"), "--long-fraction", "0", "--qps", "0.25", "0.75", "1.25")
        + ("1.75",)
    ),
    "policies": Table((script("sim_policies"), "--lars-slack", "both")),
    "lars-causes": Table((script("sim_lars"), "causes")),
    "lars-starvation": Table((script("sim_lars"), "starvation"), quick=True),
    "chunking": Table((script("sim_chunking"),)),
    "pla-fig5": Table((PLA, "--only", "fig5", "--think-ms", "500")),
    "pla-fig6-1": Table((PLA, "--only", "fig6", "--replicas", "1", "--requests", "600")),
    "pla-fig6-8": Table(
        (PLA, "--only", "fig6", "--replicas", "8", "--models", "qwen2.5-14b", "--concurrency")
        + ("8", "32", "64", "--requests", "400", "--trace"),
        quick=True,
    ),
    "pla-fig7-1": Table((PLA, "--only", "fig7", "--replicas", "1"), quick=True),
    "pla-fig7-8": Table(
        (PLA, "--only", "fig7", "--replicas", "8", "--rates8", "300", "320", "360", "400")
        + ("--trace",)
    ),
    "pla-table2": Table((PLA, "--only", "table2", "--table2-requests", "4000", "--trace")),
    "aligned-fig1": Table(
        (ALIGNED, "--figure", "1", "--predictors", "roofline", "roofline-cta")
        + ("roofline-cta:4.4", "roofline-padded"),
        quick=True,
    ),
    "aligned-fig13": Table(
        (ALIGNED, "--figure", "13", "--model", "opt-13b", "--predictors", "roofline")
        + ("roofline-cta:4.4", "roofline-padded", "--seeds", "0", "1")
    ),
    **{
        f"aligned-fig{fig}{suffix}": Table(
            (ALIGNED, "--figure", fig, "--predictors", *rest, "--seeds", "0", "1", *change)
        )
        for fig, rest in (
            ("7", ("roofline", "roofline-cta:4.4", "roofline-padded", "--mixes", "0.7", "0.95")),
            ("8", ("roofline-cta:4.4", "roofline-padded")),
        )
        for suffix, change in (
            ("", ()),
            ("-climb", ("--widen", "climb")),
            ("-nodes", ("--starvation-scope", "nodes")),
        )
    },
    # the summary against vLLM (Figs. 7-10): every mix, OPT-2.7B, every trace, each model
    "aligned-fig7-mixes": Table(
        (ALIGNED, "--figure", "7", "--predictors", *ALIGNED_MODELS, "--seeds", "0", "1")
    ),
    "aligned-fig7-opt2.7b": Table(
        (ALIGNED, "--figure", "7", "--model", "opt-2.7b", "--predictors", *ALIGNED_MODELS)
        + ("--seeds", "0", "1")
    ),
    "aligned-fig8-roofline": Table(
        (ALIGNED, "--figure", "8", "--predictors", "roofline", "--seeds", "0", "1")
    ),
    # the one-change runs of the Figs. 7-10 prose, the default's row in aligned-fig7
    **{
        f"aligned-fig7-{name}": Table(
            (ALIGNED, "--figure", "7", "--predictors", *ALIGNED_MODELS, "--mixes", "0.7")
            + ("0.95", "--seeds", "0", "1", *change)
        )
        for name, change in (
            ("memory-1.0", ("--memory-fraction", "1.0")),
            ("switch-on-room", ("--switch-on-room",)),
            ("no-starvation", ("--no-starvation",)),
            ("fixed-output", ("--fixed-output", "256")),
            ("fixed-output-min-batch", ("--fixed-output", "256", "--min-batch", "4")),
        )
    },
    "aligned-fig14": Table(
        (ALIGNED, "--figure", "14", "--traces", "azure", "--predictors", *ALIGNED_MODELS)
        + ("--seeds", "0", "1")
    ),
    **{
        f"aligned-switch{suffix}": Table(
            (ALIGNED, "--figure", "switch", "--traces", "sharegpt", "longbench~arxiv")
            + ("--predictors", *ALIGNED_MODELS, "--seeds", "0", "1", *change)
        )
        for suffix, change in (("", ()), ("-min-batch", ("--min-batch", "4")))
    },
    "deferred-paper": Table((script("sim_deferred_prefill_paper"),)),
    "deferred-sharegpt": Table((script("sim_deferred_prefill_paper"), "--sections", "sharegpt")),
    "deferred-h100-mixed": Table((script("sim_deferred_prefill"), "--mixed")),
    # Figures 11 and 12, and the one-change run with long prompts four times Medha-SWE's
    **{
        f"parallel-3d{size}{suffix}": Table((script("sim_3d_parallel"), *run, *change))
        for size, run in (
            ("", ()),
            ("-4m", ("--qps", "1.75", "--num-requests", "100", "--long-scale", "4")),
        )
        for suffix, change in (("", ()), ("-no-overload", ("--no-overload-steps",)))
    },
    # row 3: 1% long requests
    "convoy-1pct": Table(
        (script("sim_convoy_effect"), "--long-fraction", "0.01", "--qps", "0.25", "0.75")
    ),
    **{
        f"parallel-fig{fig}": Table((script("sim_parallel_figures"), "--figure", fig))
        for fig in ("17a", "17b", "15", "16", "18", "19", "20", "3b")
    },
    "parallel-fig15-budget": Table(
        (script("sim_parallel_figures"), "--figure", "15", "--budget-s", "0.2")
    ),
    "spp-vs-cp": Table((script("sim_spp_vs_cp"),), quick=True),
    **{
        f"swap-{part}": Table((script("sim_swap_vs_recompute"), "--only", part))
        for part in ("pressure", "priority")
    },
    "slo-risk": Table((script("sim_slo_risk"),)),
    "orca-overhead": Table((ORCA, "--only", "overhead"), quick=True),
    "orca-serving": Table((ORCA, "--only", "serving", "--trace")),
}

START = re.compile(r"^<!-- table (?P<name>[\w.-]+): (?P<command>.*) \(at (?P<commit>[^)]*)\) -->$")
END = "<!-- end table {name} -->"
# what a run prints that is not its result
NOISE = re.compile(r"^\(wall time [\d.]+ s\)$")


class TableError(Exception):
    pass


def commit() -> str:
    """The commit the code is at; `+changes` when medha/ or bench/ differ from it."""
    head = subprocess.run(
        ["git", "rev-parse", "--short=10", "HEAD"], cwd=ROOT, capture_output=True, text=True
    ).stdout.strip()
    dirty = subprocess.run(
        ["git", "status", "--porcelain", "--", "medha", "bench"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    ).stdout.strip()
    return (head or "unknown") + ("+changes" if dirty else "")


def produce(name: str) -> str:
    """The table's body: its command's standard output, less its wall-time line and the blank
    lines around it."""
    table = TABLES[name]
    run = subprocess.run([sys.executable, *table.command], cwd=ROOT, capture_output=True, text=True)
    if run.returncode:
        raise TableError(f"{name}: `{table.shown}` exited {run.returncode}:\n{run.stderr[-2000:]}")
    lines = [line.rstrip() for line in run.stdout.splitlines() if not NOISE.match(line.strip())]
    return "\n".join(lines).strip("\n") + "\n"


def parse(text: str) -> dict[str, tuple[int, int, str]]:
    """name -> (line of its start marker, line of its end marker, body) in a doc's lines."""
    lines = text.split("\n")
    found: dict[str, tuple[int, int, str]] = {}
    for i, line in enumerate(lines):
        m = START.match(line)
        if not m:
            continue
        name = m["name"]
        if name not in TABLES:
            raise TableError(f"line {i + 1}: table {name!r} is not in bench/tables.py's TABLES")
        if name in found:
            raise TableError(f"line {i + 1}: table {name!r} appears twice")
        if m["command"] != TABLES[name].shown:
            raise TableError(
                f"line {i + 1}: table {name!r} names `{m['command']}`, "
                f"bench/tables.py runs `{TABLES[name].shown}`"
            )
        end = END.format(name=name)
        try:
            j = lines.index(end, i + 1)
        except ValueError:
            raise TableError(f"line {i + 1}: table {name!r} has no `{end}`") from None
        found[name] = (i, j, "\n".join(lines[i + 1 : j]) + "\n")
    return found


def block(name: str, body: str, at: str) -> list[str]:
    return [
        f"<!-- table {name}: {TABLES[name].shown} (at {at}) -->",
        *body.rstrip("\n").split("\n"),
        END.format(name=name),
    ]


def write(doc: Path, bodies: dict[str, str], at: str) -> None:
    text = doc.read_text()
    found = parse(text)
    lines = text.split("\n")
    # from the bottom up, so that the earlier tables' line numbers hold
    for name in sorted(bodies, key=lambda n: -found[n][0]):
        i, j, _ = found[name]
        lines[i : j + 1] = block(name, bodies[name], at)
    doc.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--only", nargs="+", metavar="NAME", help="these tables (default: all)")
    ap.add_argument("--quick", action="store_true", help="the tables marked quick")
    ap.add_argument("--check", action="store_true", help="compare with the doc, write nothing")
    ap.add_argument("--doc", type=Path, default=DOC, help="the doc (default: %(default)s)")
    ap.add_argument("--list", action="store_true", help="name every table and its command")
    args = ap.parse_args(argv)
    if args.list:
        for name, table in TABLES.items():
            print(f"{name}{' (quick)' if table.quick else ''}: {table.shown}")
        return 0
    names = args.only or [n for n, t in TABLES.items() if t.quick or not args.quick]
    unknown = [n for n in names if n not in TABLES]
    if unknown:
        ap.error(f"unknown table(s) {', '.join(unknown)}; --list names them")
    try:
        found = parse(args.doc.read_text())
        missing = [n for n in names if n not in found]
        if missing:
            raise TableError(f"{args.doc} lacks the markers of {', '.join(missing)}")
        bodies = {}
        for k, name in enumerate(names, 1):
            t0 = time.perf_counter()
            print(f"[{k}/{len(names)}] {name}: {TABLES[name].shown}", file=sys.stderr, flush=True)
            bodies[name] = produce(name)
            print(f"    {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    except TableError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.check:
        stale = []
        for name, body in bodies.items():
            committed = found[name][2]
            if committed != body:
                stale.append(name)
                sys.stdout.writelines(
                    difflib.unified_diff(
                        committed.splitlines(True),
                        body.splitlines(True),
                        f"{args.doc} ({name}, committed)",
                        f"{name}, as the code produces it",
                    )
                )
        if stale:
            print(f"stale: {', '.join(stale)} (python bench/tables.py --only {' '.join(stale)})")
            return 1
        print(f"{len(bodies)} table(s) match {args.doc}")
        return 0
    write(args.doc, bodies, commit())
    print(f"wrote {len(bodies)} table(s) into {args.doc}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
