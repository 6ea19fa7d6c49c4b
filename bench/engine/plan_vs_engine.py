"""Does `medha plan` pick what a measured run finds best? SmolLM2-135M on this CPU.

    python bench/engine/plan_vs_engine.py [--qps 1.0] [--num-requests 200]

1. Writes the workload of bench/server/server_mixed_load.py (95% short prompts of 32-256 tokens, 5%
   long ones of 3,000-6,000, 16-48 output tokens, Poisson) as a trace, runs/plan_vs_engine/
   trace.csv.
2. Runs `medha plan` on it for this machine (the engine's profile from `medha profile`, one
   replica on the CPU, 2 GiB of KV) over the candidate schedulers.
3. Serves each candidate with `medha serve` and replays the same trace with `medha bench`, one
   server at a time.
4. Prints each candidate's SLO metrics, simulated and measured, and the deployment each side
   picks by the plan's own rule: the cheapest that meets every SLO (all cost the same here), the
   one with the most headroom (lowest worst metric / target) among those, or the closest to
   meeting them when none does.

Replicas are not among the candidates: two servers on two cores would share them.
"""

from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

from medha.benchmark.harness import add_common_args
from medha.benchmark.load_generator import BenchConfig, build_requests, run_bench
from medha.benchmark.local_server import local_server
from medha.plan.report import worst_over_target
from medha.plan.slo import parse_slos

WORKLOAD = "prompt=32-256,output=16-48,long_fraction=0.05,long_prompt=3000-6000"


def write_trace(path: Path, args) -> None:
    reqs = build_requests(
        trace=None, workload=WORKLOAD, qps=args.qps, num_requests=args.num_requests, seed=0
    )
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["arrived_at", "num_prefill_tokens", "num_decode_tokens"])
        for r in reqs:
            w.writerow([f"{r.arrival_s:.6f}", r.prompt_len, r.output_len])


def pick(metrics: dict[str, dict[str, float]], slos) -> tuple[str, bool]:
    """The plan's rule among deployments of equal cost: the most headroom if any meets every
    SLO, else the closest to meeting them. Returns (name, meets)."""
    worst = {n: worst_over_target(m, slos) for n, m in metrics.items()}
    best = min(worst, key=lambda n: (worst[n], n))
    return best, worst[best] <= 1


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", type=float, default=1.0)
    add_common_args(ap, out="runs/plan_vs_engine", num_requests=200)
    ap.add_argument("--candidates", default="lars,edf,fcfs/none,fcfs/static:512")
    ap.add_argument(
        "--slo",
        # the TPOT target sits above the CPU's default iteration budget (6x a lone decode,
        # ~0.13 s here), which every chunking scheduler fills by design
        default="short-ttft-p99=0.5,tpot-p99=0.2",
        help="the plan's SLOs (default: short-ttft-p99=0.5,tpot-p99=0.2)",
    )
    ap.add_argument("--profile", default=None, help="engine profile (default: this machine's)")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.profile is None:
        from medha.engine.config import EngineConfig
        from medha.engine.setup import profile_path

        args.profile = profile_path(EngineConfig())
    if not Path(args.profile).is_file():
        sys.exit(f"no profile at {args.profile}: run `medha profile` first")
    slos = parse_slos(args.slo)
    trace = out / "trace.csv"
    write_trace(trace, args)
    candidates = args.candidates.split(",")

    subprocess.run(
        [
            sys.executable, "-m", "medha", "plan", "--trace", str(trace),
            "--model", "smollm2-135m", "--hardware", "cpu", "--predictor",
            f"profiled:{args.profile}", "--kv-memory-gb", "2", "--long-threshold", "1024",
            "--tp", "1", "--replicas", "1", "--schedulers", args.candidates, "--slo", args.slo,
            "--capacity-top", "0", "--backend", "serial", "--quiet", "--no-plots", "--fresh",
            "--out", str(out / "plan"),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
    )  # fmt: skip
    plan = json.loads((out / "plan" / "plan.json").read_text())
    simulated = {d["point"]["scheduler"]: d["metrics"] for d in plan["deployments"]}
    planned = (plan["best"] or {}).get("label") or plan["infeasible"]["closest"]["label"]
    planned = next(d["point"]["scheduler"] for d in plan["deployments"] if d["label"] == planned)

    measured = {}
    for name in candidates:
        policy, _, chunking = name.partition("/")
        flags = ["--policy", policy] + (["--chunking", chunking] if chunking else [])

        def command(port: int, flags=flags) -> list[str]:
            return [sys.executable, "-m", "medha", "serve", "--port", str(port),
                    "--log-level", "warning", *flags]  # fmt: skip

        with local_server(command) as url:
            summary = run_bench(
                BenchConfig(
                    url=url,
                    trace=str(trace),
                    num_requests=args.num_requests,
                    long_threshold=1024,
                    out=str(out / name.replace("/", "-").replace(":", "")),
                )
            )
        measured[name] = {s.name: s.value(summary) for s in slos}

    print(f"\n{args.num_requests} requests, {WORKLOAD}, Poisson {args.qps} req/s; SLO {args.slo}\n")
    print("| scheduler | " + " | ".join(f"{s.name} simulated | measured" for s in slos) + " |")
    print("|---|" + "---|---|" * len(slos))
    for name in candidates:
        cells = " | ".join(
            f"{simulated[name][s.name]:.3f} s | {measured[name][s.name]:.3f} s" for s in slos
        )
        print(f"| {name} | {cells} |")
    measured_pick, met = pick(measured, slos)
    print(
        f"\nmedha plan picks {planned}; measured, the best is {measured_pick} "
        f"({'meets every SLO' if met else 'closest to the SLOs'}): "
        + ("the same" if planned == measured_pick else "different")
    )


if __name__ == "__main__":
    main()
