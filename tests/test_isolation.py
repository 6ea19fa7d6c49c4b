"""One bad request never takes the engine down: errors are classified in one place
(medha/engine/errors.py), a request that fails on its own ends alone, and only fatal errors stop
the engine. Faults are injected into the runner, the sampler and the detokenizer of a real
engine (the tiny random Llama)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha.benchmark import faults
from medha.benchmark.faults import PLACES, PROMPTS, inject
from medha.engine.errors import (
    InvalidRequestError,
    RequestFailedError,
    blame,
    is_fatal,
)
from medha.engine.isolation import MAX_FORWARD_FAILURES
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.testing.numerics import (
    GreedyReference,
    assert_greedy_agrees,
    assert_logprobs_agree,
    greedy_reference,
)

# the fault runs' greedy parameters, with each token's top five logprobs: the logits, which
# every request the faults leave alone must still get right
GREEDY = dataclasses.replace(faults.GREEDY, logprobs=5)


@pytest.fixture(scope="module")
def llm(tiny_model):
    # small chunks: prompts prefill over several batches, beside decodes of the others
    from medha.scheduler.config import SchedulerConfig

    return LLM(tiny_model, SchedulerConfig(policy="fcfs", chunking="static:16"), kv_memory_gb=0.01)


@pytest.fixture(scope="module")
def quiet(tiny_model):
    """What every prompt in PROMPTS must give, alone or in any batch, with faults around it or
    none: transformers' greedy tokens in float32, with the margins that say where rounding may
    pick the other token. Two calls of the engine batch and chunk the same prompt differently
    (other companions, and the prefix cache, on by default, leaves a later call only the
    prompt's tail to compute), so their float32 sums differ in order: equal tokens between two
    engine runs is not what the engine owes."""
    return greedy_reference(tiny_model, PROMPTS, GREEDY.max_tokens)


def assert_quiet(llm, indices: list[int], outputs, quiet: GreedyReference) -> None:
    """The outputs of PROMPTS[i] for i in `indices` are transformers' tokens (but at a near-tie)
    and its logits within rounding at every token."""
    tokens, margins, bounds = ([rows[i] for i in indices] for rows in dataclasses.astuple(quiet))
    try:
        assert_greedy_agrees(
            [o.token_ids for o in outputs], GreedyReference(tokens, margins, bounds)
        )
    except AssertionError as e:
        raise AssertionError(f"outputs of PROMPTS{indices}: {e}") from None
    assert_logprobs_agree(llm.engine.model_path, [PROMPTS[i] for i in indices], outputs)


def assert_clean(llm) -> None:
    e = llm.engine
    e.scheduler.check_invariants()
    assert not e.has_unfinished() and not e._states and not e.isolation.failed
    assert e.scheduler.blocks.num_used == 0


@pytest.mark.parametrize(
    "error",
    [
        ValueError("bad stop"),
        TypeError("x"),
        KeyError("k"),
        IndexError("i"),
        RuntimeError("shape mismatch"),
        ZeroDivisionError(),
        UnicodeEncodeError("utf-8", "\ud800", 0, 1, "surrogate"),
    ],
)
def test_errors_of_one_request_are_that_requests(error):
    assert not is_fatal(error)
    with pytest.raises(RequestFailedError) as e, blame("r7"):
        raise error
    assert e.value.request_id == "r7" and type(error).__name__ in str(e.value)


@pytest.mark.parametrize(
    "error",
    [
        MemoryError(),
        torch.OutOfMemoryError("out of memory"),
        torch.AcceleratorError("CUDA error: an illegal memory access was encountered"),
        RuntimeError("CUDA error: device-side assert triggered"),
        RuntimeError("[gloo] Connection closed by peer"),
        KeyboardInterrupt(),
        SystemExit(1),
    ],
)
def test_errors_that_break_the_engine_are_fatal_wherever_they_happen(error):
    assert is_fatal(error)
    with pytest.raises(type(error)), blame("r7"):  # not turned into the request's error
        raise error


@pytest.mark.parametrize(
    "kwargs,param",
    [
        (dict(temperature=1, top_p=1e-300), "top_p"),
        (dict(temperature=1, top_p=1e-46), "top_p"),
        (dict(temperature=1e-40), "temperature"),
        (dict(temperature=1, seed=2**64), "seed"),
        (dict(temperature=1, seed=-(2**63) - 1), "seed"),
        (dict(seed=True), "seed"),
        (dict(max_tokens=True), "max_tokens"),
        (dict(top_k=2.0), "top_k"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(stop=["x" * 1025]), "stop"),
        (dict(stop=["a"] * 17), "stop"),
        (dict(stop_token_ids=[-1]), "stop_token_ids"),
        (dict(logprobs=21), "logprobs"),
        (dict(ignore_eos="yes"), "ignore_eos"),
    ],
)
def test_sampling_values_the_sampler_cannot_serve_are_refused_naming_the_field(kwargs, param):
    with pytest.raises(InvalidRequestError) as e:
        SamplingParams(**kwargs)
    assert e.value.param == param


def test_float32_edges_are_served(llm, quiet):
    """The smallest values float32 holds as normal numbers run; below 1e-5 is greedy."""
    for kwargs in (
        dict(temperature=1.2e-38),
        dict(temperature=1e-20),
        dict(temperature=1, top_p=1.2e-38),
        dict(temperature=1, top_p=1e-30),
        dict(temperature=1, seed=2**63 - 1),
        dict(temperature=1, seed=-(2**63)),
    ):
        p = SamplingParams(max_tokens=6, ignore_eos=True, logprobs=5, **kwargs)
        out = llm.generate([PROMPTS[1]], p)[0]
        assert out.finish_reason == "length" and len(out.token_ids) == 6
        # the logprobs are the model's (before temperature and cuts): transformers' whatever
        # was sampled
        assert_logprobs_agree(llm.engine.model_path, [PROMPTS[1]], [out])
        if p.greedy or kwargs.get("top_p", 1) < 1e-20:
            # the nucleus of a tiny top_p is the likeliest token alone: any seed samples it
            assert_quiet(llm, [1], [out], quiet)
    assert_clean(llm)


@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    bad=st.sampled_from(
        [
            ("prompt", ""),
            ("prompt", "\ud800 surrogate"),
            ("prompt", [1, 49152]),
            ("prompt", [-1]),
            ("prompt", [True, 2]),
            ("prompt", [5] * 9000),
            ("prompt", "word " * 300_000),
            ("params", dict(temperature=1, seed=2**64)),
            ("params", dict(max_tokens=10**6)),
            ("params", dict(temperature=1, top_p=1e-300)),
            ("params", "not params"),
        ]
    ),
    position=st.integers(0, 3),
    seed=st.integers(0, 2**32 - 1),
)
def test_the_python_api_is_usable_after_any_rejected_call(llm, quiet, bad, position, seed):
    """A call with one bad prompt among good ones raises, runs none of them and leaves the
    engine as it was: the next call gives the quiet tokens and logits."""
    kind, value = bad
    prompts = [PROMPTS[i] for i in random.Random(seed).sample(range(len(PROMPTS)), 3)]
    params: list = [GREEDY] * 3
    prompts.insert(position, value if kind == "prompt" else PROMPTS[0])
    if kind == "params":
        params.insert(position, value if isinstance(value, str) else _params_or_error(value))
    else:
        params.insert(position, GREEDY)
    with pytest.raises(ValueError):
        llm.generate(prompts, params)
    assert_clean(llm)
    assert_quiet(llm, [0, 1, 2], llm.generate(PROMPTS[:3], GREEDY), quiet)


def _params_or_error(kwargs):
    try:
        return SamplingParams(**kwargs)
    except InvalidRequestError:
        return "refused"  # refused on its own: the engine gets a non-SamplingParams


def test_a_call_interrupted_midway_leaves_nothing_behind(llm, quiet, monkeypatch):
    calls = 0
    real = llm.engine.step

    def interrupted():
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt
        return real()

    monkeypatch.setattr(llm.engine, "step", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.generate(PROMPTS, GREEDY)
    monkeypatch.undo()
    assert_clean(llm)
    assert_quiet(llm, list(range(len(PROMPTS))), llm.generate(PROMPTS, GREEDY), quiet)


@settings(max_examples=25, deadline=None, suppress_health_check=list(HealthCheck))
@given(
    where=st.sampled_from(PLACES), victim=st.integers(0, len(PROMPTS) - 1), after=st.integers(0, 6)
)
def test_a_request_that_fails_mid_batch_ends_alone(llm, quiet, where, victim, after):
    """Fault injection: the victim ends with finish_reason "error" (or finishes, if the fault
    comes too late for it), every other request finishes with its quiet tokens and logits, no
    block leaks, and the engine goes on."""
    base = int(llm.generate([PROMPTS[0]], GREEDY)[0].request_id.split("-")[1]) + 1
    victim_id = f"gen-{base + victim}"
    with pytest.MonkeyPatch.context() as mp:
        inject(mp, llm, where, victim_id, PROMPTS[victim], after)
        outs = llm.generate(PROMPTS, GREEDY)
    finished = []
    for i, out in enumerate(outs):
        if out.request_id == victim_id and (out.finish_reason == "error" or after == 0):
            assert out.finish_reason == "error"  # a fault on its first pass always hits it
            assert out.error and victim_id not in out.error  # the cause, not a wrapper
            continue
        assert out.finish_reason == "length", (where, i, out.error)
        finished.append(i)
    assert_quiet(llm, finished, [outs[i] for i in finished], quiet)
    assert_clean(llm)
    assert_quiet(llm, list(range(len(PROMPTS))), llm.generate(PROMPTS, GREEDY), quiet)


def test_an_error_that_follows_every_request_stops_the_engine(tiny_model):
    """The other side of the bisection: an error the forward pass raises with every request
    alone is not any request's, and a device error is fatal at once (no re-runs)."""
    llm = LLM(tiny_model, kv_memory_gb=0.01)
    real = llm.engine.runner.forward
    calls = []

    def broken(step, hidden=None, pause=None):
        calls.append(step)
        raise RuntimeError("every forward fails")

    llm.engine.runner.forward = broken
    with pytest.raises(RuntimeError, match="every forward fails"):
        llm.generate(PROMPTS[:4], GREEDY)  # each of the batch's fails alone: not theirs
    assert llm.engine.scheduler.blocks.num_used == 0
    llm.engine.isolation.forward_failures = 0  # as a fresh engine
    for _ in range(MAX_FORWARD_FAILURES):  # one request at a time: it could be its own
        assert llm.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "error"
    with pytest.raises(RuntimeError, match="every forward fails"):
        llm.generate([PROMPTS[0]], GREEDY)  # ... until too many in a row
    calls.clear()

    def device_error(step, hidden=None, pause=None):
        calls.append(step)
        raise torch.AcceleratorError("CUDA error: an illegal memory access was encountered")

    llm.engine.runner.forward = device_error
    with pytest.raises(torch.AcceleratorError):
        llm.generate(PROMPTS[:4], GREEDY)
    assert len(calls) == 1 and llm.engine.scheduler.blocks.num_used == 0
    llm.engine.runner.forward = real
    llm.engine.isolation.forward_failures = 0
    assert llm.generate([PROMPTS[0]], GREEDY)[0].finish_reason == "length"


def test_a_prompt_too_long_is_refused_without_tokenizing_all_of_it(llm):
    """Far over the context, a text is refused after tokenizing a prefix about twice what
    the context holds; near it, the count is exact (prefixes are cut between words, where the
    tokens of the prefix are the first tokens of the whole text)."""
    tok, limit = llm.engine.tokenizer, llm.engine.scheduler.max_model_len
    rng = random.Random(0)
    words = ["the", "cat", "sat,", "Über", "日本語", "x=1;", "#----", "\n", "  "]
    text = " ".join(rng.choice(words) for _ in range(400_000))
    tokenized = []
    real = tok._tok.encode
    tok._tok.encode = lambda t, **kw: (tokenized.append(len(t)), real(t, **kw))[1]
    try:
        with pytest.raises(InvalidRequestError, match="more than 2048 tokens"):
            llm.engine.encode_prompt(text)
        assert sum(tokenized) < len(text) // 10, (sum(tokenized), len(text))
        for n in (limit - 3, limit, limit + 1):  # the exact edge, through the same code
            ids = real("".join(" the" for _ in range(n)), add_special_tokens=False)
            assert len(ids) == n
            edge = " the" * n
            if n <= limit:
                assert llm.engine.encode_prompt(edge) == ids
            else:
                with pytest.raises(InvalidRequestError):
                    llm.engine.encode_prompt(edge)
    finally:
        tok._tok.encode = real
