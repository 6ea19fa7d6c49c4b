"""The deferred-prefill policy's throughput over the departure threshold K, three ways:
Proposition 1's closed form and the exact renewal model (medha/analysis/deferred_prefill.py),
and the real scheduler in the simulator (deferred_prefill_sim.py). `medha analyze
deferred-prefill` (medha/cli/analyze.py) prints it; bench/sim_deferred_prefill*.py reproduce
the paper's figures from it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from medha.perf import ParallelConfig, Predictor

# The model (numpy, scipy) is imported where it is used: `medha`'s parser is built from
# DeferredPrefillArgs.
if TYPE_CHECKING:
    from medha.analysis.deferred_prefill import Costs, DeferredSystem


@dataclass
class DeferredPrefillArgs:
    batch_cap: int = field(
        default=410,
        metadata={"aliases": ("--C",), "help": ("C: most requests in the running batch")},
    )
    prompt_tokens: int = field(default=285, metadata={"help": "d_0: tokens of every prompt"})
    mean_output: int = field(
        default=201,
        metadata={
            "help": (
                "mean output tokens; outputs are geometric, each token ending its request with "
                "probability alpha = 1 / mean"
            )
        },
    )
    prefill_only_iterations: bool = field(
        default=True,
        metadata={
            "help": (
                "prefills run in iterations of their own while the decodes wait (vLLM without "
                "chunked prefill, the paper's system; default); --no-prefill-only-iterations: they "
                "ride along in decode iterations, have no fixed cost, and K = 1 is best"
            )
        },
    )
    vllm_cpu: bool = field(
        default=False,
        metadata={
            "help": (
                "add vLLM's CPU time per iteration (scheduling, inputs, sampling, outputs: "
                "2.0 ms + 0.17 ms per sequence, Vidur's A100 measurement) to the roofline "
                "predictor, in place of its own 1 ms per iteration; the cost model of "
                "bench/paper/sim_deferred_prefill_paper.py"
            )
        },
    )
    k_values: str | None = field(
        default=None,
        metadata={
            "help": (
                "K values to print, comma-separated (default: 1, 2, 3, 4, 6, 8, ... up to C/2); "
                "K=1 and each K* are always added"
            )
        },
    )
    simulate: bool = field(
        default=False,
        metadata={
            "help": (
                "also run each K in the simulator (deferred policy, whole prefills, every request "
                "queued at t=0) and print the throughput measured while the backlog lasts"
            )
        },
    )
    num_requests: int = field(
        default=6000,
        metadata={
            "help": (
                "requests per simulated K (at least 4 C; the first 2 C departures are warm-up)"
            )
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of the simulated output lengths"})

    def __post_init__(self) -> None:
        self.system()  # raises on a bad C, d_0 or mean
        self.ks(())
        if self.simulate and self.num_requests < 4 * self.batch_cap:
            raise ValueError(
                f"--num-requests must be at least 4 C = {4 * self.batch_cap} "
                f"(the first 2 C departures are warm-up), got {self.num_requests}"
            )

    def system(self) -> DeferredSystem:
        from medha.analysis.deferred_prefill import DeferredSystem

        return DeferredSystem(
            self.batch_cap,
            self.prompt_tokens,
            float(self.mean_output),
            self.prefill_only_iterations,
        )

    def ks(self, extra: tuple[int, ...]) -> list[int]:
        """The K values to print: --k-values (or the default grid), K=1 and `extra`."""
        from medha.analysis.deferred_prefill import curve_ks

        if self.k_values is None:
            return curve_ks(self.batch_cap, (1, *extra))
        try:
            ks = {int(k) for k in self.k_values.split(",") if k.strip()}
        except ValueError:
            raise ValueError(
                f"--k-values {self.k_values!r}: expected integers, e.g. 1,8,32"
            ) from None
        if not ks or min(ks) < 1 or max(ks) >= self.batch_cap:
            raise ValueError(f"--k-values must lie in 1 .. C - 1 = {self.batch_cap - 1}")
        return sorted(ks | {1, *extra})


@dataclass
class Curve:
    """Requests/s over K: Prop. 1, the renewal model and (if simulated) the simulator."""

    costs: Costs
    approx: dict[int, float]
    renewal: dict[int, float]
    k_approx: int
    k_renewal: int
    sim: dict | None = None  # K -> SimPoint

    @property
    def simulated(self) -> dict[int, float]:
        return {k: p.requests_per_s for k, p in (self.sim or {}).items()}

    @property
    def k_sim(self) -> int:
        curve = self.simulated
        return max(curve, key=curve.get)


def cost_model(args: DeferredPrefillArgs, predictor: Predictor) -> Predictor:
    """The predictor, with vLLM's CPU time added when --vllm-cpu asks for it (once)."""
    if not args.vllm_cpu:
        return predictor
    from medha.analysis.deferred_prefill_costs import VllmCpuPredictor, with_vllm_cpu

    return predictor if isinstance(predictor, VllmCpuPredictor) else with_vllm_cpu(predictor)


def compute(
    args: DeferredPrefillArgs,
    predictor: Predictor,
    cluster=None,
    parallel: ParallelConfig | None = None,
) -> Curve:
    """The curve; simulates when args.simulate (then `cluster` is required)."""
    from medha.analysis.deferred_prefill import (
        StepTimes,
        approx_throughput,
        best_k,
        fit_costs_at_optimum,
        renewal_throughput,
    )

    predictor = cost_model(args, predictor)
    system = args.system()
    times = StepTimes(predictor, system)
    costs, k_approx = fit_costs_at_optimum(times)
    k_renewal = best_k(lambda k: renewal_throughput(times, k), system.cap)
    ks = args.ks((k_approx, k_renewal))
    curve = Curve(
        costs,
        {k: approx_throughput(costs, system, k) for k in ks},
        {k: renewal_throughput(times, k) for k in ks},
        k_approx,
        k_renewal,
    )
    if args.simulate:
        curve.sim = simulate_curve(args, system, ks, predictor, cluster, parallel)
    return curve


def distance(k: int, k_ref: int) -> float:
    """|K - K_ref| / K_ref in percent."""
    return 100 * abs(k - k_ref) / k_ref


def simulate_curve(args, system, ks, predictor, cluster, parallel) -> dict:
    from medha.analysis.deferred_prefill_sim import simulate_point

    return {
        k: simulate_point(system, k, cluster, parallel, predictor, args.num_requests, args.seed)
        for k in ks
    }
