"""Prefix caching in the engine: multi-turn conversations on a tiny random Llama give the same
greedy tokens with the cache off, on the device, and with a host tier the device's blocks go
to and come back from; the copies are real (test_prefix_cache.py has the scheduler's side)."""

import random

import pytest
import torch

from medha.analysis.schedule_match import engine_run, sim_run
from medha.core.config import SchedulerConfig
from medha.engine.errors import EngineError
from medha.engine.host_kv import HostKVBlocks
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x KV heads x head_dim x fp32 x tokens


def conversations(llm, turns=4):
    """Six conversations of `turns` turns, two sharing a system prompt: each turn resends the
    history (earlier prompts and answers) and a new message. Returns every answer and the
    scheduler's stats."""
    rng = random.Random(0)
    vocab = llm.engine.runner.args.vocab_size
    system = [rng.randrange(vocab) for _ in range(70)]
    histories = [
        (system if i < 2 else []) + [rng.randrange(vocab) for _ in range(rng.randint(5, 60))]
        for i in range(6)
    ]
    answers = []
    for _ in range(turns):
        outs = llm.generate(histories, GREEDY)
        answers.append([o.token_ids for o in outs])
        histories = [
            h + o.token_ids + [rng.randrange(vocab) for _ in range(rng.randint(5, 50))]
            for h, o in zip(histories, outs)
        ]
    s = llm.engine.scheduler
    s.check_invariants()
    assert not s.has_unfinished() and s.blocks.num_used == 0
    return answers, s


def make(model, prefix_cache, num_blocks, host_blocks=None):
    sched = SchedulerConfig(
        policy="lars", prefix_cache=prefix_cache, host_cache_blocks=host_blocks, watermark=0.0
    )
    return LLM(model, scheduler=sched, kv_memory_gb=num_blocks * BLOCK_BYTES / 2**30, device="cpu")


def test_the_cache_changes_no_token_and_skips_the_history(tiny_model):
    reference, plain = conversations(make(tiny_model, "off", 512))
    assert plain.stats.prefix_hit_tokens == 0
    answers, s = conversations(make(tiny_model, "device", 512))
    assert answers == reference
    st = s.stats
    # from the second turn on each prompt finds (nearly) all of its previous prompt
    assert st.prefix_hit_tokens > 0.5 * st.prefix_query_tokens


def test_a_host_tier_brings_evicted_history_back_with_the_same_tokens(tiny_model):
    reference, _ = conversations(make(tiny_model, "off", 512))
    # 40 blocks (640 tokens): the six histories' cached blocks do not stay on the device
    llm = make(tiny_model, "device+host", 40, host_blocks=256)
    answers, s = conversations(llm)
    assert answers == reference
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
    caches = [(torch.randn(1, nb * bs, 2), torch.randn(1, nb * bs, 2))]
    tier = HostKVBlocks(caches, num_blocks=3, block_size=bs)
    before = caches[0][0][:, 2 * bs : 3 * bs].clone()
    tier.swap_out([2], [1])
    caches[0][0].zero_()
    tier.swap_in([1], [5])
    assert torch.equal(caches[0][0][:, 5 * bs : 6 * bs], before)


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
