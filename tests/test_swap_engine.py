"""Swap preemption in the engine: the host KV pool's real copies, and a tiny random Llama under
memory pressure giving transformers' tokens and logits, its KV swapped out and back (the
scheduler's side is in test_swap_preemption.py)."""

import pytest
import torch

from medha.core.batch import Batch, KVSwap
from medha.core.request import Request
from medha.engine.errors import EngineError
from medha.engine.host_kv import HostKVBlocks
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig
from medha.testing.numerics import assert_greedy_agrees, assert_logprobs_agree, greedy_reference


def test_host_kv_cache_moves_blocks_both_ways():
    torch.manual_seed(0)
    bs, nb = 4, 10
    caches = [torch.randn(4, nb * bs, 8) for _ in range(3)]  # per layer: 2 K heads, 2 V heads
    host = HostKVBlocks(caches, num_blocks=6, block_size=bs)

    def block(t, b):
        return t[:, b * bs : (b + 1) * bs].clone()

    saved = [block(t, b) for t in caches for b in (5, 2, 7)]
    host.swap_out([5, 2, 7], [3, 4, 0])  # runs of host blocks: (3, 4) and (0)
    for t in caches:
        t.zero_()
    host.swap_in([3, 4, 0], [1, 8, 9])
    back = [block(t, b) for t in caches for b in (1, 8, 9)]
    # copies, no arithmetic: bit for bit on any CPU
    assert all(torch.equal(x, y) for x, y in zip(saved, back))
    assert all(not block(t, 5).any() for t in caches)  # nothing else written


def test_a_batch_swaps_in_before_it_swaps_out():
    # request x comes back from host block 0 while y leaves for that same block
    bs = 2
    caches = [torch.cat([torch.arange(16.0).reshape(1, 8, 2), torch.zeros(1, 8, 2)])]  # K, V
    host = HostKVBlocks(caches, num_blocks=1, block_size=bs)
    host.host[0, 0] = -1.0  # x's KV
    x, y = Request("x", 0.0, 2, 1), Request("y", 0.0, 2, 1)
    batch = Batch(0, 0.0, swap_in=[KVSwap(x, [0], [0])], swap_out=[KVSwap(y, [3], [0])])
    host.apply(batch)
    assert (caches[0][:, 0:2] == -1).all()
    assert torch.equal(
        host.host[0, 0], torch.tensor([[[12.0, 13.0], [14.0, 15.0]], [[0.0] * 2] * 2])
    )


TEXT = " ".join(
    f"Entry {i}: the ferry from {i * 5 % 17} to {i * 3 % 7} left at {i % 12} "
    "o'clock with cars, bikes and crates of apples."
    for i in range(40)
)
# the logprobs of each token's top five: the logits, which the swapped KV must give again
GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True, logprobs=5)
BLOCK_BYTES = 2 * 2 * 2 * 16 * 4 * 16  # layers x K/V x KV heads x head_dim x fp32 x tokens


def _prompts(llm) -> list[list[int]]:
    ids = llm.tokenizer.encode(TEXT)
    return [ids[i * 37 : i * 37 + n] for i, n in enumerate((5, 11, 40, 96, 170, 260, 400))]


def _generate(model, mode, num_blocks, host_blocks=64):
    sched = SchedulerConfig(
        policy="fcfs", chunking="static:64", preemption_mode=mode, host_kv_blocks=host_blocks
    )
    llm = LLM(model, scheduler=sched, kv_memory_gb=num_blocks * BLOCK_BYTES / 2**30, device="cpu")
    prompts = _prompts(llm)
    outs = llm.generate(prompts, GREEDY)
    s = llm.engine.scheduler
    assert s.blocks.num_used == 0 and not s.has_unfinished()
    s.check_invariants()
    return prompts, outs, s


def assert_transformers(model, prompts, outs, reference) -> None:
    """transformers' greedy tokens (but at a near-tie within rounding), and its logits at
    every generated token within rounding. The batches here differ from any unpressured run
    (who runs beside whom, and in what chunks, changes with every preemption), so their float32
    sums differ in order: equal tokens between two engine runs is not what the engine owes."""
    assert_greedy_agrees([o.token_ids for o in outs], reference)
    assert_logprobs_agree(model, prompts, outs)


def test_engine_swaps_kv_out_and_back_with_the_same_tokens(tiny_model):
    # 43 blocks (688 tokens) for seven requests that need 1,150 in all
    prompts, outs, s = _generate(tiny_model, "swap", 43)
    assert s.stats.swap_outs > 0 and s.stats.swap_ins == s.stats.swap_outs
    assert s.stats.recomputes == 0
    reference = greedy_reference(tiny_model, prompts, GREEDY.max_tokens)
    assert_transformers(tiny_model, prompts, outs, reference)
    assert s.kv.swap_pool.num_free == 64
    # auto, on the tests' reference CPU (tests/conftest.py): a memcpy is far cheaper than a
    # prefill, so it swaps too
    prompts, outs, s = _generate(tiny_model, "auto", 43)
    assert s.stats.swap_outs > 0 and s.stats.recomputes == 0
    assert_transformers(tiny_model, prompts, outs, reference)


def test_engine_refuses_to_swap_across_worker_processes(tiny_model):
    with pytest.raises(EngineError, match="preemption_mode swap runs in one process"):
        LLM(tiny_model, scheduler=SchedulerConfig(preemption_mode="swap"), tp=2, kv_memory_gb=0.01)
