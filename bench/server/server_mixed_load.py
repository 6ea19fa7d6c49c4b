"""Mixed load through the HTTP API, lars against non-preemptive fcfs, plus the digital twin.

    python bench/server/server_mixed_load.py [--qps 0.45] [--num-requests 200]

For each scheduler: start `medha serve` on SmolLM2 (CPU), drive it with `medha bench` (95%
short prompts of 32-256 tokens, 5% long ones of 3,000-6,000, 16-48 output tokens, Poisson),
read the server's busy share from its /metrics, stop it. Then replay each run's requests.csv
in `medha simulate` with this machine's profile (`medha profile`) and compare the predicted
short-request TTFT p50 with the measured one.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

import httpx

from medha.benchmark.harness import add_common_args
from medha.benchmark.load_generator import BenchConfig, run_bench
from medha.benchmark.local_server import local_server

WORKLOAD = "prompt=32-256,output=16-48,long_fraction=0.05,long_prompt=3000-6000"
POLICIES = {
    "lars": ["--policy", "lars"],
    "fcfs-none": ["--policy", "fcfs", "--chunking", "none"],
    # short requests first (earliest deadline): what the iteration budget leaves any scheduler
    "edf": ["--policy", "edf"],
}


def _busy_seconds(url: str) -> float:
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line.startswith("medha_iteration_seconds_sum "):
            return float(line.split()[1])
    raise RuntimeError("no medha_iteration_seconds_sum in /metrics")


def serve_and_bench(name: str, flags: list[str], args, out: Path) -> dict:
    def command(port: int) -> list[str]:
        return [
            sys.executable,
            "-m",
            "medha",
            "serve",
            "--port",
            str(port),
            "--log-level",
            "warning",
            *flags,
        ]

    with local_server(command) as url:
        busy0 = _busy_seconds(url)
        summary = run_bench(
            BenchConfig(
                url=url,
                workload=args.workload,
                qps=args.qps,
                num_requests=args.num_requests,
                seed=args.seed,
                long_threshold=1024,
                out=str(out / name),
            )
        )
        summary["busy_share"] = (_busy_seconds(url) - busy0) / summary["client"]["wall_s"]
    return summary


def simulate(name: str, flags: list[str], profile: str, out: Path) -> dict:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "medha",
            "simulate",
            "--model",
            "smollm2-135m",
            "--hardware",
            "cpu",
            "--predictor",
            f"profiled:{profile}",
            "--trace",
            str(out / name / "requests.csv"),
            "--kv-memory-gb",
            "2",
            "--long-threshold",
            "1024",
            "--out",
            str(out / f"{name}-sim"),
            "--no-plots",
            "--overwrite",
            *flags,
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )
    return json.loads((out / f"{name}-sim" / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, default=0.45)
    add_common_args(ap, seed=0, out="runs/mixed_load", num_requests=200)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument(
        "--policies",
        default="lars,fcfs-none",
        help="which of lars, fcfs-none, edf to run (default: lars,fcfs-none)",
    )
    ap.add_argument(
        "--tpot-target-s",
        type=float,
        default=None,
        help="iteration budget of lars and edf (default: the server's, 6x a lone decode on CPU)",
    )
    ap.add_argument(
        "--prefix-cache", default=None, help="every server's --prefix-cache (default: its own)"
    )
    ap.add_argument(
        "--profile",
        default=None,
        help="medha's engine profile for the twin (default: the one the servers plan with, "
        "this machine's for its default dtype)",
    )
    args = ap.parse_args()
    if args.profile is None:
        from medha.engine.config import EngineConfig
        from medha.engine.setup import profile_path

        args.profile = profile_path(EngineConfig())
    out = Path(args.out)
    if args.tpot_target_s:
        for name in ("lars", "edf"):
            POLICIES[name] += ["--tpot-target-s", str(args.tpot_target_s)]
    if args.prefix_cache:
        for name in POLICIES:
            POLICIES[name] += ["--prefix-cache", args.prefix_cache]
    policies = {n: POLICIES[n] for n in args.policies.split(",")}
    measured = {name: serve_and_bench(name, flags, args, out) for name, flags in policies.items()}
    print(f"\n{args.num_requests} requests, {args.workload}, Poisson {args.qps} req/s\n")
    print(
        "| scheduler | busy | short TTFT p50 | short TTFT p99 | long completed | long TTFT "
        "p50 | short TPOT p50 |"
    )
    print("|---|---|---|---|---|---|---|")
    for name, s in measured.items():
        sh, lo = s["by_class"]["short"], s["by_class"]["long"]
        done = sum(
            1
            for line in (out / name / "requests.csv").read_text().splitlines()[1:]
            if ",long,ok," in line
        )
        print(
            f"| {name} | {s['busy_share']:.0%} | {sh['ttft_s']['p50']:.3f} s | "
            f"{sh['ttft_s']['p99']:.3f} s | {done}/{lo['count']} | "
            f"{lo['ttft_s']['p50'] or float('nan'):.1f} s | {sh['tpot_s']['p50']:.3f} s |"
        )
    if "fcfs-none" in measured:
        fcfs = measured["fcfs-none"]["by_class"]["short"]["ttft_s"]
        for name in [n for n in measured if n != "fcfs-none"]:
            ttft = measured[name]["by_class"]["short"]["ttft_s"]
            print(
                f"\nfcfs / {name} short TTFT: p50 {fcfs['p50'] / ttft['p50']:.1f}x, "
                f"p99 {fcfs['p99'] / ttft['p99']:.1f}x (goal p99 >= 10x)"
            )
    if not os.path.exists(args.profile):
        print(f"\nno profile at {args.profile}: run `medha profile` for the twin check")
        return
    print("\n| scheduler | short TTFT p50 measured | simulated | error |")
    print("|---|---|---|---|")
    for name, flags in policies.items():
        sim = simulate(name, flags, args.profile, out)["by_class"]["short"]["ttft_s"]["p50"]
        real = measured[name]["by_class"]["short"]["ttft_s"]["p50"]
        print(f"| {name} | {real:.3f} s | {sim:.3f} s | {(sim - real) / real:+.0%} |")


if __name__ == "__main__":
    main()
