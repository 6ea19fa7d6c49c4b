"""Mixed load on vLLM's engine: vLLM's scheduler against medha's, plus the digital twin.

    python bench/vllm/vllm_mixed_load.py [--qps 1.0,2.0] [--num-requests 150] [--rounds 1]

SmolLM2-135M on this machine, every server with the same flags
(medha/benchmark/vllm_servers.py). The workload of bench/server/server_mixed_load.py: 95% prompts of
32-256 tokens, 5% of 3,000-6,000, 16-48 output tokens, Poisson arrivals, the same request list
for every server (seeded), driven by `medha bench`. Contenders, one server at a time,
alternated within each round:

- vLLM: its own scheduler (chunked prefill, running requests first);
- medha lars: lars with adaptive chunking, the packer planning with the vLLM profile of this
  machine (`medha profile --engine vllm`) when there is one;
- medha fcfs: fcfs with static 2,048-token chunks (vLLM's policy, run by medha's scheduler);
- with --peer ARGS (repeatable), vLLM with its own convoy flags as a user tunes them, e.g.
  `--peer '--long-prefill-token-threshold 256'`.

Reported per rate: short-request TTFT p50/p90/p99, long requests completed, output tokens/s;
vLLM / medha lars for the short TTFT p99 (goal >= 5x) and output throughput (goal >= 0.95x),
and, with peers, the same against the vLLM setting with the lowest short TTFT p99 of the
round (chosen after the runs: it favours the peer).
Then each medha run's requests are replayed in `medha simulate` with the vLLM profile, and its
short TTFT p50 compared with the measured one (goal: within 30%), and its mean.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

from medha.benchmark.harness import add_common_args
from medha.benchmark.load_generator import BenchConfig, run_bench
from medha.benchmark.local_server import alternated, local_server
from medha.benchmark.vllm_servers import (
    add_peer_arg,
    add_server_args,
    server_command,
    server_flags,
)

WORKLOAD = "prompt=32-256,output=16-48,long_fraction=0.05,long_prompt=3000-6000"
LONG_THRESHOLD = 1024
STATS = ("p50", "mean")  # of the short TTFT, measured against the twin
CONTENDERS = {
    "vLLM": None,
    "medha lars": {"policy": "lars", "chunking": "adaptive"},
    "medha fcfs": {"policy": "fcfs", "chunking": "static:2048"},
}


def bench_one(name: str, medha, args, flags, qps: float, out: Path) -> dict:
    peer = name.removeprefix("vLLM") if medha is None else ""  # ("vLLM ARGS": a tuned peer)
    command = server_command(flags, medha, args.front, peer)
    with local_server(command, quiet=not args.verbose) as url:
        # one request first: the first forward passes of a fresh server are slow
        warmup = BenchConfig(
            url=url, workload="prompt=32-256,output=16", qps=4, num_requests=2, seed=99
        )
        warmup.out = str(out / "warmup")
        run_bench(warmup, progress=False)
        return run_bench(
            BenchConfig(
                url=url,
                workload=args.workload,
                qps=qps,
                num_requests=args.num_requests,
                seed=args.seed,
                long_threshold=LONG_THRESHOLD,
                out=str(out / name.replace(" ", "-")),
            ),
            progress=not args.quiet,
        )


def long_completed(run_dir: Path) -> tuple[int, int]:
    lines = (run_dir / "requests.csv").read_text().splitlines()[1:]
    longs = [line for line in lines if ",long," in line]
    return sum(",long,ok," in line for line in longs), len(longs)


def simulate(run_dir: Path, medha: dict, profile: str, flags) -> dict:
    """Replay a run's requests (their measured arrival times and lengths) in the simulator."""
    out = run_dir.parent / (run_dir.name + "-sim")
    cmd = [sys.executable, "-m", "medha", "simulate", "--model", "smollm2-135m"]
    cmd += ["--hardware", "cpu", "--predictor", f"profiled:{profile}"]
    cmd += ["--trace", str(run_dir / "requests.csv")]
    cmd += ["--kv-memory-gb", str(kv_gib_at_fp32(flags, profile))]
    cmd += ["--long-threshold", str(LONG_THRESHOLD), "--out", str(out), "--no-plots"]
    cmd += ["--overwrite", "--max-batch-tokens", str(flags.max_num_batched_tokens)]
    cmd += ["--max-num-seqs", str(flags.max_num_seqs)]
    for key, value in medha.items():
        cmd += ["--" + key.replace("_", "-"), str(value)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads((out / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--qps", default="1.0,2.0", help="arrival rates, comma-separated")
    add_common_args(ap, seed=0, out="runs/vllm_mixed_load", num_requests=150)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help="comma-separated")
    add_peer_arg(ap)
    ap.add_argument("--workload", default=WORKLOAD)
    ap.add_argument("--profile", default=None, help="vLLM profile (default: this machine's)")
    ap.add_argument("--quiet", action="store_true", help="no progress bars")
    ap.add_argument("--verbose", action="store_true", help="the servers' logs")
    add_server_args(ap)
    args = ap.parse_args()
    flags = server_flags(args)
    rates = [float(q) for q in args.qps.split(",")]
    peers = [f"vLLM {a}" for a in args.peer]
    names = args.contenders.split(",") + peers
    contenders = CONTENDERS | dict.fromkeys(peers)
    results: dict = {}  # (rate, round, name) -> (summary, run dir)
    for rate in rates:
        for rnd, name in alternated(names, args.rounds):
            out = Path(args.out) / f"qps{rate:g}" / f"round{rnd}"
            summary = bench_one(name, contenders[name], args, flags, rate, out)
            results[rate, rnd, name] = (summary, out / name.replace(" ", "-"))
            short = summary["by_class"]["short"]["ttft_s"]
            print(
                f"{rate:g} req/s round {rnd} {name}: short TTFT p50 {short['p50']:.3f} s "
                f"p99 {short['p99']:.3f} s",
                file=sys.stderr,
                flush=True,
            )
    print(f"\n{args.num_requests} requests, {args.workload}; {flags}; front {args.front}\n")
    print(
        "| req/s | round | scheduler | short TTFT p50 | p90 | p99 | long done | long TTFT p50 "
        "| output tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (rate, rnd, name), (s, run_dir) in results.items():
        t, lo = s["by_class"]["short"]["ttft_s"], s["by_class"]["long"]["ttft_s"]
        done, total = long_completed(run_dir)
        print(
            f"| {rate:g} | {rnd} | {name} | {t['p50']:.3f} s | {t['p90']:.3f} s | {t['p99']:.3f} s "
            f"| {done}/{total} | {lo['p50'] or float('nan'):.2f} s "
            f"| {s['throughput']['output_tokens_per_s']:.1f} |"
        )
    if "vLLM" in names and "medha lars" in names:
        print()
        for rate in rates:
            for rnd in range(args.rounds):
                plain, ours = (results[rate, rnd, n][0] for n in ("vLLM", "medha lars"))
                p99 = plain["by_class"]["short"]["ttft_s"]["p99"]
                p99 /= ours["by_class"]["short"]["ttft_s"]["p99"]
                tput = ours["throughput"]["output_tokens_per_s"]
                tput /= plain["throughput"]["output_tokens_per_s"]
                print(
                    f"{rate:g} req/s round {rnd}: short TTFT p99 vLLM / medha lars {p99:.1f}x "
                    f"(goal >= 5x); output throughput medha lars / vLLM {tput:.2f} (goal >= 0.95)"
                )
                if args.peer:
                    best_vs_lars(results, rate, rnd, [n for n in names if n.startswith("vLLM")])
    profile = args.profile or default_profile(flags)
    if profile is None or not Path(profile).exists():
        print(f"\nno vLLM profile ({profile}): run `medha profile --engine vllm` for the twin")
        return
    print(f"\nDigital twin: `medha simulate` with {profile}\n")
    print(
        "| req/s | round | scheduler | short TTFT p50 measured | simulated | error "
        "| short TTFT mean measured | simulated | error |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for (rate, rnd, name), (s, run_dir) in results.items():
        if name.startswith("vLLM "):
            continue  # (a tuned peer: the twin models vLLM's defaults only)
        # vLLM's own scheduler is simulated as medha's fcfs with vLLM's 2,048-token chunks
        ours = CONTENDERS[name]
        medha = ours | flags.medha_extra if ours else CONTENDERS["medha fcfs"]
        sim = simulate(run_dir, medha, profile, flags)["by_class"]["short"]["ttft_s"]
        real = s["by_class"]["short"]["ttft_s"]
        label = name if CONTENDERS[name] else f"{name} (simulated as medha fcfs)"
        # the p50 is the goal's figure; the mean beside it, because where about half the
        # short requests arrive during a long prefill the p50 falls between the two modes
        # (served at once, or sharing steps with the prefill) and a small shift moves it far
        cells = [f"{real[k]:.3f} s | {sim[k]:.3f} s | {sim[k] / real[k] - 1:+.0%}" for k in STATS]
        print(f"| {rate:g} | {rnd} | {label} | " + " | ".join(cells) + " |")


def best_vs_lars(results: dict, rate: float, rnd: int, vllm: list[str]) -> None:
    """medha lars against the vLLM setting with the lowest short TTFT p99 of the round."""

    def p99(name: str) -> float:
        return results[rate, rnd, name][0]["by_class"]["short"]["ttft_s"]["p99"]

    def tput(name: str) -> float:
        return results[rate, rnd, name][0]["throughput"]["output_tokens_per_s"]

    best = min(vllm, key=p99)
    print(
        f"{rate:g} req/s round {rnd}: best vLLM on the short TTFT p99 is {best}: {best} / medha "
        f"lars {p99(best) / p99('medha lars'):.1f}x; output throughput medha lars / it "
        f"{tput('medha lars') / tput(best):.2f}"
    )


def default_profile(flags) -> str | None:
    """This machine's vLLM profile for the servers' dtype (auto: the one vLLM resolved, of
    the dtypes profiled here, bfloat16 first)."""
    try:
        from medha.vllm_executor.settings import vllm_profile_path
    except ImportError:
        return None
    dtypes = ("bfloat16", "float16", "float32") if flags.dtype == "auto" else (flags.dtype,)
    paths = [vllm_profile_path(flags.model, "cpu", d) for d in dtypes]
    return str(next((p for p in paths if p.exists()), paths[0]))


def kv_gib_at_fp32(flags, profile: str) -> float:
    """The simulator's CPU hardware counts KV in fp32: the GiB that hold as many tokens as the
    servers' KV cache in their dtype (read from the profile's name)."""
    return flags.kv_gib * (2 if "16" in Path(profile).stem.rsplit("-", 1)[-1] else 1)


if __name__ == "__main__":
    main()
