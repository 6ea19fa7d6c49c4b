"""Paused steps on medha's engine (medha/engine/pauses.py, SchedulerConfig.pause_steps): a step
of long prefills alone pauses between the parts of its layers for whoever waits, and the
tokens come out as they would have without the pause."""

from __future__ import annotations

import pytest
import torch

from medha.engine.errors import EngineError
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
LONG, SHORTS = 300, 3


def engine(model, pause: bool, **scheduler):
    # the long prompt long (threshold 64), and its steps as long as the prompt: one step
    sched = SchedulerConfig(
        pause_steps=pause,
        long_prefill_threshold=64,
        iteration_budget_s=0.05,
        arrival_wait_s=30.0,
        max_model_len=512,
        **scheduler,
    )
    return LLM(model, dtype="float32", kernels="torch", kv_memory_gb=0.05, scheduler=sched).engine


def prompts(vocab: int):
    g = torch.Generator().manual_seed(0)
    long = torch.randint(3, vocab, (LONG,), generator=g).tolist()
    shorts = [torch.randint(3, vocab, (12,), generator=g).tolist() for _ in range(SHORTS)]
    return long, shorts


def run(e, arrive_at_pause: bool):
    """The long prompt, then the shorts: handed in at the first pause point of its step
    (`arrive_at_pause`), or before it starts. Returns (tokens by request, the order in which
    requests finished their prefill)."""
    long, shorts = prompts(e.runner.args.vocab_size)
    e.add_request("long", None, GREEDY, prompt_token_ids=long)
    firsts, tokens = [], {}

    def collect(outputs):
        for out in outputs:
            if out.request_id not in firsts:
                firsts.append(out.request_id)
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)

    def add_shorts():
        for i, ids in enumerate(shorts):
            e.add_request(f"s{i}", None, GREEDY, prompt_token_ids=ids)

    if arrive_at_pause:
        pending = [add_shorts]
        e.pauses.arrivals = lambda: pending and pending.pop()()
    else:
        add_shorts()
    e.pauses.deliver = collect
    try:
        while e.has_unfinished():
            collect(e.step())
            e.scheduler.check_invariants()
    finally:
        e.pauses.arrivals = e.pauses.deliver = None
    return tokens, firsts


def test_a_paused_step_serves_the_shorts_first_and_changes_no_token(
    tiny_model, tmp_path, monkeypatch
):
    """The shorts arrive during the long prompt's one step: it pauses at its first pause point,
    their prefills and every decode they have due run beside it (their first tokens out
    before the long prompt's), and it resumes where it stopped; its measured time leaves
    theirs out. Every request's greedy tokens are those of an engine that does not pause,
    the shorts added up front."""
    import json

    log = tmp_path / "steps.jsonl"
    monkeypatch.setenv("MEDHA_STEP_LOG", str(log))
    paused = engine(tiny_model, pause=True)
    got, firsts = run(paused, arrive_at_pause=True)
    assert paused.pauses.count >= 1
    assert firsts.index("long") == SHORTS  # every short's first token came before its
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    (step,) = [r for r in rows if r["requests"] == ["long"]]
    beside = [r for r in rows if r["batch"] > step["batch"] and r["ended_s"] <= step["ended_s"]]
    assert len(beside) == paused.pauses.count
    wall = step["ended_s"] - step["scheduled_s"]
    assert step["measured_s"] < wall - 0.9 * sum(r["measured_s"] for r in beside)
    plain = engine(tiny_model, pause=False)
    want, _ = run(plain, arrive_at_pause=False)
    assert plain.pauses.count == 0
    assert got == want and all(len(t) == GREEDY.max_tokens for t in got.values())


def test_a_request_aborted_while_its_step_is_paused_ends_alone(tiny_model):
    """Aborting the long prompt at a pause point of its own step: its step finishes without
    handing it a token, its KV goes back, and the shorts run on."""
    e = engine(tiny_model, pause=True)
    long, shorts = prompts(e.runner.args.vocab_size)
    e.add_request("long", None, GREEDY, prompt_token_ids=long)
    done = []

    def arrive():
        if not done:
            done.append(True)
            e.add_request("s0", None, GREEDY, prompt_token_ids=shorts[0])
            assert e.abort("long")

    e.pauses.arrivals = arrive
    outputs = []
    try:
        while e.has_unfinished():
            outputs += e.step()
            e.scheduler.check_invariants()
    finally:
        e.pauses.arrivals = None
    outputs += e.pauses.take()
    assert {o.request_id for o in outputs} == {"s0"}
    assert e.scheduler.blocks.num_used == 0


def test_pausing_is_refused_where_the_engine_cannot_pause(tiny_model):
    with pytest.raises(EngineError, match="pause_steps runs in one process"):
        LLM(tiny_model, kv_memory_gb=0.05, tp=2, scheduler=SchedulerConfig(pause_steps=True))
    with pytest.raises(EngineError, match="cannot be paused"):
        LLM(
            tiny_model, kv_memory_gb=0.05, scheduler=SchedulerConfig(policy="pla", pause_steps=True)
        )
    # the default: on with adaptive chunking on a CPU, off for the baselines' chunking
    assert LLM(tiny_model, kv_memory_gb=0.05).engine.scheduler.config.pause_steps
    none = LLM(tiny_model, kv_memory_gb=0.05, scheduler=SchedulerConfig(chunking="none"))
    assert not none.engine.scheduler.config.pause_steps
