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

from medha.core.batch import Batch
from medha.core.config import MIN_TTFT_DEADLINE_S, default_long_threshold, iteration_budget
from medha.perf.chunking_price import (
    Steps,
    budget_for_price_steps,
    chunk_walk,
    chunking_price,
    chunking_price_steps,
    finish,
    priced_prompt,
)
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
# How far past AFFORDABLE_PRICE a resolution must find the price to leave the regime the
# defaults hold (0.05 s steps, or shorts first): the learner's corrections move it by more than
# chance does near the line (issue 69: on the AMX Xeon, medha on vLLM's price of a max-length
# prompt at 0.05 s went 1.52, 1.22, 1.23, 1.38, ..., 1.55 over one run's resolutions, and its
# defaults went 0.127 s, 0.05 s, 0.15 s, its long prompts taking twice as long in the 0.05 s
# part). The margin is the learner's own: a resolution runs only once a probe shape's time
# moved by 10% (REDEFAULT_MOVE, recalibration.py), so a price within 10% of the line is not
# read as a move across it.
REGIME_MARGIN = 0.1
# a step nobody waits on is made as long as chunking has a price worth saving
NEGLIGIBLE_PRICE = 1.02
# Shorts first where chunking is dear (issue 48): the defaults keep the short requests' targets
# and only then lower the long prompt's price. A person reads about 4-5 words (5-7 tokens) a
# second, so a token every 0.15 s still streams ahead of the reader: the TPOT target never
# rises past it (the price rule alone gave 0.74 s on this EPYC and 1.81 s on an AMX Xeon once
# profiled, where the shorts then waited 15x their time alone). And a chat arriving during a
# long prompt's step waits at most its own time alone (a CHAT_PROMPT_TOKENS prompt: a chat
# turn, or the convoy benchmarks' 8 shorts of 64 tokens), so its TTFT stays within about 1.5x
# of it at the median (bench/engine/engine_convoy.py: arrival waits of 0.3 s kept the shorts at
# 0.8x alone here, 0.5 s let them reach 1.5x).
READING_TPOT_S = 0.15
CHAT_PROMPT_TOKENS = 512
# Where steps pause (pause_steps), what a chat arriving during one may wait for its pause point,
# as a share of its own time alone: its TTFT stays within 1 + this of it, with room for a
# model off by some (tests/test_machine_kinds.py: 1.5x is the promise)
PAUSE_WAIT_SHARE = 1 / 3


@dataclasses.dataclass(frozen=True)
class Resolution:
    """A resolved config and the regime its defaults were resolved in: `affordable` (0.05 s
    steps), or not (shorts first); None where the config gave every value the regime sets."""

    config: SchedulerConfig
    affordable: bool | None


def resolve_config(config: SchedulerConfig, predictor: Predictor) -> SchedulerConfig:
    """`config` with the hardware-dependent defaults filled in, so that everyone (the
    scheduler, its packer and policy, the KV arbiter, the simulator's metrics) reads one
    value of each; ReplicaScheduler resolves once and hands the result around. Resolving a
    resolved config returns it unchanged (the same object).

    tpot_target_s: `default_tpot_target_steps`. iteration_budget_s: the TPOT target scaled for
    pipelining (`iteration_budget`). min_ttft_deadline_s: 0.5 s, or two iteration budgets
    where that is longer. arrival_wait_s: `default_arrival_wait_steps`.
    max_model_len: the model's context. A longer one than the spec's is allowed: the
    long-context variants of a model (RoPE-scaled) share its shapes; the engine checks its
    real checkpoint's limit. long_prefill_threshold: `default_long_threshold`. prefix_cache:
    off, the simulator's default (medha's engine chooses its own before: size_host_memory)."""
    return finish(resolve_steps(config, predictor)).config


def resolve_steps(
    config: SchedulerConfig,
    predictor: Predictor,
    beside: int = 1,
    held: bool | None = None,
) -> Steps[Resolution]:
    """`resolve_config`, a step of a chunk walk at a time (Recalibration spreads it over an
    engine's steps), with the regime it resolved in. `beside` and `held`: as `affordable`
    takes them (Recalibration's, from the load the engine has run and the regime it holds)."""
    if config.is_resolved:
        return Resolution(config, None)
    max_model_len = config.max_model_len or predictor.model.max_context
    spp = predictor.parallel.spp
    chunks = (config.min_chunk_tokens, config.max_batch_tokens)
    pause = bool(config.pause_steps)
    # the regime, where a default it sets is left unset: the TPOT target, or the arrival wait
    # of steps that do not pause
    cheap = None
    waits = not (config.arrival_wait_s or pause or config.iteration_budget_s)
    if not config.tpot_target_s or waits:
        cheap = yield from affordable_steps(predictor, max_model_len, *chunks, pause, beside, held)
    target = config.tpot_target_s or (
        yield from default_tpot_target_steps(predictor, max_model_len, *chunks, cheap)
    )
    budget = config.iteration_budget_s or iteration_budget(target, spp)
    floor = config.min_ttft_deadline_s or max(MIN_TTFT_DEADLINE_S, 2 * budget)
    # a budget given explicitly bounds every step (a lone prefill's too) unless the
    # arrival wait is given as well
    if config.arrival_wait_s:
        wait = config.arrival_wait_s
    elif pause:  # (a budget given explicitly bounds the steps that others wait on)
        wait = yield from pause_arrival_wait_steps(predictor, budget, max_model_len, chunks)
    elif config.iteration_budget_s:
        wait = budget
    else:
        shortest = config.ttft_deadline_s or floor
        wait = yield from default_arrival_wait_steps(
            predictor, budget, shortest, max_model_len, chunks, cheap
        )
    long_threshold = config.long_prefill_threshold or default_long_threshold(max_model_len)
    resolved = dataclasses.replace(
        config,
        prefix_cache=config.prefix_cache or "off",
        tpot_target_s=target,
        iteration_budget_s=budget,
        arrival_wait_s=max(wait, budget),
        min_ttft_deadline_s=floor,
        max_model_len=max_model_len,
        long_prefill_threshold=long_threshold,
        pause_steps=pause,
    )
    return Resolution(resolved, cheap)


def default_tpot_target_steps(
    predictor: Predictor,
    max_model_len: int,
    min_chunk: int,
    max_chunk: int | None,
    cheap: bool,
) -> Steps[float]:
    """0.05 s where the hardware can afford it (`cheap`, which `affordable` finds:
    the predictor prices chunking a max-length prompt, up to 32K tokens, at that budget within
    1.5x); elsewhere the smallest budget that prices it within 1.1x, but never past a reading
    pace (READING_TPOT_S: shorts first). The price is against
    the largest steps the engine runs (`max_chunk` tokens: vLLM's cap on a step; none: the
    whole prompt). Never below one step of a `min_chunk`-token prefill alone either: where even
    that takes longer than a reading pace (a slow dtype, a busy machine), a shorter budget would
    cut every prompt into chunks of a few tokens, each paying the whole step's fixed cost."""
    if cheap:
        return SLO_TPOT_S
    spp = predictor.parallel.spp
    n = priced_prompt(max_model_len)
    pipelined = (spp + 1) / spp if spp > 1 else 1.0
    ceiling = READING_TPOT_S / pipelined
    budget = yield from budget_for_price_steps(
        predictor, TARGET_PRICE, n, min_chunk, max_chunk, ceiling
    )
    target = round(budget * pipelined, 4)
    progress = round(predictor.prefill_step_time(min(min_chunk, n), 0), 4)
    return max(SLO_TPOT_S, min(target, READING_TPOT_S), progress)


def affordable(
    predictor: Predictor,
    max_model_len: int,
    min_chunk: int,
    max_chunk: int | None = None,
    pause: bool = False,
    beside: int = 1,
    held: bool | None = None,
) -> bool:
    """Whether the hardware gives both: steps at the SLO's TPOT (0.05 s) chunk a max-length
    prompt (up to 32K tokens) within AFFORDABLE_PRICE, with `beside` decodes of a chat beside
    it (the load the engine has run, `Recalibration.beside`: at least one, for a step's budget
    binds only where someone shares the machine). Not where no step keeps that budget
    somewhere in the prompt: where a step of a `min_chunk`-token prefill alone is already
    longer at its start, or one token is at its end (after the whole prompt's KV). There the
    walk runs `min_chunk` steps whatever the budget, and their price says nothing of the
    budget: a machine this slow at the start priced within 1.5x there flipped to 0.05 s steps
    from one start to the next; and at 32K
    tokens of SmolLM2, where vLLM's CPU roofline prices a lone token after 30K at 0.091 s,
    32-token steps over the deep end priced 0.05 s at 1.35x (less than 0.15 s's 1.42x, whose
    steps there are of a few tokens), and medha on vLLM took 3.7x threshold 128's TTFT
    (docs/vllm.md, the 32K run).

    The decodes take their share of the machine (`decode_share`), and the long prompt's price
    is the chunks' over what they leave. Where steps pause (`pause`), they run steps of their
    own, one every TPOT target, each reading the weights again: counting the chunks alone, on a
    2-core AMX Xeon a start-up probe whose model priced 4 decodes' step at 0.023 s (0.032 s
    measured) put an 8,192-token prompt within 1.5x at 0.05 s, where the 4 decodes beside it
    then took about half of every 0.05 s and its TTFT was 4.1x plain vLLM's (issue 68). Where
    steps do not pause (vLLM), they ride in the chunk's step, which then holds a chunk of what
    they leave of the budget: counting the chunks alone, medha on vLLM on the same machine,
    its model learned from a chat trace (about 1.4 ms a sequence of a step, up to 10 decodes
    beside a chunk), priced an 8,192-token prompt within 1.5x at 0.05 s and ran there, its
    4,089-token prompt taking 5.56 s against 2.8-3.3 s in the 0.15 s steps it resolved before
    and after (docs/vllm.md).

    `held`: the regime the defaults hold now (True: 0.05 s; False: shorts first; None: none
    yet). Leaving it takes a price past the line by REGIME_MARGIN, so a model that moves by
    less than the learner's own tolerance does not flip the defaults."""
    return finish(
        affordable_steps(predictor, max_model_len, min_chunk, max_chunk, pause, beside, held)
    )


def affordable_steps(
    predictor: Predictor,
    max_model_len: int,
    min_chunk: int,
    max_chunk: int | None,
    pause: bool = False,
    beside: int = 1,
    held: bool | None = None,
) -> Steps[bool]:
    """`affordable`, a step of a chunk walk at a time."""
    slo_budget = iteration_budget(SLO_TPOT_S, predictor.parallel.spp)
    n = priced_prompt(max_model_len)
    share = decode_share(predictor, SLO_TPOT_S, max_model_len, beside, pause)
    left = 1 - share
    if left <= 0:
        return False
    # the chunk's own budget: the whole step's where the decodes run steps of their own, what
    # they leave of it where they ride in it
    chunk_budget = slo_budget if pause else slo_budget * left
    # the first step of the walk, and a token at its deep end (which reads the whole prompt's KV)
    if predictor.prefill_step_time(min(min_chunk, n), 0) > chunk_budget:
        return False
    if predictor.prefill_step_time(1, n - 1) > chunk_budget:
        return False
    price = yield from chunking_price_steps(predictor, chunk_budget, n, min_chunk, max_chunk)
    line = AFFORDABLE_PRICE
    if held is not None:
        line *= (1 + REGIME_MARGIN) if held else 1 / (1 + REGIME_MARGIN)
    return price / left <= line


def decode_share(
    predictor: Predictor,
    tpot_target_s: float,
    max_model_len: int,
    beside: int = 1,
    pause: bool = True,
) -> float:
    """The share of the machine `beside` chats' decodes take beside a long prompt, one token
    each every `tpot_target_s`, after a chat's prompt (CHAT_PROMPT_TOKENS, or the whole context
    if shorter): where steps pause (`pause`), as a step of their own; where they do not, what
    they add to a chunk's step (a chat-sized chunk's)."""
    context = min(CHAT_PROMPT_TOKENS, max_model_len)
    decodes = [context] * beside
    if pause:
        return predictor.shape_time((), decodes) / tpot_target_s
    chunk = [(context, 0)]
    return (predictor.shape_time(chunk, decodes) - predictor.shape_time(chunk)) / tpot_target_s


def default_arrival_wait_steps(
    predictor: Predictor,
    budget_s: float,
    shortest_s: float,
    max_model_len: int,
    chunks: tuple[int, int | None],
    cheap: bool,
) -> Steps[float]:
    """The longest step no decode and no short prefill waits on: as long as chunking still has
    a price worth saving (the budget at which a max-length prompt, up to 32K tokens, costs
    within 1.02x), but at most half `shortest_s`, the shortest TTFT deadline a request arriving
    now could have (the configured one, or the floor under the default deadlines), so that it
    waits at most half its deadline for the next step; where chunking is dear (not `cheap`:
    `affordable`), at most a chat's own time alone too (`chat_time_s`: shorts first); never
    below the iteration budget. `chunks`: the least and the most tokens of a step (as
    `default_tpot_target_steps` prices)."""
    if budget_s >= shortest_s / 2:
        return budget_s
    n = priced_prompt(max_model_len)
    most = shortest_s / 2
    if not cheap:
        most = min(most, chat_time_s(predictor, max_model_len))
    found = yield from budget_for_price_steps(predictor, NEGLIGIBLE_PRICE, n, *chunks, most)
    return max(budget_s, found)


def pause_arrival_wait_steps(
    predictor: Predictor, budget_s: float, max_model_len: int, chunks: tuple[int, int | None]
) -> Steps[float]:
    """The arrival wait of steps that pause for whoever waits (pause_steps): a request arriving
    during one waits only for the part of a layer in progress (`pause_points`), so the step is
    as long as chunking still has a price worth saving (the budget that chunks a max-length
    prompt, up to 32K tokens, within 1.02x), as long as one part of it is at most
    PAUSE_WAIT_SHARE of a chat's time alone (`chat_time_s`) to the median of its first tokens
    (a chat of CHAT_PROMPT_TOKENS is the convoy's 8 shorts; cut by the budget, half of them
    come with its first step); never below the iteration budget."""
    n = priced_prompt(max_model_len)
    # a chat's time alone to the median of its first tokens: the chat in one step where it fits
    # the budget, else the budget's step, or half the chat where even that is longer
    chat = chat_time_s(predictor, max_model_len)
    part = min(chat, max(budget_s, chat / 2)) * PAUSE_WAIT_SHARE
    most = part * pause_points(predictor)
    found = yield from budget_for_price_steps(predictor, NEGLIGIBLE_PRICE, n, *chunks, most)
    return max(budget_s, found)


def pause_points(predictor: Predictor) -> int:
    """The parts a paused step is cut into: each layer's attention and its MLP (of one
    device's share of the layers), a pause point after each but the last."""
    return 2 * max(1, predictor.model.num_layers // predictor.parallel.spp)


def pause_parts(predictor: Predictor, batch: Batch) -> tuple[float, float]:
    """The two parts a paused step's layers alternate, as predicted (seconds of one layer):
    its attention (the QKV and output projections, and the kernel over each chunk's context)
    and its MLP, with a pause point after each. They are far from even: attention grows with
    the context a chunk reads and the MLP does not, so late in a long prompt a layer's
    attention takes several times its MLP (SmolLM2 on the AMX Xeon's profile, an 8,000-token
    prompt in one step: 0.117 s against 0.023 s). The wait for the next pause point is the
    longer part's, not the step over its points' count. The step's linear work splits by the
    projections' share of a layer's matmul FLOPs."""
    m = predictor.model
    attention = sum(predictor.prefill_attention_time(c.num_tokens, c.start) for c in batch.prefills)
    linear = max(0.0, batch.predicted_time_s - attention)
    projections = m.hidden_size * (2 * m.q_size + 2 * m.kv_size)
    share = projections / (projections + 3 * m.hidden_size * m.intermediate_size)
    return (attention + share * linear) / m.num_layers, (1 - share) * linear / m.num_layers


def chat_time_s(predictor: Predictor, max_model_len: int) -> float:
    """A chat's prefill alone: a CHAT_PROMPT_TOKENS prompt (or the whole context, if shorter)
    in one step."""
    return predictor.prefill_step_time(min(CHAT_PROMPT_TOKENS, max_model_len), 0)


def price_report(config: SchedulerConfig, predictor: Predictor) -> str:
    """One line on what the resolved `config`'s steps cost a long prompt, as `predictor`
    prices it: the TPOT target, budget, arrival wait and deadline floor; a max-length prompt's
    (up to 32K tokens) chunking price at the arrival wait (the step a lone prefill runs in) and
    the number of steps it takes; and each step's fixed cost split into what is physics
    (reading every weight once at the memory's bandwidth) and what is not (launches,
    bookkeeping, the kernels' shortfall). The engine logs it at start."""
    n = priced_prompt(config.max_model_len)
    chunks = (config.min_chunk_tokens, config.max_batch_tokens)
    wait = config.arrival_wait_s
    steps = len(chunk_walk(predictor, wait, n, *chunks))
    fixed = predictor.prefill_step_time(1, 0)
    hw = predictor.hardware
    weights = predictor.model.num_params * hw.dtype_bytes / hw.mem_bw
    rule = (
        "0.05 s steps chunk it within 1.5x"
        if affordable(predictor, config.max_model_len, *chunks, config.pause_steps)
        else "shorts first"
    )
    if config.pause_steps:
        rule += f"; a long prefill's steps pause at {pause_points(predictor)} points for others"
    return (
        f"TPOT target {config.tpot_target_s:.3g} s, iteration budget "
        f"{config.iteration_budget_s:.3g} s, arrival wait {wait:.3g} s, TTFT deadline floor "
        f"{config.min_ttft_deadline_s:.3g} s ({rule}); a {n:,}-token prompt alone runs in "
        f"{steps} steps at {chunking_price(predictor, wait, n, *chunks):.2f}x its time in the "
        f"largest ones; each step's fixed cost {fixed * 1e3:.1f} ms, of which reading the "
        f"weights once at {hw.mem_bw / 1e9:.0f} GB/s {min(weights, fixed) * 1e3:.1f} ms"
    )
