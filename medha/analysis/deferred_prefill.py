"""Throughput of deferred prefill as a function of the departure threshold K.

The system (Mohanty et al., EuroMLSys 2025): a batch of at most C requests, an endless backlog
of prompts of d_0 tokens, outputs geometric with per-step finish probability alpha. After K or
more requests have left, the departed slots are refilled by one prefill of all D >= K new
prompts. The model below was first derived here from the paper's abstract alone; with its
text at hand (issue 31) it is the paper's: `renewal_throughput` is its Theorem 1 evaluated
exactly (its C - E[X_S] is our E[D]), `approx_throughput` its Proposition 1.

Renewal argument. Remaining output lengths are memoryless, so every cycle starts in the same
state (C requests, each leaving with probability alpha per step): cycles are independent and
alike, and throughput = E[D] / E[cycle time]. A cycle is a prefill of D prompts, costing g(D),
then decode steps until K have left; a step with n requests costs f(n). Departures follow a
Markov chain on j = requests gone so far (j < K): a step takes Binomial(C - j, alpha) more.
`cycle_means` solves that chain for E[T] (steps), E[D] and E[sum f(n_t)], exactly
(Theorem 1: rho(K) = E[D] / (E[g(D)] + E[sum f(n_t)])). The paper evaluates E[X_S] and E[N]
numerically too (its Remark 1) but does not say how; this is one exact way.

Proposition 1 (the paper's closed form). With linear costs g(D) = c_p + t_p d_0 D and
f(n) = c_d + t_d n, the decode tokens of a cycle are E[D] / alpha (each request-step ends a
request with probability alpha), so

    1 / rho(K) = (c_p + c_d E[T]) / E[D] + t_d / alpha + t_p d_0,

and the fluid limit (n_t = C (1 - alpha)^t, D = K) gives E[T] ~ ln(1 - K/C) / ln(1 - alpha):

    1 / rho(K) ~ (c_p + c_d ln(1 - K/C) / ln(1 - alpha)) / K + t_d / alpha + t_p d_0.

The paper writes the last term t_p d_0 / N (N tokens computed in parallel in t_p); our t_p is
the time per prompt token, so N = 1 here. It does
not depend on K and moves the curve, not K*. Deferring pays c_p once per K prompts instead of
once per prompt, and costs c_d for each extra step the shrinking batch needs: K* balances the
two. Without a fixed prefill cost (c_p = 0: prefills ride along in decode iterations) K = 1 is
best.

Fitting. c_p, t_p, c_d, t_d are least-squares lines through the predictor's times (a profile
when the predictor is `profiled:PATH`) of prefills of D prompts and decode steps of n requests
at the batch's mean KV length d_0 + 1/alpha. Decode time is not linear in n (memory-bound for
small batches, compute-bound near C), so the line is fitted over the batch sizes the optimal
cycle visits, C - 2K* .. C, iterated to a fixed point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache, partial

import numpy as np

from medha.perf.predictor import Predictor


@dataclass(frozen=True)
class DeferredSystem:
    """The modelled system: batch cap C, prompt length d_0, mean output 1/alpha."""

    cap: int
    prompt_tokens: int
    mean_output: float
    prefill_only: bool = True  # prefills run in iterations of their own

    def __post_init__(self) -> None:
        if self.cap < 2 or self.prompt_tokens < 1 or not self.mean_output > 1:
            raise ValueError(
                "need C >= 2, prompt tokens >= 1 and mean output > 1, got "
                f"C={self.cap}, d_0={self.prompt_tokens}, "
                f"mean output={self.mean_output}"
            )

    @property
    def alpha(self) -> float:
        return 1.0 / self.mean_output

    @property
    def decode_kv(self) -> int:
        return self.prompt_tokens + round(self.mean_output)


@dataclass(frozen=True)
class Costs:
    """Seconds: a prefill of D prompts costs c_p + t_p d_0 D, a decode step of n requests
    c_d + t_d n."""

    c_p: float
    t_p: float
    c_d: float
    t_d: float


class StepTimes:
    """g(D) and f(n) from a predictor, for D, n = 0 .. C, each computed once."""

    def __init__(self, predictor: Predictor, system: DeferredSystem) -> None:
        self.predictor, self.system = predictor, system
        self._decode: np.ndarray | None = None
        self._prefill: np.ndarray | None = None

    def decode_table(self) -> np.ndarray:
        if self._decode is None:
            kv, p = self.system.decode_kv, self.predictor
            self._decode = np.array(
                [p.shape_time((), [kv] * n) for n in range(self.system.cap + 1)]
            )
        return self._decode

    def prefill_table(self) -> np.ndarray:
        if self._prefill is None:
            self._prefill = np.array([self._prefill_time(d) for d in range(self.system.cap + 1)])
        return self._prefill

    def _prefill_time(self, d: int) -> float:
        s = self.system
        prompts = [(s.prompt_tokens, 0)] * d
        if s.prefill_only:
            return self.predictor.shape_time(prompts)
        # riding along in a decode iteration: only the prompts' extra time
        decodes = [s.decode_kv] * (s.cap - d)
        return self.predictor.shape_time(prompts, decodes) - self.decode_table()[s.cap - d]


def _line(x: list[int], y: list[float]) -> tuple[float, float]:
    """(slope, intercept >= 0) of the least-squares line; a fixed cost is never negative."""
    slope, intercept = np.polyfit(np.asarray(x, float), np.asarray(y, float), 1)
    return float(slope), max(0.0, float(intercept))


def fit_costs(times: StepTimes, k: int) -> Costs:
    """Lines through g over D = 1 .. 2k and f over n = C - 2k .. C."""
    s = times.system
    span = min(max(2 * k, 8), s.cap - 1)
    ds = sorted({round(x) for x in np.linspace(1, span, 12)})
    ns = sorted({round(x) for x in np.linspace(s.cap - span, s.cap, 12)})
    g, f = times.prefill_table(), times.decode_table()
    t_p, c_p = _line([d * s.prompt_tokens for d in ds], [g[d] for d in ds])
    t_d, c_d = _line(ns, [f[n] for n in ns])
    return Costs(c_p, t_p, c_d, t_d)


def fit_costs_at_optimum(times: StepTimes, max_rounds: int = 8) -> tuple[Costs, int]:
    """Costs fitted around the K* they predict (a fixed point, usually in 2-3 rounds)."""
    k = max(1, times.system.cap // 8)
    for _ in range(max_rounds):
        costs = fit_costs(times, k)
        k_new = best_k(partial(approx_throughput, costs, times.system), times.system.cap)
        if k_new == k:
            break
        k = k_new
    return costs, k


def approx_throughput(costs: Costs, s: DeferredSystem, k: int) -> float:
    """Proposition 1: requests per second at threshold k (1 <= k < C)."""
    steps = math.log(1 - k / s.cap) / math.log(1 - s.alpha)
    per_request = (
        (costs.c_p + costs.c_d * steps) / k + costs.t_d / s.alpha + costs.t_p * s.prompt_tokens
    )
    return 1.0 / per_request


@lru_cache(maxsize=4096)
def _binomial_pmf(n: int, p: float) -> np.ndarray:
    from scipy.stats import binom

    return binom.pmf(np.arange(n + 1), n, p)


def cycle_means(
    k: int, cap: int, alpha: float, step_values: np.ndarray, end_values: np.ndarray
) -> np.ndarray:
    """Expectations over one cycle of the chain that starts with `cap` requests and ends once
    k have left: sum over its decode steps of step_values[n] (n requests decoding) plus
    end_values[D] (D gone at the end). Both are (cap + 1, m) tables; returns m numbers."""
    acc = np.zeros((k, step_values.shape[1]))
    final = end_values[k : cap + 1]  # a step from j that ends the cycle lands on D = k .. cap
    for j in range(k - 1, -1, -1):
        p = _binomial_pmf(cap - j, alpha)
        m = k - j  # i >= m departures in this step end the cycle
        acc[j] = (step_values[cap - j] + p[1:m] @ acc[j + 1 :] + p[m:] @ final) / (1.0 - p[0])
    return acc[0]


def renewal_throughput(times: StepTimes, k: int) -> float:
    """Theorem 1 with the predictor's own step times: E[D] / E[cycle time]."""
    s = times.system
    zero, one = np.zeros(s.cap + 1), np.arange(s.cap + 1, dtype=float)
    steps = np.column_stack([times.decode_table(), zero])  # decode time; no departures
    ends = np.column_stack([times.prefill_table(), one])  # prefill time; D departures
    seconds, departures = cycle_means(k, s.cap, s.alpha, steps, ends)
    return departures / seconds


def best_k(throughput, cap: int) -> int:
    """argmax over K = 1 .. C - 1 (ties to the smaller K)."""
    values = [throughput(k) for k in range(1, cap)]
    return 1 + int(np.argmax(values))


def curve_ks(cap: int, extra: tuple[int, ...] = ()) -> list[int]:
    """K values to print: doubling steps with midpoints, up to C/2, plus `extra`."""
    ks = {1}
    k = 2
    while k <= cap // 2:
        ks.update((k, k + k // 2))
        k *= 2
    return sorted(x for x in ks | set(extra) if 1 <= x < cap)
