"""The scheduler config's hardware-dependent defaults, filled in from the predictor.

`resolve_config(config, predictor)` fills in what a SchedulerConfig leaves unset: the TPOT
target, the iteration budget, the TTFT deadline floor and the arrival wait (from the chunking
price, medha/perf/chunking_price.py), the context length and the long-prefill threshold. It
lives with the scheduler, not beside SchedulerConfig in medha/core, because it prices batches
with the predictor: medha/perf builds on medha/core (the predictor prices a core Batch), so
the dependency goes one way (tests/test_imports.py checks packages for cycles too).
"""

from __future__ import annotations

import dataclasses

from medha.core.config import MIN_TTFT_DEADLINE_S, default_long_threshold, iteration_budget
from medha.perf.chunking_price import budget_for_price, chunking_price, priced_prompt
from medha.perf.predictor import Predictor
from medha.scheduler.config import SchedulerConfig

# The TPOT target where the hardware can afford it (a reading pace; the Medha paper's), the
# chunking price up to which it can, and the price the default budget is chosen for where it
# cannot. A CPU's lone decode step takes about 0.05 s, so 0.05 s steps would be mostly fixed
# cost: SmolLM2 on vLLM's CPU build prices a max-length prompt at 4.2x there, the GPUs'
# bundled profiles a 32K one at 1.07-1.24x (docs/design.md, "The iteration budget").
SLO_TPOT_S = 0.05
AFFORDABLE_PRICE = 1.5
TARGET_PRICE = 1.1
# a step nobody waits on is made as long as chunking has a price worth saving
NEGLIGIBLE_PRICE = 1.02


def resolve_config(config: SchedulerConfig, predictor: Predictor) -> SchedulerConfig:
    """`config` with the hardware-dependent defaults filled in, so that everyone (the
    scheduler, its packer and policy, the KV arbiter, the simulator's metrics) reads one
    value of each; ReplicaScheduler resolves once and hands the result around. Resolving a
    resolved config returns it unchanged (the same object).

    tpot_target_s: `default_tpot_target`. iteration_budget_s: the TPOT target scaled for
    pipelining (`iteration_budget`). min_ttft_deadline_s: 0.5 s, or two iteration budgets
    where that is longer. arrival_wait_s: `default_arrival_wait`.
    max_model_len: the model's context. A longer one than the spec's is allowed: the
    long-context variants of a model (RoPE-scaled) share its shapes; the engine checks its
    real checkpoint's limit. long_prefill_threshold: `default_long_threshold`. prefix_cache:
    off, the simulator's default (medha's engine chooses its own before: size_host_memory)."""
    if config.is_resolved:
        return config
    max_model_len = config.max_model_len or predictor.model.max_context
    spp = predictor.parallel.spp
    target = config.tpot_target_s or default_tpot_target(
        predictor, max_model_len, config.min_chunk_tokens, config.max_batch_tokens
    )
    budget = config.iteration_budget_s or iteration_budget(target, spp)
    floor = config.min_ttft_deadline_s or max(MIN_TTFT_DEADLINE_S, 2 * budget)
    # a budget given explicitly bounds every step (a lone prefill's too) unless the
    # arrival wait is given as well
    wait = config.arrival_wait_s or (
        budget
        if config.iteration_budget_s
        else default_arrival_wait(
            predictor,
            budget,
            config.ttft_deadline_s or floor,
            max_model_len,
            (config.min_chunk_tokens, config.max_batch_tokens),
        )
    )
    long_threshold = config.long_prefill_threshold or default_long_threshold(max_model_len)
    return dataclasses.replace(
        config,
        prefix_cache=config.prefix_cache or "off",
        tpot_target_s=target,
        iteration_budget_s=budget,
        arrival_wait_s=max(wait, budget),
        min_ttft_deadline_s=floor,
        max_model_len=max_model_len,
        long_prefill_threshold=long_threshold,
    )


def default_tpot_target(
    predictor: Predictor, max_model_len: int, min_chunk: int, max_chunk: int | None = None
) -> float:
    """0.05 s where the predictor prices chunking a max-length prompt (up to 32K tokens) at
    that budget within 1.5x; elsewhere the smallest budget that prices it within 1.1x. The
    price is against the largest steps the engine runs (`max_chunk` tokens: vLLM's cap on a
    step; none: the whole prompt)."""
    n = priced_prompt(max_model_len)
    spp = predictor.parallel.spp
    slo_budget = iteration_budget(SLO_TPOT_S, spp)
    if chunking_price(predictor, slo_budget, n, min_chunk, max_chunk) <= AFFORDABLE_PRICE:
        return SLO_TPOT_S
    budget = budget_for_price(predictor, TARGET_PRICE, n, min_chunk, max_chunk)
    return max(SLO_TPOT_S, round(budget * (spp + 1) / spp if spp > 1 else budget, 4))


def default_arrival_wait(
    predictor: Predictor,
    budget_s: float,
    shortest_s: float,
    max_model_len: int,
    chunks: tuple[int, int | None],
) -> float:
    """The longest step no decode and no short prefill waits on: as long as chunking still has
    a price worth saving (the budget at which a max-length prompt, up to 32K tokens, costs
    within 1.02x), but at most half `shortest_s`, the shortest TTFT deadline a request arriving
    now could have (the configured one, or the floor under the default deadlines), so that it
    waits at most half its deadline for the next step; never below the iteration budget.
    `chunks`: the least and the most tokens of a step (as `default_tpot_target` prices)."""
    if budget_s >= shortest_s / 2:
        return budget_s
    n = priced_prompt(max_model_len)
    cheap = budget_for_price(predictor, NEGLIGIBLE_PRICE, n, *chunks)
    return max(budget_s, min(cheap, shortest_s / 2))
