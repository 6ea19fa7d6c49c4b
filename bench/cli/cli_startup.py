"""Start-up of the `medha` command: `--help` against a bare Python, and a repeated
`medha simulate`.

    python bench/cli/cli_startup.py [--repeats 7] [--sim-repeats 3] [--tree DIR ...]

Part 1 runs `python -c pass`, `python -m medha --help` and `python -m medha simulate --help`
one after the other, --repeats rounds, each in a fresh interpreter of this Python, and prints
the median wall time of each and its ratio to `python -c pass`.

Part 2 runs docs/simulator.md's simulate example (Llama-3-8B, TP 8 x SPP 2 on A100s, 500 ShareGPT
requests at 0.75/s, 5% long-context ones) with an empty cache folder (cold), then again with
the folder that run filled (warm), --sim-repeats rounds, and prints the medians of: the time
from the interpreter's start to the first simulated event (imports, predictor, scheduler,
workload: what a user waits for), summary.json's `sim.setup_s` (building the Simulator:
predictor and scheduler) and `sim.wall_s` (the simulation; on a cold run it includes walking
the prefill-time cache as far as the longest prompt), and the whole command. --predictor
profiled runs it with the fitted predictor instead of the roofline.

Each --tree (a checkout, put first on PYTHONPATH) is measured in every round in turn, so that
load on the machine falls on all of them alike; without --tree, the medha this Python imports.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HELP_COMMANDS = {
    "python -c pass": ["-c", "pass"],
    "medha --help": ["-m", "medha", "--help"],
    "medha simulate --help": ["-m", "medha", "simulate", "--help"],
}
README_SIMULATE = [
    "--model",
    "llama-3-8b",
    "--hardware",
    "a100",
    "--tp",
    "8",
    "--spp",
    "2",
    "--trace",
    "sharegpt",
    "--qps",
    "0.75",
    "--num-requests",
    "500",
    "--long-fraction",
    "0.05",
]
# `medha simulate` noting when the simulation loop starts
DRIVER = """
import json, sys, time
t0 = time.perf_counter()
from medha.cli import main
from medha.sim.simulator import Simulator
run, started = Simulator.run, []
def timed_run(self, *args, **kwargs):
    started.append(time.perf_counter() - t0)
    return run(self, *args, **kwargs)
Simulator.run = timed_run
assert main(sys.argv[2:]) == 0
with open(sys.argv[1], "w") as fh:
    json.dump({"first_event_s": started[0], "total_s": time.perf_counter() - t0}, fh)
"""


def env_for(tree: str | None, **extra: str) -> dict:
    env = {**os.environ, **extra}
    if tree:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (tree, os.environ.get("PYTHONPATH"))))
    return env


def wall(argv: list[str], env: dict) -> float:
    t0 = time.perf_counter()
    subprocess.run(
        [sys.executable, *argv],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env,
    )
    return time.perf_counter() - t0


def help_times(trees: list[str | None], repeats: int) -> None:
    times = {(tree, name): [] for tree in trees for name in HELP_COMMANDS}
    for _ in range(repeats):
        for tree in trees:
            for name, argv in HELP_COMMANDS.items():
                times[tree, name].append(wall(argv, env_for(tree)))
    print(f"| tree | command | median of {repeats} | vs python -c pass |")
    print("|---|---|---|---|")
    for tree in trees:
        base = statistics.median(times[tree, "python -c pass"])
        for name in HELP_COMMANDS:
            m = statistics.median(times[tree, name])
            print(f"| {tree or '-'} | `{name}` | {m:.3f} s | {m / base:.1f}x |")


def simulate(tree: str | None, cache: Path, tmp: Path, flags: list[str]) -> dict:
    out, times = tmp / "out", tmp / "times.json"
    subprocess.run(
        [
            sys.executable,
            "-c",
            DRIVER,
            str(times),
            "simulate",
            *README_SIMULATE,
            *flags,
            "--quiet",
            "--overwrite",
            "--out",
            str(out),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env=env_for(tree, MEDHA_CACHE_DIR=str(cache)),
    )
    sim = json.loads((out / "summary.json").read_text())["sim"]
    return {**json.loads(times.read_text()), "setup_s": sim["setup_s"], "wall_s": sim["wall_s"]}


def simulate_times(trees: list[str | None], repeats: int, flags: list[str]) -> None:
    runs = {(tree, kind): [] for tree in trees for kind in ("cold", "warm")}
    with tempfile.TemporaryDirectory(prefix="medha-cli-startup-") as tmp:
        for i in range(repeats):
            for j, tree in enumerate(trees):
                cache = Path(tmp) / f"cache-{i}-{j}"  # empty: cold; the same folder: warm
                for kind in ("cold", "warm"):
                    runs[tree, kind].append(simulate(tree, cache, Path(tmp), flags))
    print(
        f"\n| tree | `medha simulate` {' '.join(flags)} | to the first simulated event | "
        "sim.setup_s | sim.wall_s | whole command |"
    )
    print("|---|---|---|---|---|---|")
    for (tree, kind), rs in runs.items():
        med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
        print(
            f"| {tree or '-'} | {kind} (median of {repeats}) | {med['first_event_s']:.2f} s "
            f"| {med['setup_s']:.3f} s | {med['wall_s']:.2f} s | {med['total_s']:.2f} s |"
        )


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--repeats", type=int, default=7, help="rounds of the --help timings")
    ap.add_argument(
        "--sim-repeats",
        type=int,
        default=3,
        help="cold/warm pairs of the simulate example (0: skip)",
    )
    ap.add_argument("--predictor", default="roofline", help="of the simulate example")
    ap.add_argument(
        "--tree",
        action="append",
        default=None,
        help="a checkout to measure (repeatable; default: the installed medha)",
    )
    args = ap.parse_args()
    trees = args.tree or [None]
    if args.repeats:
        help_times(trees, args.repeats)
    if args.sim_repeats:
        flags = [] if args.predictor == "roofline" else ["--predictor", args.predictor]
        simulate_times(trees, args.sim_repeats, flags)


if __name__ == "__main__":
    main()
