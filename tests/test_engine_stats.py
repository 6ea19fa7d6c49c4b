"""The engine's read-only API (limits, policy, stats): what the server and CLI read instead of
the scheduler's internals."""

from __future__ import annotations

import dataclasses

from medha.scheduler.config import SchedulerConfig


def test_engine_stats_follow_a_request(tiny_model):
    from medha.engine.llm_engine import EngineConfig, EngineStats, LLMEngine
    from medha.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=tiny_model, kv_memory_gb=0.01), SchedulerConfig(max_model_len=512)
    )
    blocks = engine.num_kv_blocks
    assert engine.max_model_len == 512
    assert engine.kv_capacity_tokens == blocks * engine.config.block_size  # no KVP: all of it
    assert engine.policy == "lars" and engine.chunking == "adaptive"  # adaptive's default
    idle = EngineStats(
        waiting=0,
        prefilling=0,
        running=0,
        swapped=0,
        kv_blocks_used=0,
        kv_blocks_free=blocks,
        preemptions=0,
    )
    assert engine.stats() == idle

    engine.add_request("r", [5, 6, 7, 8], SamplingParams(max_tokens=4, ignore_eos=True))
    s = engine.stats()
    assert (s.waiting, s.prefilling, s.running) == (1, 0, 0)
    engine.step()  # the whole prompt in one chunk: the request decodes from here
    s = engine.stats()
    assert (s.waiting, s.prefilling, s.running) == (0, 0, 1)
    assert s.kv_blocks_used >= 1 and s.kv_blocks_used + s.kv_blocks_free == blocks
    while engine.has_unfinished():
        engine.step()
    # idle again; the prefix cache (on by default) looked the 4-token prompt up, found nothing
    assert engine.stats() == dataclasses.replace(idle, prefix_query_tokens=4)


def test_engine_stats_tell_waiting_from_prefilling(tiny_model):
    from medha.engine.llm_engine import EngineConfig, LLMEngine
    from medha.engine.sampling_params import SamplingParams

    engine = LLMEngine(
        EngineConfig(model=tiny_model, kv_memory_gb=0.01),
        SchedulerConfig(policy="fcfs", chunking="static:4", multi_prefill=False, max_model_len=512),
    )
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("a", list(range(5, 15)), params)  # 10 tokens: three chunks
    engine.add_request("b", list(range(5, 15)), params)
    engine.step()  # a's first chunk: a has started, b has not
    s = engine.stats()
    assert (s.waiting, s.prefilling, s.running) == (1, 1, 0)
    while engine.has_unfinished():
        engine.step()
    s = engine.stats()
    assert (s.waiting, s.prefilling, s.running) == (0, 0, 0)


def test_engine_names_the_policy_it_was_given(tiny_model):
    from medha.engine.llm_engine import EngineConfig, LLMEngine
    from medha.engine.sampling_params import SamplingParams
    from medha.scheduler.packers.static_packer import StaticPacker
    from medha.scheduler.policies.edf_policy import EdfPolicy

    engine = LLMEngine(
        EngineConfig(model=tiny_model, kv_memory_gb=0.01),
        SchedulerConfig(policy="edf", chunking="static:256"),
    )
    assert engine.policy == "edf" and engine.chunking == "static:256"
    # ... and runs them: the names are of the scheduler's own policy and packer
    scheduler = engine.scheduler
    assert type(scheduler.policy) is EdfPolicy
    assert type(scheduler.packer) is StaticPacker and scheduler.packer.token_budget == 256
    engine.add_request("r", list(range(5, 305)), SamplingParams(max_tokens=1, ignore_eos=True))
    engine.step()  # 300 prompt tokens: a first chunk of 256
    assert scheduler.requests.live["r"].num_computed == 256
