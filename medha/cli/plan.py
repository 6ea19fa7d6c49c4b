"""`medha plan`: the cheapest deployment that meets a trace's SLOs, found in the simulator."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from medha.cli.common import CliError

DESCRIPTION = """\
Search deployments for a trace in the simulator: device kind, tp x spp x kvp per replica,
replicas, scheduler, iteration budget, dispatcher, KV memory. Prints the cheapest deployment
that meets every SLO, the Pareto front of cost against each SLO metric, and the capacity of the
cheapest ones (the highest multiple of the trace's request rate they sustain within the SLOs).

Each axis comes from its flag (a comma-separated list) or from a YAML file (--space) of
axis: [values]; a flag given overrides the file. Pruned, not simulated: more replicas of a
deployment that already meets the SLOs, deployments over --budget, and every rate above one
where a deployment misses an SLO. Simulations run on Ray where it is installed (locally with no
set-up, or on a cluster with --ray-address), else on a process pool. Results stream into
OUT/points.jsonl; rerunning the same plan takes the points it finds there (--fresh ignores
them). Writes plan.json, plan.md, pareto.png and capacity.png to --out.

Example:
  medha plan --trace azure_conv --num-requests 10000 --model llama-3-8b \\
      --hardware h100,a100 --tp 1,2,4 --replicas 1,2,4,8 --schedulers lars,fcfs/none \\
      --slo ttft-p99=2,tpot-p99=0.1
"""

AXIS_FLAGS = {
    "hardware": ("--hardware", "device kinds, e.g. h100,a100 (default: h100)"),
    "tp": ("--tp", "tensor-parallel degrees (default: 1,2,4,8)"),
    "spp": ("--spp", "stream-pipeline stages (default: 1)"),
    "kvp": ("--kvp", "KV-cache parallel groups (default: 1)"),
    "replicas": ("--replicas", "replica counts (default: 1,2,4,8)"),
    "scheduler": (
        "--schedulers",
        "POLICY[/CHUNKING] each, e.g. lars,edf,fcfs/none,fcfs/static:512 (default: lars,fcfs/none)",
    ),
    "iteration_budget_s": (
        "--iteration-budget-s",
        "iteration budgets in seconds; 'default' for the scheduler's (default: default)",
    ),
    "dispatcher": (
        "--dispatchers",
        "round_robin, least_work, prefix, slack, pla: the classes `medha route --dispatcher` "
        "runs (default: round_robin)",
    ),
    "kv_memory_gb": (
        "--kv-memory-gb",
        "KV memory per device in GiB; 'default' for what the device has left (default: default)",
    ),
}


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "plan",
        help="search the cheapest deployment that meets SLOs on a trace",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    w = p.add_argument_group("workload and model (fixed for every simulation)")
    w.add_argument("--trace", required=True, help="a bundled trace name or a CSV/JSONL file")
    w.add_argument("--num-requests", type=int, default=None, help="requests of the trace to use")
    w.add_argument(
        "--qps", type=float, default=None, help="arrival rate for traces without timestamps"
    )
    w.add_argument(
        "--long-fraction",
        type=float,
        default=0.0,
        help="fraction of requests replaced by long-context ones drawn like Medha-SWE, as in "
        "medha simulate (default: 0)",
    )
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--model", default="llama-3-8b", help="model spec (default: llama-3-8b)")
    w.add_argument("--predictor", default="roofline", help="batch-time model, as in medha simulate")
    w.add_argument(
        "--long-threshold",
        type=int,
        default=None,
        help="prompt tokens from which a request is long (for short-/long- SLOs)",
    )
    s = p.add_argument_group("search space")
    s.add_argument("--space", metavar="YAML", help="axes (and max_devices) from a YAML file")
    for key, (flag, text) in AXIS_FLAGS.items():
        s.add_argument(flag, dest=f"axis_{key}", metavar="LIST", default=None, help=text)
    s.add_argument("--max-devices", type=int, default=None, help="most devices per deployment")
    g = p.add_argument_group("goals and costs")
    g.add_argument(
        "--slo",
        required=True,
        help="targets in seconds: [short-|long-]METRIC-STAT=S, comma-separated, METRIC one of "
        "ttft, tpot, tbt, e2e and STAT one of p50, p90, p99, mean, max; e.g. "
        "ttft-p99=2,tpot-p99=0.1,short-ttft-p99=0.5",
    )
    g.add_argument("--budget", type=float, default=None, help="most US$ per hour to consider")
    g.add_argument(
        "--prices",
        default=None,
        help="US$ per device-hour, KIND=PRICE comma-separated, over the defaults "
        "(a100=3, h100=5, h200=6.5, cpu=0.1: illustrative, set your own)",
    )
    g.add_argument(
        "--capacity-top",
        type=int,
        default=3,
        help="search the capacity of the this many cheapest deployments that meet the SLOs "
        "(default: 3; 0 skips it)",
    )
    g.add_argument("--max-rate", type=float, default=64.0, help="highest rate multiple tried")
    g.add_argument(
        "--capacity-steps", type=int, default=5, help="bisection steps of the capacity search"
    )
    r = p.add_argument_group("running")
    r.add_argument(
        "--backend",
        default="auto",
        choices=("auto", "ray", "processes", "serial"),
        help="where simulations run (default: ray if installed, else a process pool)",
    )
    r.add_argument(
        "--workers", type=int, default=None, help="parallel simulations (default: cores)"
    )
    r.add_argument(
        "--ray-address", default=None, help="a running Ray cluster, e.g. auto or ray://h:10001"
    )
    r.add_argument("--out", default="plan-out", help="output directory (default: plan-out)")
    r.add_argument("--fresh", action="store_true", help="ignore the results of an earlier run")
    r.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    r.add_argument("--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def build_space(args):
    from medha.plan.space import SearchSpace, SpaceError, parse_list

    data: dict = {}
    if args.space:
        import yaml

        try:
            data = yaml.safe_load(Path(args.space).read_text()) or {}
        except OSError as e:
            raise CliError(f"--space {args.space}: {e.strerror or e}") from None
        except yaml.YAMLError as e:
            raise CliError(f"--space {args.space}: not valid YAML ({e})") from None
        if not isinstance(data, dict):
            raise CliError(f"--space {args.space}: expected a mapping of axis names to lists")
    for key in AXIS_FLAGS:
        value = getattr(args, f"axis_{key}")
        if value is not None:
            data[key] = parse_list(value)
    if args.max_devices is not None:
        data["max_devices"] = args.max_devices
    try:
        return SearchSpace.from_mapping(data)
    except SpaceError as e:
        raise CliError(f"search space: {e}") from None


def run(args: argparse.Namespace) -> None:
    from medha.plan import planner
    from medha.plan.search import Fixed, make_backend

    slos, prices, space = _check_args(args)
    fixed = Fixed(
        model=args.model,
        trace=args.trace,
        num_requests=args.num_requests,
        qps=args.qps,
        long_fraction=args.long_fraction,
        seed=args.seed,
        predictor=args.predictor,
        long_threshold=args.long_threshold,
    )
    num_requests = _check_workload(fixed)
    out = Path(args.out)
    if out.exists() and not out.is_dir():
        raise CliError(f"--out {out}: exists and is not a directory")
    out.mkdir(parents=True, exist_ok=True)
    results = out / "points.jsonl"
    if args.fresh and results.exists():
        results.unlink()

    try:
        backend = make_backend(args.backend, args.workers, args.ray_address)
    except (ValueError, ImportError) as e:
        raise CliError(f"--backend {args.backend}: {e}") from None
    print(
        f"plan: {space.grid_size} deployments in the grid, {num_requests} requests of "
        f"{args.trace}, {len(slos)} SLO(s); {backend.workers} worker(s) on {backend.name}",
        file=sys.stderr,
    )
    progress = None
    if not args.quiet:
        from tqdm import tqdm

        progress = tqdm(desc="simulations", unit="sim", file=sys.stderr)
    try:
        searched = planner.search(
            fixed,
            space,
            slos,
            prices,
            backend,
            results,
            budget=args.budget,
            capacity_top=args.capacity_top,
            max_rate=args.max_rate,
            capacity_steps=args.capacity_steps,
            progress=progress,
        )
    finally:
        if progress is not None:
            progress.close()
        backend.close()

    plan = planner.build(searched, fixed, space, slos, prices)
    text = planner.write(out, plan, searched, slos, plots=not args.no_plots)
    print(text)
    print(f"results in {out}/")


def _check_args(args: argparse.Namespace):
    """The SLOs, the prices and the search space the flags give, each checked."""
    from medha.plan.cost import parse_prices
    from medha.plan.slo import parse_slos

    try:
        slos = parse_slos(args.slo)
        prices = parse_prices(args.prices)
    except ValueError as e:
        raise CliError(str(e)) from None
    space = build_space(args)
    missing = sorted({hw for hw in space.axes["hardware"]} - prices.keys())
    if missing:
        raise CliError(f"--prices: no price for {', '.join(missing)}")
    for name, value, low in (
        ("--budget", args.budget, 0),
        ("--max-rate", args.max_rate, 1),
        ("--workers", args.workers, 1),
    ):
        if value is not None and not (value >= low and math.isfinite(value)):
            raise CliError(f"{name}: {value!r} must be a number >= {low}")
    if args.capacity_top < 0 or args.capacity_steps < 0:
        raise CliError("--capacity-top and --capacity-steps must be >= 0")
    return slos, prices, space


def _check_workload(fixed) -> int:
    """The trace reads and has what the plan needs, before any worker starts."""
    from medha.sim.workload.generator import build_requests
    from medha.sim.workload.traces import TraceError

    try:
        return len(build_requests(fixed.workload(), max_context=1 << 30))
    except (TraceError, ValueError, OSError) as e:
        raise CliError(f"--trace {fixed.trace}: {e}") from None
