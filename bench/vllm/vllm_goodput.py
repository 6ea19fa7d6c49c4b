"""Goodput on a mixed trace with long prompts: medha's defaults against vLLM as users tune it.

    python bench/vllm/vllm_goodput.py [--trace azure_code] [--rates R1,R2,...] \
        [--num-requests 24] [--rounds 2] [--engine-medha '{}'] [--peer ARGS ... | --tuned-peers] \
        [--slo 'ttft=2,tpot=0.2' ...] [--bind 0-1]

Every contender (medha/benchmark/vllm_servers.py: plain vLLM, vLLM with its own convoy flags,
medha's scheduler on vLLM, `medha serve` on medha's own engine; one server at a time, the order
flipped every round) is driven by medha's load generator (`medha bench`: streamed completions of
token-id prompts, EOS ignored) at each Poisson rate in turn, with the same requests at a rate
for every contender of a round. The lengths are the trace's, each prompt capped so that prompt
plus output fit the context (8,192 for SmolLM2).

The load and the targets default to this machine's pace (harness.paced_load): plain vLLM,
started once before the rounds, times a prompt alone at the middle of each fifth of the trace's
lengths, whose mean `t` is the trace's mean time alone; the rates are 0.35, 0.7 and 1.0 / t
(saturation is near 1 / t), the TTFT targets 2t, and 1 s plus each prompt's own time at the
trace's pace (t over its mean prompt, a token); TPOT 0.2 s. It prints the --rates and --slo
that repeat them without the probe.

Goodput as `vllm bench serve --goodput` defines it: the requests that meet every SLO, over the
run's duration (first send to last completion). SLOs are judged after the runs on each
request's TTFT and TPOT, so one run gives every --slo's goodput; the servers are not told them
(medha's defaults: no request carries an SLO of its own), except with --send-slo, which runs
each medha contender again with every request carrying the first --slo's targets (the medha
extension of the API: vLLM's has no field for them; `--send-slo ttft`, the TTFT deadline
alone). A --peer with `--scheduling-policy priority` gets each request's prompt length as its
`priority` (vLLM's API field): the shortest waiting prompt goes first, the tuning vLLM offers a
mixed load beside its convoy flags.
`ttft=A+B*prompt` scales a request's TTFT target with its prompt, as the Medha paper's
deadlines do. Each single server keeps a step log (MEDHA_STEP_LOG, in --out), and the last
table gives the iteration budgets each medha server's batches ran in, run by run: a server
resolves its defaults again as its model is corrected, and a run whose budget moved ran part of
its requests in other steps.

    python bench/vllm/vllm_goodput.py --replicas 2 \
        [--router medha-slack --router sglang-cache_aware]

Each contender as two replicas behind a router (issue 69's item d): replica i bound to the i-th
core (taskset; a vLLM replica's OpenMP threads too, VLLM_CPU_OMP_THREADS_BIND), each on the
same flags as the single server, the pair behind each --router in turn (medha/benchmark/
routers.py: `medha route` with a dispatcher, SGLang's or vLLM's router with a policy; the peers
installed as `bench/route/route_slo.py --install-peers` installs them). Replicas and router
start fresh for every contender of every round. "Best vLLM" at a rate and SLO is
the vLLM setting with the highest median goodput there, chosen after the runs (it favours the
peer); a table gives each medha contender's goodput over it.
"""

from __future__ import annotations

import argparse
import csv
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from medha.benchmark.config import BenchConfig
from medha.benchmark.harness import (
    add_common_args,
    goodput,
    paced_lengths,
    paced_load,
    parse_slo,
    times_alone,
)
from medha.benchmark.load_generator import run_bench
from medha.benchmark.local_server import alternated, local_server
from medha.benchmark.routers import (
    CONTENDERS,
    check_installed,
    pinned,
    running_router,
    serving_replicas,
)
from medha.benchmark.step_errors import budgets_between
from medha.benchmark.vllm_servers import (
    Contender,
    add_contender_args,
    add_server_args,
    contenders,
    server_env,
    server_flags,
)
from medha.core.config import default_long_threshold
from medha.sim.workload.traces import load_trace


def capped_trace(name: str, context: int, path: Path) -> Path:
    """The trace's lengths, each prompt cut so that prompt + output <= `context`, as a CSV
    `medha bench --trace` reads (no times: the rate is --qps)."""
    with path.open("w", newline="") as fh:
        w = csv.writer(fh)
        w.writerow(["num_prefill_tokens", "num_decode_tokens"])
        for e in load_trace(name):
            out = min(e.output_len, context // 2)
            w.writerow([max(1, min(e.prompt_len, context - out)), out])
    return path


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--trace", default="azure_code", help="a bundled trace or a CSV/JSONL file")
    ap.add_argument(
        "--rates",
        type=lambda s: [float(x) for x in s.split(",")],
        default=None,
        help="Poisson rates (req/s), comma-separated, up to saturation (default: 0.35, 0.7 "
        "and 1.0 over the trace's mean prompt time alone on plain vLLM, measured first)",
    )
    ap.add_argument(
        "--slo",
        action="append",
        type=parse_slo,
        default=None,
        help="'ttft=A[+B*prompt],tpot=C' in seconds; repeat (default: TTFT within twice the "
        "trace's mean prompt time alone, and within 1 s + each prompt's time at the trace's "
        "pace; TPOT 0.2 s)",
    )
    add_common_args(
        ap,
        out=None,
        out_help="folder of every run's requests.csv (default: a new temporary folder)",
        num_requests=24,
        num_requests_help="requests at each rate",
    )
    ap.add_argument(
        "--send-slo",
        action="append",
        nargs="?",
        const="both",
        choices=["both", "ttft"],
        help="run each medha contender again each round ('told') with every request carrying "
        "the first --slo's targets in the medha extension, as medha's API allows and vLLM's "
        "does not; `--send-slo ttft`: the TTFT deadline alone, to tell what the TPOT target "
        "changes; repeat for both",
    )
    ap.add_argument(
        "--replicas",
        type=int,
        default=1,
        help="each contender as N replicas, one core each, behind each --router (default 1: "
        "one server on every core, no router)",
    )
    ap.add_argument(
        "--router",
        action="append",
        default=None,
        choices=CONTENDERS,
        help="with --replicas: a router every contender's replicas run behind in turn; repeat "
        "(default: medha-slack and sglang-cache_aware)",
    )
    ap.add_argument("--verbose", action="store_true", help="the servers' logs")
    add_server_args(ap)
    add_contender_args(ap)
    args = ap.parse_args()
    if args.replicas < 1 or (args.router and args.replicas < 2):
        ap.error("--replicas takes a positive count, and --router needs --replicas 2 or more")
    flags = server_flags(args)
    servers = contenders(args, flags)
    out = Path(args.out or tempfile.mkdtemp(prefix="vllm-goodput-"))
    out.mkdir(parents=True, exist_ok=True)
    trace = capped_trace(args.trace, flags.max_model_len, out / "trace.csv")
    print(f"every run's requests.csv under {out}", file=sys.stderr)
    # SGLang's router takes no token ids: with routers, every contender gets the same lengths
    # as text (one SmolLM2 token a word)
    endpoint = "text" if args.replicas > 1 else "completions"
    rates, slo_specs = args.rates, None
    if rates is None or args.slo is None:
        rates, slo_specs = paced(args, servers["vLLM"], trace, endpoint, args.rates)
    slos = args.slo or [parse_slo(s) for s in slo_specs]
    # the medha contenders run again with their requests carrying slos[0]: name -> whether
    # the TPOT target goes too
    told = {}
    medha = {n: c for n, c in servers.items() if c.medha is not None}
    for what in dict.fromkeys(args.send_slo or ()):
        label = "the SLO" if what == "both" else "the TTFT deadline"
        told.update({f"{n}, told {label}": what == "both" for n in medha})
        servers.update({f"{n}, told {label}": c for n, c in medha.items()})
    routers = {}  # contender -> the router its replicas run behind (--replicas)
    if args.replicas > 1:
        names = args.router or ["medha-slack", "sglang-cache_aware"]
        for name in names:
            check_installed(name)
        routers = {f"{n} behind {r}": r for n in servers for r in names}
        servers = {f"{n} behind {r}": servers[n] for n in servers for r in names}
        told = {f"{n} behind {r}": tpot for n, tpot in told.items() for r in names}
    ttft, per_token, tpot = slos[0]
    runs = []  # (name, round, rate, folder, wall_s, errors, {budget: batches} of its step log)
    for rnd, name in alternated(list(servers), args.rounds):
        # (a single medha server's step log: the budgets its defaults resolved, run by run)
        step_log = str(out / f"{rnd}-{name.replace(' ', '_')}-steps.jsonl")
        with serving(args, servers[name], routers.get(name), step_log) as url:
            warm = BenchConfig(url=url, workload="prompt=64,output=8", qps=4.0, num_requests=4,
                               model="m", endpoint=endpoint,
                               out=str(out / "warm-up"))  # fmt: skip
            run_bench(warm, progress=False)
            for i, rate in enumerate(rates):
                folder = out / f"{rnd}-{name.replace(' ', '_')}-{rate}"
                cfg = BenchConfig(
                    url=url,
                    model="m",  # (every server's name for it; SGLang's router lists "unknown")
                    endpoint=endpoint,
                    long_threshold=default_long_threshold(flags.max_model_len),
                    trace=str(trace),
                    qps=rate,
                    num_requests=args.num_requests,
                    seed=100 * rnd + i,  # (the same requests for every contender of a round)
                    out=str(folder),
                    ttft_slo_s=ttft,
                    ttft_slo_per_token_s=per_token,
                    tpot_slo_s=tpot,
                    send_slo=name in told,
                    send_tpot_slo=told.get(name, True),
                    send_priority=servers[name].priority,
                )
                began = time.monotonic()
                summary = run_bench(cfg, progress=False)
                budgets = budgets_between(step_log, began, time.monotonic())
                wall, errors = summary["client"]["wall_s"], summary["client"]["errors"]
                runs.append((name, rnd, rate, folder, wall, errors, budgets))
                shown = ", ".join(f"{goodput(folder, s, wall):.3f}" for s in slos)
                print(
                    f"round {rnd} {name} at {rate} req/s: {wall:.0f} s, {errors} errors, "
                    f"goodput {shown} req/s"
                    + (f", budgets {shown_budgets(budgets)}" if budgets else ""),
                    file=sys.stderr,
                    flush=True,
                )
    report(runs, servers, rates, slos, flags, args)


def paced(args, plain: Contender, trace: Path, endpoint: str, rates) -> tuple[list[float], list]:
    """The rates (`rates` where given) and SLO specs of this machine's pace: plain vLLM, alone
    on the bench's cores (one server on all of them, even with --replicas), times a prompt at
    the middle of each fifth of the trace's lengths; their mean is the trace's mean time alone
    (harness.paced_load)."""
    with trace.open() as fh:
        prompts = [int(row["num_prefill_tokens"]) for row in csv.DictReader(fh)]
    lengths = paced_lengths(prompts)
    print(f"timing prompts of {', '.join(map(str, lengths))} tokens alone on plain vLLM ...",
          file=sys.stderr, flush=True)  # fmt: skip
    with serving(args, plain, None, None) as url:
        times = times_alone(url, lengths, model="m", endpoint=endpoint)
    alone = statistics.fmean(times)
    paced_rates, slos = paced_load(alone, statistics.fmean(prompts))
    rates = rates or paced_rates
    print(
        f"they took {', '.join(f'{t:.2f}' for t in times)} s, {alone:.2f} s on average: "
        f"--rates {','.join(f'{r:g}' for r in rates)} " + " ".join(f"--slo '{s}'" for s in slos),
        file=sys.stderr,
        flush=True,
    )
    return rates, slos


def shown_budgets(budgets: dict[float, int]) -> str:
    """`0.15 s (412 batches)`, or each budget a server's defaults moved to within the run."""
    return ", then ".join(f"{b:.4g} s ({n} batches)" for b, n in budgets.items())


@contextmanager
def serving(args, contender: Contender, router: str | None, step_log: str) -> Iterator[str]:
    """The base URL of `contender`'s server, its batches logged to `step_log` (a medha
    server's); with --replicas, of `router` in front of that many replicas of it, replica i
    bound to the i-th core (no step log: the replicas would share the file)."""
    env = server_env(args, contender, step_log if router is None else None)
    log = sys.stderr if args.verbose else None  # (None: the replicas' and router's output dropped)
    if router is None:
        with local_server(contender.command, quiet=not args.verbose, env=env) as url:
            yield url
        return

    def replica_env(core: int | None) -> dict:
        if contender.engine or core is None:
            return env
        return env | {"VLLM_CPU_OMP_THREADS_BIND": str(core)}

    def command(port: int, core: int | None) -> list[str]:
        return pinned(contender.command(port), core)

    with serving_replicas(
        args.replicas, [], log=log, startup_s=900.0, command=command, env=replica_env
    ) as replicas:
        with running_router(router, replicas, log=log) as (url, _, _):
            yield url


def slo_label(slo: tuple[float, float, float]) -> str:
    ttft = f"{slo[0]:g} s" + (f" + {slo[1] * 1e3:g} ms/token" if slo[1] else "")
    return f"TTFT <= {ttft}, TPOT <= {slo[2]:g} s"


def report(runs, servers, rates, slos, flags, args) -> None:
    print(f"\n{flags}; trace {args.trace} (capped to the context); {args.num_requests} requests a "
          f"rate; vLLM bound to {args.bind or 'its default'}"
          + (f"; {args.replicas} replicas a contender, one core each" if args.replicas > 1 else "")
          + "\n")  # fmt: skip
    names = list(servers)
    medians = {}  # (name, rate, slo index) -> median goodput over the rounds
    for j, slo in enumerate(slos):
        print(f"Goodput (req/s) each round (median), {slo_label(slo)}:\n")
        print("| contender | " + " | ".join(f"{r:g} req/s" for r in rates) + " |")
        print("|---|" + "---|" * len(rates))
        for name in names:
            cells = []
            for rate in rates:
                mine = [goodput(f, slo, w) for n, _, r, f, w, *_ in runs if n == name and r == rate]
                medians[name, rate, j] = statistics.median(mine)
                each = " / ".join(f"{g:.3f}" for g in mine)
                cells.append(f"{each} ({medians[name, rate, j]:.3f})")
            print(f"| {name} | " + " | ".join(cells) + " |")
        print()
    vllm = [n for n in names if servers[n].medha is None]
    print("| SLO | rate | best vLLM setting | its goodput | " + " | ".join(
        f"{n} / best" for n in names if servers[n].medha is not None) + " |")  # fmt: skip
    print("|---|---|---|---|" + "---|" * sum(servers[n].medha is not None for n in names))
    for j, slo in enumerate(slos):
        for rate in rates:
            best = max(vllm, key=lambda n: medians[n, rate, j])
            top = medians[best, rate, j]
            ratios = [
                f"{medians[n, rate, j] / top:.2f}x" if top else "-"
                for n in names
                if servers[n].medha is not None
            ]
            print(
                f"| {slo_label(slo)} | {rate:g} | {best} | {top:.3f} | " + " | ".join(ratios) + " |"
            )
    logged = [(n, rnd, rate, budgets) for n, rnd, rate, _, _, _, budgets in runs if budgets]
    if logged:
        # (a medha server resolves its defaults again as its model is corrected: a run whose
        # budget moved ran part of its requests in other steps than the rest)
        print("\nmedha's iteration budget in each run (its step log; batches planned in it):\n")
        print("| contender | round | rate | budgets |\n|---|---|---|---|")
        for name, rnd, rate, budgets in logged:
            print(f"| {name} | {rnd} | {rate:g} | {shown_budgets(budgets)} |")
    errors = sum(r[5] for r in runs)
    if errors:
        print(f"\n{errors} requests failed in all (see each run's requests.csv)")


if __name__ == "__main__":
    main()
