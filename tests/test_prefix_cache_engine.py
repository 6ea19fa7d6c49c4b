"""Prefix caching in the engine: multi-turn conversations on a tiny random Llama give
transformers' greedy tokens and logits with the cache off, on the device, and with a host tier
the device's blocks go to and come back from; the copies are real (test_prefix_cache.py has the
scheduler's side)."""

import random

import pytest
import torch

from medha.analysis.schedule_match import engine_run, sim_run
from medha.engine.errors import EngineError
from medha.engine.host_kv import HostKVBlocks
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig
from medha.testing.numerics import assert_greedy_agrees, assert_logprobs_agree, greedy_reference

# with each token's top five logprobs: the logits, which a cache hit must give again
GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, logprobs=5)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x KV heads x head_dim x fp32 x tokens


_REFERENCES: dict = {}


def assert_transformers(model, prompts, outs) -> None:
    """transformers' greedy tokens (but at a near-tie within rounding), and its logits at every
    generated token within rounding. Runs with the cache off and on batch and chunk the same
    prompts differently (a hit leaves only the prompt's tail to compute), so their float32 sums
    differ in order: equal tokens between two engine runs is not what the cache owes."""
    key = (model, tuple(map(tuple, prompts)))
    if key not in _REFERENCES:  # every run here sends the same turns, up to a near-tie
        _REFERENCES[key] = greedy_reference(model, prompts, GREEDY.max_tokens)
    assert_greedy_agrees([o.token_ids for o in outs], _REFERENCES[key])
    assert_logprobs_agree(model, prompts, outs)


def conversations(llm, model, turns=4):
    """Six conversations of `turns` turns, two sharing a system prompt: each turn resends the
    history (earlier prompts and answers) and a new message; every answer is transformers'.
    Returns the scheduler's stats."""
    rng = random.Random(0)
    vocab = llm.engine.runner.args.vocab_size
    system = [rng.randrange(vocab) for _ in range(70)]
    histories = [
        (system if i < 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(5, 60))]
        for i in range(6)
    ]
    for _ in range(turns):
        outs = llm.generate(histories, GREEDY)
        assert_transformers(model, histories, outs)
        histories = [
            h + o.token_ids + [rng.randrange(vocab) for _ in range(rng.randint(5, 50))]
            for h, o in zip(histories, outs)
        ]
    s = llm.engine.scheduler
    s.check_invariants()
    assert not s.has_unfinished() and s.blocks.num_used == 0
    return s


def make(model, prefix_cache, num_blocks, host_blocks=None, outputs=True):
    sched = SchedulerConfig(
        policy="lars",
        prefix_cache=prefix_cache,
        prefix_cache_outputs=outputs,
        host_cache_blocks=host_blocks,
        watermark=0.0,
    )
    return LLM(model, scheduler=sched, kv_memory_gb=num_blocks * BLOCK_BYTES / 2**30, device="cpu")


def test_the_cache_changes_no_token_and_skips_the_history(tiny_model):
    plain = conversations(make(tiny_model, "off", 512), tiny_model)
    assert plain.stats.prefix_hit_tokens == 0
    s = conversations(make(tiny_model, "device", 512), tiny_model)
    st = s.stats
    # from the second turn on each prompt finds (nearly) all of its previous prompt
    assert st.prefix_hit_tokens > 0.5 * st.prefix_query_tokens


def test_cached_answers_change_no_token_and_serve_the_next_turn(tiny_model):
    """Each turn repeats the previous answer: with the answers' blocks cached (the default)
    the next turn finds them too, and every token is transformers', as with prompts only
    cached (float32)."""
    p = conversations(make(tiny_model, "device", 512, outputs=False), tiny_model)
    s = conversations(make(tiny_model, "device", 512), tiny_model)
    # six conversations, three later turns each: an answer of 12 tokens (the KV of 11) after a
    # prompt ending mid-block completes one more block that the next turn finds when that
    # block held 5 or more prompt tokens, in about 11 of 16 turns (12 of these 18)
    assert s.stats.prefix_hit_tokens >= p.stats.prefix_hit_tokens + 9 * 16
    assert s.stats.prefix_query_tokens == p.stats.prefix_query_tokens


def test_a_turn_finds_the_previous_answer_up_to_its_last_computed_block(tiny_model):
    """The last sampled token was never fed (no KV): a block it would complete is not cached.
    A finished request's answer blocks are cached; an aborted one's are not."""
    llm = make(tiny_model, "device", 256)
    prompt = list(range(100, 140))  # 40 tokens: blocks 0-1 full, block 2 holds 8
    # 24 new tokens: context 64 tokens, the KV of 63 of them computed: blocks 0-2 full, and
    # block 3 lacks its last slot's KV
    out = llm.generate([prompt], SamplingParams(max_tokens=24, temperature=0, ignore_eos=True))
    turn = prompt + out[0].token_ids + [7] * 20
    second = llm.generate([turn], GREEDY)[0]
    assert second.metrics["cached_prompt_tokens"] == 48
    # 25 tokens: the KV of 64 computed, block 3 full: the next turn finds four blocks
    out = llm.generate([prompt], SamplingParams(max_tokens=25, temperature=0, ignore_eos=True))
    third = llm.generate([prompt + out[0].token_ids + [7] * 20], GREEDY)[0]
    assert third.metrics["cached_prompt_tokens"] == 64


def test_a_host_tier_brings_evicted_history_back_with_the_same_tokens(tiny_model):
    # 40 blocks (640 tokens): the six histories' cached blocks do not stay on the device
    llm = make(tiny_model, "device+host", 40, host_blocks=256)
    s = conversations(llm, tiny_model)
    st = s.stats
    assert st.host_cache_out_blocks > 0 and st.prefix_host_hit_tokens > 0
    assert llm.engine.prefix_host_blocks is not None


def test_usage_and_stats_report_cached_tokens(tiny_model):
    llm = make(tiny_model, "device", 256)
    prompt = list(range(100, 180))
    first = llm.generate([prompt], GREEDY)[0]
    second = llm.generate([prompt + [5, 6, 7]], GREEDY)[0]
    assert first.metrics["cached_prompt_tokens"] == 0
    assert second.metrics["cached_prompt_tokens"] == 80  # five full 16-token blocks
    stats = llm.engine.stats()
    assert (stats.prefix_query_tokens, stats.prefix_hit_tokens) == (163, 80)


def test_host_cache_tier_copies_are_real():
    torch.manual_seed(0)
    bs, nb = 4, 6
    caches = [torch.randn(2, nb * bs, 2)]  # one layer: its K head and its V head
    tier = HostKVBlocks(caches, num_blocks=3, block_size=bs)
    before = caches[0][:, 2 * bs : 3 * bs].clone()
    tier.swap_out([2], [1])
    caches[0].zero_()
    tier.swap_in([1], [5])
    # copies, no arithmetic: bit for bit on any CPU
    assert torch.equal(caches[0][:, 5 * bs : 6 * bs], before)


def test_the_engine_refuses_prefix_caching_across_worker_processes(tiny_model):
    with pytest.raises(EngineError, match="prefix_cache device runs in one process"):
        LLM(tiny_model, scheduler=SchedulerConfig(prefix_cache="device"), tp=2, kv_memory_gb=0.01)


def test_the_simulator_makes_the_engines_hit_decisions(tiny_model):
    """The digital twin: the same prompts (shared prefixes, repeats, all arriving at once)
    through the engine and the simulator fed its predictor and block count: the same batches,
    the same hits from the device and the host tier, the same copies."""
    rng = random.Random(3)

    def fresh(n):
        return [rng.randrange(1000, 9000) for _ in range(n)]

    system = fresh(150)
    shared = [system + fresh(n) for n in (40, 300, 7)]
    # two long distinct prompts push the first ones' cached blocks out to the host tier;
    # the repeats behind them find them there
    prompts = shared + [fresh(420), fresh(420), shared[1], shared[0] + [5] * 33, shared[2]]
    sched = SchedulerConfig(  # one request at a time: each finds what those before it left
        policy="fcfs",
        chunking="adaptive",
        prefix_cache="device+host",
        # the simulator's requests carry no generated tokens, so it caches prompts only: the
        # engine's cached answers would take LRU places the simulator leaves empty
        prefix_cache_outputs=False,
        host_cache_blocks=64,
        max_num_seqs=1,
    )
    engine_log, ids, predictor, _, blocks = engine_run(
        prompts, 6, sched, model=tiny_model, kv_memory_gb=60 * BLOCK_BYTES / 2**30,
        predictor="roofline", kernels="torch", block_size=16, device="cpu",
    )  # fmt: skip
    sim_log, _ = sim_run(ids, prompts, 6, sched, predictor, num_blocks=blocks)
    starts = [s for *_, (s, _, _) in engine_log for s in s]
    assert sum(start > 0 for _, start, _ in starts) >= 4  # prompts that hit
    assert any(host for *_, host in starts)  # some from the host tier
    assert sim_log == engine_log


def test_the_cache_is_on_by_default_on_the_engine_and_off_in_the_simulator(tiny_model):
    from conftest import toy_scheduler

    from medha.engine.host_kv import size_host_memory
    from medha.perf import ParallelConfig

    llm = LLM(tiny_model, kv_memory_gb=64 * BLOCK_BYTES / 2**30, device="cpu")
    config = llm.engine.scheduler.config
    assert (config.prefix_cache, config.prefix_cache_outputs) == ("device", True)
    # worker processes refuse the cache: their default is off; a choice is kept as given
    default = SchedulerConfig()
    assert size_host_memory(default, ParallelConfig(tp=2), 64, 16).prefix_cache == "off"
    off = SchedulerConfig(prefix_cache="off")
    assert size_host_memory(off, ParallelConfig(), 64, 16).prefix_cache == "off"
    # the simulator's scheduler (and its reproduction tables) keep it off
    assert toy_scheduler().config.prefix_cache == "off" and not toy_scheduler().kv.prefix_caching


def test_on_vllm_the_flag_sets_vllms_own_cache(tiny_model):
    from medha.engine.config import EngineConfig
    from medha.vllm_executor.engine_args import vllm_engine_args

    engine = EngineConfig(model=tiny_model)

    def vllm_args(mode, **extra):
        return vllm_engine_args(engine, SchedulerConfig(prefix_cache=mode), extra)

    assert "enable_prefix_caching" not in vllm_args(None)  # vLLM's default: on
    assert vllm_args("off")["enable_prefix_caching"] is False
    assert vllm_args("device")["enable_prefix_caching"] is True
    assert "prefix_cache" not in vllm_args("device")["additional_config"]["medha"]
    with pytest.raises(ValueError, match="no host tier"):
        vllm_args("device+host")
    with pytest.raises(ValueError, match="contradicts"):
        vllm_args("off", enable_prefix_caching=True)
