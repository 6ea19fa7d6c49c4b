"""The default budgets come from the predictor's chunking price (issue 35)."""

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha.perf import ParallelConfig, make_predictor
from medha.perf.chunking_price import budget_for_price, chunking_price, finish, isolated_chunk
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import (
    READING_TPOT_S,
    chat_time_s,
    price_report,
    resolve_config,
)
from medha.testing.reference_cpu import REFERENCE_CPU

GPU = make_predictor("roofline", "llama-3-8b", "h100", ParallelConfig(tp=8))
# a machine whose lone decode step takes longer than 0.05 s, as a CPU's does (Llama-3-70B on one
# A100: 90 ms); the roofline of a named device, so the same on every machine the tests run on
SLOW = make_predictor("roofline", "llama-3-70b", "a100")
N = 32768  # the prompt the defaults are priced on (the longest allowed, capped at 32K)
# a CPU-like machine where a small model's steps are mostly fixed cost (the reference CPU with
# 100x its FLOP/s, SmolLM2's 8K context): 0.05 s steps chunk a max-length prompt at over 1.5x,
# and the price rule alone would ask for 0.19 s steps
DEAR = make_predictor(
    "roofline", "smollm2-135m", dataclasses.replace(REFERENCE_CPU, peak_flops=1.5e13),
    ParallelConfig(),
)  # fmt: skip


def test_chunking_costs_more_the_smaller_the_budget():
    # (above the budgets where a step is mostly fixed cost: below them the planner's minimum
    # chunks set the price, and it need not rise further)
    prices = [chunking_price(SLOW, b, N) for b in (0.1, 0.3, 1.0, 100.0)]
    assert prices == sorted(prices, reverse=True)
    assert prices[0] > 1.2 and prices[-1] == pytest.approx(1.0)


def test_a_cap_on_a_step_is_the_price_of_one():
    # against the engine's largest steps (vLLM's 2,048-token cap), a budget that buys them
    # prices at 1; the same chunks against one whole step cost more
    big = 1000.0
    assert chunking_price(SLOW, big, N, max_chunk=2048) == pytest.approx(1.0)
    assert chunking_price(SLOW, big, N) == pytest.approx(1.0)
    assert chunking_price(SLOW, 0.3, N, max_chunk=2048) < chunking_price(SLOW, 0.3, N)


def test_budget_for_price_is_the_smallest_within_it():
    b = budget_for_price(SLOW, 1.1, N)
    assert chunking_price(SLOW, b, N) <= 1.1
    assert chunking_price(SLOW, b * 0.97, N) > 1.1


@pytest.mark.parametrize("predictor", [SLOW, DEAR, GPU], ids=["slow", "dear", "gpu"])
@pytest.mark.parametrize("ceiling", [0.01, 0.05, 0.15, 0.4, 2.0])
def test_a_ceiling_caps_the_budget_and_changes_nothing_under_it(predictor, ceiling):
    n = min(N, predictor.model.max_context)
    for price in (1.02, 1.1):
        found = budget_for_price(predictor, price, n)
        assert budget_for_price(predictor, price, n, ceiling=ceiling) == min(found, ceiling)


class Counted:
    """A predictor that counts the prefill steps it is asked to price."""

    def __init__(self, predictor):
        self.inner, self.calls = predictor, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def prefill_step_time(self, n, k):
        self.calls += 1
        return self.inner.prefill_step_time(n, k)


def test_resolving_where_chunking_is_dear_takes_a_few_walks():
    """An engine resolves its defaults again on the path of a step as its model is corrected
    (Recalibration.resolve_again). Where chunking is dear every default is capped (a reading
    pace, a chat's time alone), and each budget search is decided by one walk at its cap; a
    walk's steps are found from the previous one's chunk in a few probes. A resolution once
    took 6,500 step prices here (20 walks of a dozen probes a chunk: 8-10 ms of a vLLM step)."""
    counted = Counted(DEAR)
    resolve_config(SchedulerConfig(), counted)
    assert counted.calls < 1500, counted.calls


@settings(max_examples=60, deadline=None)
@given(
    st.sampled_from([0.02, 0.05, 0.2, 1.0]),
    st.integers(0, 30000),
    st.integers(1, N),
    st.integers(1, 4096),
)
def test_a_guess_finds_the_same_chunk(budget, offset, remaining, guess):
    remaining = min(remaining, N - offset) or 1
    assert isolated_chunk(SLOW, budget, offset, remaining, 32, guess) == isolated_chunk(
        SLOW, budget, offset, remaining, 32
    )


def test_gpu_defaults_keep_the_slo_target():
    c = resolve_config(SchedulerConfig(), GPU)
    assert c.tpot_target_s == c.iteration_budget_s == 0.05
    assert c.min_ttft_deadline_s == 0.5
    # a lone long prefill runs longer steps, up to half the deadline floor
    assert 0.05 < c.arrival_wait_s <= 0.25


def test_slow_steps_take_the_defaults_from_the_price():
    c = resolve_config(SchedulerConfig(), SLOW)
    assert c.tpot_target_s > 0.05
    assert chunking_price(SLOW, c.iteration_budget_s, N) <= 1.1
    assert chunking_price(SLOW, 0.97 * c.iteration_budget_s, N) > 1.1
    # two budgets at least under every default deadline; the arrival wait at most half of it,
    # and at most a chat's time alone (here longer than that half)
    assert c.min_ttft_deadline_s == max(0.5, 2 * c.iteration_budget_s)
    assert c.iteration_budget_s <= c.arrival_wait_s <= c.min_ttft_deadline_s / 2
    assert chat_time_s(SLOW, N) > c.arrival_wait_s


def test_where_chunking_is_dear_the_shorts_come_first():
    n = DEAR.model.max_context
    c = resolve_config(SchedulerConfig(), DEAR)
    # the price rule alone would stretch the steps past a reading pace; the target stops there
    assert budget_for_price(DEAR, 1.1, n) > READING_TPOT_S
    assert c.tpot_target_s == c.iteration_budget_s == READING_TPOT_S
    # a chat arriving during a lone long prompt's step waits at most its own time alone: here
    # that is under the budget, so the long prompt runs in budget-sized steps too (half the
    # deadline floor would have allowed 0.25 s)
    assert chat_time_s(DEAR, n) < c.iteration_budget_s == c.arrival_wait_s
    assert c.min_ttft_deadline_s / 2 > c.arrival_wait_s
    # what the long prompt pays for it is reported, with the steps' fixed cost
    report = price_report(c, DEAR)
    assert "shorts first" in report
    assert f"at {chunking_price(DEAR, c.arrival_wait_s, n):.2f}x" in report
    assert "0.05 s steps" in price_report(resolve_config(SchedulerConfig(), GPU), GPU)


def test_given_settings_win():
    c = resolve_config(SchedulerConfig(iteration_budget_s=0.07), GPU)
    assert c.arrival_wait_s == 0.07  # a budget given bounds every step
    c = resolve_config(SchedulerConfig(iteration_budget_s=0.07, arrival_wait_s=0.2), GPU)
    assert c.arrival_wait_s == 0.2
    c = resolve_config(SchedulerConfig(tpot_target_s=0.1, min_ttft_deadline_s=0.3), SLOW)
    assert (c.iteration_budget_s, c.min_ttft_deadline_s) == (0.1, 0.3)
    with pytest.raises(ValueError, match="arrival_wait_s"):
        SchedulerConfig(arrival_wait_s=-1.0)


def test_where_no_step_keeps_the_slo_pace_its_price_does_not_choose_it():
    """A machine on which a min-chunk step alone takes longer than 0.05 s, with chunking cheap
    (compute-bound: the reference CPU at 10 GFLOP/s): min-chunk steps price a long prompt
    within 1.5x, which once chose the 0.05 s target although no step keeps it (the start-up
    probe's model of a slow fp32 machine landed there on one start, the shorts at 1.79x their
    time alone). The target comes from its steps instead: at least one min-chunk step."""
    crawl = make_predictor(
        "roofline", "smollm2-135m", dataclasses.replace(REFERENCE_CPU, peak_flops=1e10),
        ParallelConfig(),
    )  # fmt: skip
    step = crawl.prefill_step_time(32, 0)
    assert step > 0.05
    assert chunking_price(crawl, 0.05, crawl.model.max_context, 32) <= 1.5
    c = resolve_config(SchedulerConfig(), crawl)
    assert c.tpot_target_s >= step and "0.05 s steps" not in price_report(c, crawl)


def test_where_no_step_keeps_the_slo_pace_deep_in_the_prompt_its_price_does_not_choose_it():
    """The same at the other end of the prompt (issue 68, docs/vllm.md's 32K run): SmolLM2
    allowed 32K tokens on vLLM's CPU roofline (medha on vLLM's model at start), in vLLM's
    2,048-token steps. A token after 30K reads the whole prompt's KV for 0.09 s, so the walk
    at 0.05 s runs the deep end in min-chunk steps, which price it lower than 0.15 s's steps of
    a few tokens there; 0.05 s came out affordable and the prompt took 3.7x vLLM's tuned TTFT.
    The target comes from the price instead, as at 8K."""
    from medha.scheduler.config_defaults import affordable

    # the AMX Xeon of that run, as `medha hardware` measured it (390 GFLOP/s, 22.3 GB/s)
    xeon = dataclasses.replace(REFERENCE_CPU, peak_flops=3.9e11, mem_bw=2.23e10)
    cpu = make_predictor("roofline", "smollm2-135m", xeon, ParallelConfig())
    n, step = 32768, 2048
    assert cpu.prefill_step_time(32, 0) < 0.05 < cpu.prefill_step_time(1, n - 1)
    at_slo = chunking_price(cpu, 0.05, n, 32, step)
    assert at_slo <= 1.5 and at_slo < chunking_price(cpu, 0.15, n, 32, step)
    assert not affordable(cpu, n, 32, step)
    given = dict(max_model_len=n, max_batch_tokens=step, prefix_cache="off")
    c = resolve_config(SchedulerConfig(**given), cpu)
    assert c.tpot_target_s == READING_TPOT_S and "shorts first" in price_report(c, cpu)
    # (at 8K the deep end keeps 0.05 s; there the price itself says no, as before)
    assert cpu.prefill_step_time(1, 8191) < 0.05 < chunking_price(cpu, 0.05, 8192, 32, step)


def test_where_steps_pause_the_decodes_own_steps_count_in_the_price_of_0_05_s():
    """Issue 68: where steps pause, decodes beside a long prompt run steps of their own, one
    every TPOT target, each reading the weights again. SmolLM2 on the reference CPU's roofline
    with its linear work and its chunks' attention at half (a start-up probe's model that timed
    its shapes fast) chunks an 8,192-token prompt within 1.5x at 0.05 s, but a decode's own
    step takes a fifth of every 0.05 s: the long prompt then pays over 1.5x, so 0.05 s is not
    affordable there and the target comes from the price (at most a reading pace). Without
    pausing (the decodes ride in the chunks' steps), and on a GPU, 0.05 s stays."""
    from medha.perf.online_fit import CorrectedPredictor
    from medha.scheduler.config_defaults import affordable, decode_share

    half = CorrectedPredictor(make_predictor("roofline", "smollm2-135m", REFERENCE_CPU))
    half.set_theta((0.0, 0.0, 0.5, 0.5, 1.0))
    n = 8192
    price = chunking_price(half, 0.05, n)
    assert price <= 1.5 < price / (1 - decode_share(half, 0.05, n))
    assert affordable(half, n, 32) and not affordable(half, n, 32, None, pause=True)
    given = dict(max_model_len=n, prefix_cache="off")
    assert resolve_config(SchedulerConfig(**given), half).tpot_target_s == 0.05
    paused = resolve_config(SchedulerConfig(pause_steps=True, **given), half)
    assert 0.05 < paused.tpot_target_s <= READING_TPOT_S
    assert "shorts first" in price_report(paused, half)
    gpu = resolve_config(SchedulerConfig(pause_steps=True), GPU)
    assert gpu.tpot_target_s == 0.05


def test_where_steps_do_not_pause_the_decodes_riding_in_them_count_in_the_price_of_0_05_s():
    """Issue 69: where steps do not pause (vLLM), the decodes beside a long prompt ride in its
    chunks' steps, and a chunk gets what they leave of the budget. Counting the chunks alone,
    medha on vLLM on the AMX Xeon (its learner put about 1.4 ms on each sequence of a step)
    priced an 8K prompt within 1.5x at 0.05 s and ran there beside up to 10 decodes, its
    4,089-token prompt taking 5.56 s against 2.8-3.3 s in 0.15 s steps. The `half` model above
    with 1.4 ms a sequence: 1.32x alone, 1.48x with one chat decode riding in each step (0.05 s
    stays), 2.47x with four (the target then comes from the price)."""
    from medha.perf.online_fit import CorrectedPredictor
    from medha.scheduler.config_defaults import affordable, decode_share, resolve_steps

    vllm = CorrectedPredictor(make_predictor("roofline", "smollm2-135m", REFERENCE_CPU))
    vllm.set_theta((0.0, 0.0014, 0.5, 0.5, 1.0))
    n = 8192
    assert chunking_price(vllm, 0.05, n) <= 1.5
    for beside, cheap in ((1, True), (4, False)):
        left = 1 - decode_share(vllm, 0.05, n, beside, pause=False)
        price = chunking_price(vllm, 0.05 * left, n) / left
        assert (price <= 1.5) == cheap, (beside, price)
        assert affordable(vllm, n, 32, None, False, beside) == cheap
    config = SchedulerConfig(max_model_len=n, prefix_cache="off")
    assert resolve_config(config, vllm).tpot_target_s == 0.05
    four = finish(resolve_steps(config, vllm, beside=4))
    assert four.affordable is False and 0.05 < four.config.tpot_target_s <= READING_TPOT_S


@pytest.mark.parametrize(("scale", "price"), [(0.6, 1.49), (0.64, 1.56)])
def test_a_price_near_the_line_keeps_the_regime_the_defaults_hold(scale, price):
    """A resolution leaves the regime the defaults hold (`held`: 0.05 s steps, or shorts first)
    only at a price past the line by REGIME_MARGIN (10%, the learner's own tolerance): the
    price of a model corrected online moves by about that from one resolution to the next
    (issue 69: 1.22-1.55 over one run of medha on vLLM, its defaults flipping to 0.05 s and
    back). SmolLM2 on the reference CPU's roofline, its linear work and chunks' attention at
    `scale`, one decode riding in each step: a price just under 1.5x and one just over."""
    from medha.perf.online_fit import CorrectedPredictor
    from medha.scheduler.config_defaults import (
        AFFORDABLE_PRICE,
        REGIME_MARGIN,
        affordable,
        decode_share,
    )

    model = CorrectedPredictor(make_predictor("roofline", "smollm2-135m", REFERENCE_CPU))
    model.set_theta((0.0, 0.0, scale, scale, 1.0))
    n = 8192
    left = 1 - decode_share(model, 0.05, n, 1, pause=False)
    got = chunking_price(model, 0.05 * left, n) / left
    assert got == pytest.approx(price, abs=0.01)
    assert AFFORDABLE_PRICE / (1 + REGIME_MARGIN) < got <= AFFORDABLE_PRICE * (1 + REGIME_MARGIN)
    assert affordable(model, n, 32) == (got <= AFFORDABLE_PRICE)
    assert affordable(model, n, 32, held=True) and not affordable(model, n, 32, held=False)
