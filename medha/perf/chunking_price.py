"""What cutting a prefill into budget-sized steps costs, as the predictor prices it.

Every step pays a fixed cost (every weight read once; per-step launch and bookkeeping) and, on
kernels that re-read a chunk's KV prefix, part of the attention again, so a prompt run in
chunks that each fit a time budget B takes longer than the same prompt in one step. The ratio
is the *chunking price* at B. It is what the default iteration budgets are derived from
(`resolve_config`, medha/scheduler/config_defaults.py): a budget is a trade between how long a
step holds up a request that arrives during it and how much of the machine chunking spends,
and the profile says where that trade lies on each machine (docs/design.md, "The iteration
budget").
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Callable, Generator
from functools import wraps
from typing import TypeVar

from medha.perf.predictor import Predictor

T = TypeVar("T")
# A computation that yields (None) after each step of a chunk walk and returns its value: what
# a caller that must not hold up a step for the whole of it (Recalibration, which resolves an
# engine's defaults again as its model is corrected) runs a few steps at a time, and `finish`
# runs at once
Steps = Generator[None, None, T]

# the longest prompt the budgets are priced on, capped for time: a model may allow a million
# tokens, and walking one at every resolve takes seconds. Longer prompts pay more for chunking
# (each chunk re-reads more KV), so for them the price at a budget priced at 32K is higher.
PRICED_PROMPT_CAP = 32768


def finish(steps: Steps[T]) -> T:
    """Run a computation of `Steps` to its end; its value."""
    while True:
        try:
            next(steps)
        except StopIteration as done:
            return done.value


def isolated_chunk(
    predictor: Predictor,
    budget_s: float,
    kv_offset: int,
    remaining: int,
    min_chunk: int,
    guess: int | None = None,
) -> int:
    """The chunk a prefill alone on the replica runs after `kv_offset` computed tokens with
    `remaining` to go: the largest whose step fits `budget_s`; `min_chunk` (or what is left)
    when not even one token fits, so that a request deep into a long context progresses.
    `guess` (the previous chunk of a walk, which changes by a few tokens from one step to the
    next as the KV grows) starts the search there: a gallop in steps of 1, 2, 4, ... tokens from
    it, then a bisection of the last step, to the same answer in a few probes, where a search
    from scratch takes a dozen (a walk prices every step of a prompt this way, and a budget
    search walks it many times)."""

    def fits(n: int) -> bool:
        return predictor.prefill_step_time(n, kv_offset) <= budget_s

    if fits(remaining):
        return remaining
    near = guess is not None and 1 < guess < remaining
    if near and fits(guess):  # (so one token fits as well)
        lo, step = guess, 1
        while lo + step < remaining and fits(lo + step):
            lo, step = lo + step, 2 * step
        hi = min(lo + step, remaining)  # invariant from here: lo fits, hi does not
    elif not fits(1):
        return min(remaining, min_chunk)
    elif near:
        hi, step = guess, 1
        while hi - step > 1 and not fits(hi - step):
            hi, step = hi - step, 2 * step
        lo = max(1, hi - step)
    else:
        lo, hi = 1, remaining
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def chunking_price(
    predictor: Predictor,
    budget_s: float,
    num_tokens: int,
    min_chunk: int = 32,
    max_chunk: int | None = None,
) -> float:
    """Predicted time of a `num_tokens` prompt alone in chunks that fit `budget_s` (as
    `isolated_chunk` sizes them), over its time in one step, or in `max_chunk`-token steps
    where the engine caps a step's tokens (vLLM's max_num_batched_tokens): >= 1 up to
    rounding. Cached (`per_model`): resolving a config asks the price at the SLO's budget for
    the TPOT target and again for the arrival wait."""
    return finish(chunking_price_steps(predictor, budget_s, num_tokens, min_chunk, max_chunk))


def per_model(maxsize: int) -> Callable:
    """A least-recently-used cache of a `Steps` computation, keyed by the predictor object and
    its `version` (a CorrectedPredictor's, which changes as it learns: the same object with new
    weights), then the other arguments, given positionally: a value cached is returned without a
    step. Every scheduler of a simulation resolves its config over the same predictor, and an
    engine resolves its again as its model is corrected."""

    def wrap(fn: Callable[..., Steps[T]]) -> Callable[..., Steps[T]]:
        cache: OrderedDict = OrderedDict()

        @wraps(fn)
        def steps(predictor: Predictor, *args) -> Steps[T]:
            key = (predictor, getattr(predictor, "version", None), *args)
            if key in cache:
                cache.move_to_end(key)
                return cache[key]
            value = yield from fn(predictor, *args)
            cache[key] = value
            if len(cache) > maxsize:
                cache.popitem(last=False)
            return value

        return steps

    return wrap


@per_model(maxsize=1024)
def chunking_price_steps(
    predictor: Predictor, budget_s: float, num_tokens: int, min_chunk: int, max_chunk: int | None
) -> Steps[float]:
    """`chunking_price`, a step at a time (every argument given, positionally)."""
    step = predictor.prefill_step_time
    cap = max_chunk or num_tokens
    total = 0.0
    for n, k in (yield from walk_steps(predictor, budget_s, num_tokens, min_chunk, cap)):
        total += step(n, k)
        yield
    best = sum(step(min(cap, num_tokens - k), k) for k in range(0, num_tokens, cap))
    return total / best


def chunk_walk(
    predictor: Predictor,
    budget_s: float,
    num_tokens: int,
    min_chunk: int = 32,
    max_chunk: int | None = None,
) -> list[tuple[int, int]]:
    """The (chunk, kv_offset) steps of a `num_tokens` prompt alone in chunks that fit
    `budget_s` (as `isolated_chunk` sizes them, each at most `max_chunk` tokens)."""
    return finish(walk_steps(predictor, budget_s, num_tokens, min_chunk, max_chunk))


def walk_steps(
    predictor: Predictor,
    budget_s: float,
    num_tokens: int,
    min_chunk: int = 32,
    max_chunk: int | None = None,
) -> Steps[list[tuple[int, int]]]:
    """`chunk_walk`, a step after each chunk."""
    cap = max_chunk or num_tokens
    out: list[tuple[int, int]] = []
    done, n = 0, None
    while done < num_tokens:
        left = min(num_tokens - done, cap)
        n = isolated_chunk(predictor, budget_s, done, left, min_chunk, guess=n)
        out.append((n, done))
        done += n
        yield
    return out


def priced_prompt(max_model_len: int) -> int:
    """The prompt the default budgets are priced on: the longest one allowed, up to 32K."""
    return min(max_model_len, PRICED_PROMPT_CAP)


def budget_for_price(
    predictor: Predictor,
    price: float,
    num_tokens: int,
    min_chunk: int = 32,
    max_chunk: int | None = None,
    ceiling: float | None = None,
) -> float:
    """The smallest budget (s, to within 1%) whose chunking price on a `num_tokens` prompt is at
    most `price`, or `ceiling` where that is less. Below one `min_chunk` step the planner runs
    `min_chunk` chunks whatever the budget, so the search starts there and goes up in steps of
    25% to the first budget within the price, then bisects the last step (on a log scale); it
    stops at the time of one largest step (`max_chunk`, or the whole prompt), which prices it
    at 1. Every default caps the budget it asks for (a reading pace, half a deadline, a chat's
    time alone), and on a machine where chunking is dear the price is met only above the cap:
    one walk at the ceiling says so, where the search takes about twenty (each a walk over the
    whole prompt). An engine resolves its defaults again as its model is corrected, on the
    path of a step, spread over steps there (`Recalibration`)."""
    return finish(
        budget_for_price_steps(predictor, price, num_tokens, min_chunk, max_chunk, ceiling)
    )


def budget_for_price_steps(
    predictor: Predictor,
    price: float,
    num_tokens: int,
    min_chunk: int = 32,
    max_chunk: int | None = None,
    ceiling: float | None = None,
) -> Steps[float]:
    """`budget_for_price`, a step at a time."""
    args = (num_tokens, min_chunk, max_chunk)
    if ceiling is not None and (yield from chunking_price_steps(predictor, ceiling, *args)) > price:
        return ceiling
    found = yield from _budget_for_price(predictor, price, *args)
    return found if ceiling is None else min(found, ceiling)


@per_model(maxsize=256)
def _budget_for_price(
    predictor: Predictor, price: float, num_tokens: int, min_chunk: int, max_chunk: int | None
) -> Steps[float]:
    p = predictor
    args = (num_tokens, min_chunk, max_chunk)
    lo = p.prefill_step_time(min(min_chunk, num_tokens), 0)
    top = max(lo, p.prefill_step_time(min(max_chunk or num_tokens, num_tokens), 0))
    if (yield from chunking_price_steps(p, lo, *args)) <= price:
        return round(lo, 4)
    hi = lo
    while (yield from chunking_price_steps(p, hi, *args)) > price:
        if hi >= top:
            return round(top, 4)
        lo, hi = hi, min(hi * 1.25, top)
    a, b = math.log(lo), math.log(hi)  # a's price is over, b's within
    while b - a > 0.01:
        mid = (a + b) / 2
        if (yield from chunking_price_steps(p, math.exp(mid), *args)) <= price:
            b = mid
        else:
            a = mid
    return round(math.exp(b), 4)
