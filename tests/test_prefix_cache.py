"""Prefix caching in the scheduler: block keys, shared blocks and their reference counts, the
LRU of cached blocks, the host tier, and (hypothesis) random request streams with shared
prefixes, aborts, preemptions and swaps run against a model of the KV memory's contents."""

import gzip
import json
import math
import random

import pytest
from conftest import TOKEN_S, toy_scheduler
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from medha.core.batch import BatchResult
from medha.core.request import Request
from medha.perf import ParallelConfig
from medha.perf.toy_predictor import FixedCostPredictor
from medha.scheduler.block_manager import BlockAccountingError, BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.prefix_cache import (
    PrefixBlockManager,
    context_page_keys,
    page_blocks,
    prompt_page_keys,
    reusable_prefix_tokens,
)
from medha.sim.replay import replay
from medha.sim.runner import RunSpec, simulate
from medha.sim.simulator import ClusterConfig, Simulator
from medha.sim.workload.generator import WorkloadConfig
from medha.sim.workload.prefix_trace import (
    ConversationTraceConfig,
    generate_conversations,
    reuse_by_lru,
    write_trace,
)
from medha.sim.workload.traces import TraceError, load_trace

BS = 16


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(50_000) for _ in range(n)]


# ---- keys ----------------------------------------------------------------------------------
def test_a_block_key_stands_for_every_token_up_to_its_end():
    a = Request.from_tokens("a", 0.0, tokens(1, 100), 1)
    b = Request.from_tokens("b", 0.0, tokens(1, 40) + [7] + tokens(1, 100)[41:], 1)
    ka, kb = prompt_page_keys(a, BS), prompt_page_keys(b, BS)
    assert len(ka) == len(kb) == 6  # full blocks only: 100 // 16
    assert ka[:2] == kb[:2]  # the blocks before the changed token (40 lies in block 2)
    assert all(x != y for x, y in zip(ka[2:], kb[2:]))  # every block after it differs
    # the same tokens at another offset are another block
    c = Request.from_tokens("c", 0.0, tokens(1, 100)[16:], 1)
    assert prompt_page_keys(c, BS)[0] not in ka


def test_trace_keys_are_the_hash_ids_of_whole_512_token_pages():
    # 1,100 tokens: three 512-token trace blocks, the last partial (never cached)
    a = Request("a", 0.0, 1100, 1, prefix_hash_ids=[5, 6, 7])
    assert prompt_page_keys(a, BS) == [5, 6] and page_blocks(a, BS) == 512 // BS
    with pytest.raises(ValueError, match="prefix_hash_ids"):
        Request("c", 0.0, 1100, 1, prefix_hash_ids=[5, 6])
    with pytest.raises(ValueError, match="does not divide"):
        page_blocks(a, 48)


# ---- device blocks -------------------------------------------------------------------------
def test_shared_blocks_are_counted_and_cached_ones_evicted_tail_first():
    bm = PrefixBlockManager(8, BS)
    bm.grow("a", 64)  # blocks 0-3
    keys = ["k0", "k1", "k2", "k3"]
    bm.register("a", keys, 4, 1)
    assert bm.match(keys + ["k4"]) == [0, 1, 2, 3]
    bm.acquire("b", bm.match(keys[:2]), 1)
    assert [bm.ref_count(b) for b in range(4)] == [2, 2, 1, 1]
    bm.check_invariants()
    bm.free("a")  # 2 and 3 stay cached, unreferenced; 0 and 1 are still b's
    assert bm.num_free == 8 - 2 and bm.num_cached == 4
    assert bm.shortfall("c", 8 * BS, freeable=("b",)) == 0  # b's blocks free with it
    bm.grow("c", 5 * BS)  # 4 empty blocks, then the oldest released cached one: block 3
    assert not bm.is_cached("k3") and bm.is_cached("k2")
    bm.check_invariants()
    bm.free("b")
    bm.free("c")
    bm.check_invariants()
    assert bm.num_used == 0 and bm.match(keys) == [0, 1, 2]


def test_pages_of_several_blocks_are_shared_and_evicted_whole():
    bm = PrefixBlockManager(12, BS)
    evicted = []
    bm.on_evict = lambda page, key: evicted.append((page, key))
    bm.grow("a", 9 * BS)  # two 4-block pages and a private block
    bm.register("a", ["p0", "p1"], 2, 4)
    bm.acquire("b", bm.match(["p0", "p1", "p2"]), 4)
    assert bm.blocks_of("b") == bm.blocks_of("a")[:8] and bm.num_used == 9
    bm.check_invariants()
    bm.free("a")
    bm.free("b")
    assert bm.num_free == 12 and bm.num_cached == 2
    bm.grow("c", 5 * BS)  # three empty blocks, then the tail page goes whole
    assert evicted == [([4, 5, 6, 7], "p1")] and bm.num_free == 7 and bm.is_cached("p0")
    bm.check_invariants()


def test_a_broken_count_is_caught():
    bm = PrefixBlockManager(4, BS)
    bm.grow("a", 32)
    bm._registered["a"] = (1, 1)
    bm._key_of[0], bm._cached["k"], bm._page[0] = "k", 0, [0]
    bm._ref[0] = 2
    with pytest.raises(BlockAccountingError, match="referenced by 1 tables, counted 2"):
        bm.check_invariants()


def test_prefix_caching_refuses_kvp_block_managers():
    blocks = BlockManager.for_layout(8, BS, ParallelConfig(kvp=2, max_tokens_per_kvp_group=64))
    with pytest.raises(ValueError, match="kvp > 1 is not built"):
        toy_scheduler(blocks=blocks, prefix_cache="device")


# ---- the scheduler -------------------------------------------------------------------------
def test_a_hit_skips_the_cached_prefix_and_its_work():
    sched = toy_scheduler(prefix_cache="device")
    system = tokens(3, 200)
    first = Request.from_tokens("first", 0.0, system + tokens(4, 30), 2)
    replay(sched, [first])
    second = Request.from_tokens("second", 1.0, system + tokens(5, 50), 2)
    sched.add_request(second, 1.0)
    # its deadline and work count the 250 - 192 tokens after the cached blocks
    assert second.total_work_s == pytest.approx(58 * TOKEN_S)
    batch = sched.schedule(1.0)
    (chunk,) = batch.prefills
    assert (chunk.start, chunk.num_tokens) == (192, 58) and second.num_cached_tokens == 192
    # first's 12 blocks, which stayed cached when it finished
    assert chunk.block_table[:12] == sched.blocks.match(prompt_page_keys(first, BS))[:12]
    sched.update(batch, BatchResult(batch.predicted_time_s), 1.1)
    sched.check_invariants()
    st = sched.stats
    assert (st.prefix_starts, st.prefix_query_tokens, st.prefix_hit_tokens) == (2, 480, 192)


def test_a_whole_prompt_in_the_cache_still_computes_its_last_token():
    sched = toy_scheduler(prefix_cache="device")
    prompt = tokens(6, 64)  # four full blocks
    replay(sched, [Request.from_tokens("a", 0.0, prompt, 1)])
    again = Request.from_tokens("b", 1.0, prompt, 1)
    sched.add_request(again, 1.0)
    (chunk,) = sched.schedule(1.0).prefills
    assert (chunk.start, chunk.num_tokens) == (48, 16)


def run_sampling(sched, reqs, abort_at=None):
    """Run `reqs` (arrived) to the end, each sampled token a 7; `abort_at` (request id,
    batches) aborts that request after that many batches. Invariants after each batch."""
    for r in reqs:
        sched.add_request(r, 0.0)
    now, n = 0.0, 0
    while sched.has_unfinished():
        if abort_at is not None and n == abort_at[1]:
            sched.abort(abort_at[0], now)
        batch = sched.schedule(now)
        now += batch.predicted_time_s
        sampled = {c.request.request_id: 7 for c in batch.chunks if c.samples}
        sched.update(batch, BatchResult(batch.predicted_time_s, sampled), now)
        sched.check_invariants()
        n += 1


def test_a_finished_answer_is_cached_up_to_its_last_computed_block():
    sched = toy_scheduler(prefix_cache="device")
    a = Request.from_tokens("a", 0.0, tokens(9, 40), 30)
    run_sampling(sched, [a])
    # 70 tokens of context, the last one sampled and never fed: the KV of 69, four full blocks
    keys = context_page_keys(a, BS, 5)
    assert keys[:2] == prompt_page_keys(a, BS)  # the prompt's chain, continued
    assert [sched.blocks.is_cached(k) for k in keys] == [True] * 4 + [False]
    # a next turn repeating the answer finds the four blocks
    turn = Request.from_tokens("turn", 1.0, a.prompt_token_ids + a.output_token_ids + [1], 2)
    sched.add_request(turn, 1.0)
    (chunk,) = sched.schedule(1.0).prefills
    assert chunk.start == 64 and turn.num_cached_tokens == 64


@pytest.mark.parametrize("outputs", [True, False])
def test_aborted_answers_and_prompts_only_mode_cache_no_answer(outputs):
    sched = toy_scheduler(prefix_cache="device", prefix_cache_outputs=outputs)
    a = Request.from_tokens("a", 0.0, tokens(11, 40), 30)
    b = Request.from_tokens("b", 0.0, tokens(12, 40), 30)
    run_sampling(sched, [a, b], abort_at=("b", 12))  # b aborted half-way through its answer
    assert b.finish_reason == "abort" and 0 < b.num_output_tokens < 30
    assert a.finish_reason == "length"
    for r, answer_cached in ((a, outputs), (b, False)):
        keys = context_page_keys(r, BS, (r.num_tokens - 1) // BS)
        assert all(sched.blocks.is_cached(k) for k in keys[:2])  # the prompt's blocks
        assert all(sched.blocks.is_cached(k) == answer_cached for k in keys[2:])


def test_waiting_requests_hold_no_cached_blocks():
    # one sequence slot, first come first served: b gets it; c is looked up (it shares the
    # cached system prompt), not scheduled, and gives its hit back. (Under LARS, c's two
    # tokens left would go ahead of b's 300 within b's slack, and b is never looked up.)
    sched = toy_scheduler(prefix_cache="device", max_num_seqs=1, policy="fcfs")
    system = tokens(7, 64)
    replay(sched, [Request.from_tokens("a", 0.0, system + [1], 1)])
    b = Request.from_tokens("b", 1.0, system + tokens(8, 300), 1)
    c = Request.from_tokens("c", 1.0, system + [2, 3], 1)
    sched.add_request(b, 1.0)
    sched.add_request(c, 1.0)
    batch = sched.schedule(1.0)
    assert [ch.request for ch in batch.prefills] == [b]
    assert c.num_scheduled == 0 and not sched.blocks.blocks_of("c")
    sched.check_invariants()


def test_evicted_blocks_go_to_the_host_tier_and_come_back():
    sched = toy_scheduler(
        num_blocks=8, watermark=0.0, prefix_cache="device+host", host_cache_blocks=16
    )
    a_prompt, b_prompt = tokens(10, 97), tokens(11, 97)
    replay(sched, [Request.from_tokens("a", 0.0, a_prompt, 1)])  # caches 6 blocks
    outs = []
    replay(
        sched,
        [Request.from_tokens("b", 1.0, b_prompt, 1)],  # needs 7: a's oldest go to the host
        on_batch=lambda b, t: outs.extend(b.cache_out),
    )
    assert len(outs) == 5 and sched.stats.host_cache_out_blocks == 5
    ins, chunks = [], []

    def seen(b, t):
        ins.extend(b.cache_in)
        chunks.extend((c.start, c.num_tokens) for c in b.prefills)

    again = Request.from_tokens("a2", 2.0, a_prompt, 1)
    replay(sched, [again], on_batch=seen)
    assert again.num_cached_tokens == 96 and again.num_host_cached_tokens == 5 * BS
    assert len(ins) == 5 and chunks == [(96, 1)]
    assert {h for h, _ in ins} == {h for _, h in outs}  # the very host blocks written
    sched.check_invariants()


def test_reloading_is_skipped_when_recomputing_is_predicted_cheaper():
    sched = toy_scheduler(
        num_blocks=8,
        watermark=0.0,
        prefix_cache="device+host",
        host_cache_blocks=16,
        swap_bandwidth_gbps=1e-6,  # a 4 KB block takes 4 s to move, its 16 tokens 16 ms to compute
    )
    a_prompt = tokens(12, 97)
    replay(sched, [Request.from_tokens("a", 0.0, a_prompt, 1)])
    replay(sched, [Request.from_tokens("b", 1.0, tokens(13, 97), 1)])
    again = Request.from_tokens("a2", 2.0, a_prompt, 1)
    replay(sched, [again])
    # only the head block, which stayed on the device (a chain is evicted from its end)
    assert again.num_host_cached_tokens == 0 and again.num_cached_tokens == BS


# ---- random streams against a model of the KV memory ----------------------------------------
class Memory:
    """What each device, host-cache and swap block holds: (token, position) per slot, written
    by the chunks and the copies a batch carries. A request reads its block table before its
    chunk: the first slot of each block, and the slot just before the chunk, must hold its own
    context there. A trace request's token at a prompt position is the hash id of the 512
    tokens holding it (requests agree on it exactly when they share that page)."""

    def __init__(self, block_size):
        self.bs = block_size
        self.device, self.host, self.swap = {}, {}, {}

    def copy(self, src, s, dst, d):
        dst[d] = list(src.get(s, [None] * self.bs))

    @staticmethod
    def token(r, p):
        if r.prompt_token_ids is not None or p >= r.prompt_len:
            return r.context_token_ids(p, p + 1)[0] if r.prompt_token_ids else ("out", p)
        return r.prefix_hash_ids[p // 512]

    def run(self, batch):
        bs = self.bs
        for d, h in batch.cache_out:
            self.copy(self.device, d, self.host, h)
        for sw in batch.swap_in:
            for h, d in zip(sw.host_blocks, sw.device_blocks):
                self.copy(self.swap, h, self.device, d)
        for sw in batch.swap_out:
            for d, h in zip(sw.device_blocks, sw.host_blocks):
                self.copy(self.device, d, self.swap, h)
        for h, d in batch.cache_in:
            self.copy(self.host, h, self.device, d)
        for c in batch.chunks:
            r, table = c.request, c.block_table
            for p in sorted({*range(0, c.start, bs), c.start - 1} - {-1}):  # what it reads
                got = self.device.get(table[p // bs], [None] * bs)[p % bs]
                assert got == (self.token(r, p), p), f"{r.request_id} reads a foreign slot at {p}"
            for p in range(c.start, c.end):
                self.device.setdefault(table[p // bs], [None] * bs)[p % bs] = (self.token(r, p), p)


@st.composite
def streams(draw):
    systems = [tokens(draw(st.integers(0, 10**6)), draw(st.integers(1, 80))) for _ in range(3)]
    reqs, t = [], 0.0
    for i in range(draw(st.integers(2, 14))):
        t += draw(st.sampled_from([0.0, 0.0, 0.01, 0.2]))
        kind = draw(st.integers(0, 2))
        if kind == 0 or not reqs:  # a shared system prompt and a question
            prompt = draw(st.sampled_from(systems)) + tokens(i, draw(st.integers(1, 60)))
        elif kind == 1:  # the next turn of an earlier conversation, repeating its answer
            prev = draw(st.sampled_from(reqs))
            # (run_stream samples every token as a 7: what the answer will be, if it finishes)
            answer = [7] * draw(st.integers(0, prev.max_tokens))
            prompt = prev.prompt_token_ids + answer + tokens(i, draw(st.integers(1, 40)))
        else:  # something new
            prompt = tokens(1000 + i, draw(st.integers(1, 120)))
        reqs.append(Request.from_tokens(f"r{i}", t, prompt[:200], draw(st.integers(1, 40))))
    return reqs


@st.composite
def trace_streams(draw):
    """Requests as a trace gives them: 512-token pages of prefix hash ids, shared system
    prompts and conversations resending their pages, each prompt ending in a page of its own."""
    fresh = iter(range(10**6))
    systems = [[next(fresh) for _ in range(draw(st.integers(1, 2)))] for _ in range(2)]
    reqs, pages, t = [], [], 0.0
    for i in range(draw(st.integers(2, 10))):
        t += draw(st.sampled_from([0.0, 0.0, 0.0, 0.05, 1.0]))
        kind = draw(st.integers(0, 2))
        if kind == 0 or not reqs:
            full = draw(st.sampled_from(systems))
        elif kind == 1:
            full = draw(st.sampled_from(pages))
        else:
            full = []
        full = (full + [next(fresh) for _ in range(draw(st.integers(0, 1)))])[:3]
        pages.append(full)
        n = 512 * len(full) + draw(st.integers(1, 511))
        reqs.append(
            Request(f"r{i}", t, n, draw(st.integers(1, 300)), prefix_hash_ids=full + [next(fresh)])
        )
    return reqs


def run_stream(sched, reqs, aborts, block_size):
    """Run `reqs` through `sched`, aborting at the given batch numbers, with every batch's
    copies and chunks applied to a Memory and the invariants checked after each."""
    mem = Memory(block_size)
    pending = sorted(reqs, key=lambda r: r.arrival_s)
    now, i, n = 0.0, 0, 0
    while i < len(pending) or sched.has_unfinished():
        while i < len(pending) and pending[i].arrival_s <= now:
            sched.add_request(pending[i], now)
            i += 1
        if n in aborts and sched.has_unfinished():
            live = sorted(r.request_id for r in sched.live_requests())
            sched.abort(live[n % len(live)], now)
        batch = sched.schedule(now)
        if batch is None:
            now = pending[i].arrival_s if i < len(pending) else now + 0.01
            assert i < len(pending) or not sched.has_unfinished() or sched.wake_at()
            continue
        mem.run(batch)
        now += batch.predicted_time_s
        sampled = {c.request.request_id: 7 for c in batch.chunks if c.samples}
        sched.update(batch, BatchResult(batch.predicted_time_s, sampled), now)
        sched.check_invariants()  # every reference count, no block lost or shared wrongly
        n += 1
        assert n < 5000
    bm = sched.blocks
    assert bm.num_used == 0 and not bm.owners()  # nothing leaks
    assert sched.kv.swap_pool is None or sched.kv.swap_pool.num_free == 8
    assert sched.stats.prefix_hit_tokens >= sum(r.num_cached_tokens for r in reqs)
    assert all(r.num_output_tokens <= r.max_tokens for r in reqs)
    assert math.isfinite(now)


CACHE_SETTINGS = dict(
    mode=st.sampled_from(["device", "device+host"]),
    preemption=st.sampled_from(["recompute", "swap"]),
    policy=st.sampled_from(["fcfs", "lars", "edf"]),
    host_blocks=st.integers(1, 12),
    aborts=st.lists(st.integers(0, 60), max_size=4),
)


def cached_scheduler(blocks, mode, preemption, policy, host_blocks):
    return toy_scheduler(
        policy=policy,
        blocks=blocks,
        prefix_cache=mode,
        host_cache_blocks=host_blocks,
        preemption_mode=preemption,
        host_kv_blocks=8,
        iteration_budget_s=0.03,
    )


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=streams(), num_blocks=st.integers(16, 28), **CACHE_SETTINGS)
def test_random_streams_keep_every_count_and_every_block_right(
    reqs, num_blocks, mode, preemption, policy, host_blocks, aborts
):
    # 200-token prompts and 40 new tokens fit in 15 blocks
    sched = cached_scheduler(BlockManager(num_blocks, BS), mode, preemption, policy, host_blocks)
    run_stream(sched, reqs, aborts, BS)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(reqs=trace_streams(), num_blocks=st.integers(19, 26), **CACHE_SETTINGS)
def test_random_trace_streams_share_whole_pages_rightly(
    reqs, num_blocks, mode, preemption, policy, host_blocks, aborts
):
    # 128-token blocks: pages of four; prompts of up to 2,047 tokens and 300 new ones fit in 19
    sched = cached_scheduler(
        BlockManager(num_blocks, 128), mode, preemption, policy, 4 * host_blocks
    )
    run_stream(sched, reqs, aborts, 128)


# ---- traces and the simulator --------------------------------------------------------------
def small_conversations(**kw):
    cfg = dict(
        conversations=40,
        system_prompt_tokens=600,
        user_tokens=100,
        output_tokens=20,
        max_context=4096,
        seed=1,
    )
    return ConversationTraceConfig(**(cfg | kw))


def test_trace_files_carry_hash_ids_in_jsonl_csv_and_gzip(tmp_path):
    entries = generate_conversations(small_conversations())
    for fmt in ("jsonl", "csv"):
        path = tmp_path / f"t.{fmt}"
        write_trace(entries, str(path), fmt)
        back = load_trace(path)
        assert [e.hash_ids for e in back] == [e.hash_ids for e in entries]
        assert [e.prompt_len for e in back] == [e.prompt_len for e in entries]
    gz = tmp_path / "t.jsonl.gz"
    gz.write_bytes(gzip.compress((tmp_path / "t.jsonl").read_bytes()))
    assert [e.hash_ids for e in load_trace(gz)] == [e.hash_ids for e in entries]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"timestamp": 0, "input_length": 1100, "output_length": 1, "hash_ids": [1]}\n')
    with pytest.raises(TraceError, match=r"bad.jsonl:1: hash_ids must hold .* = 3 ids"):
        load_trace(bad)
    bad.write_text('{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [-1]}\n')
    with pytest.raises(TraceError, match="hash id -1"):
        load_trace(bad)


def test_the_bundled_mooncake_trace_reuses_a_third_and_lru_caches_little_of_it():
    entries = load_trace("mooncake_conv")
    assert len(entries) == 12031 and all(e.hash_ids for e in entries)
    reuse = reuse_by_lru(entries, [10**6, 4 * 10**6])
    assert 0.35 < reuse["unbounded"]["fraction"] < 0.40
    assert reuse["lru_1000000"]["fraction"] < 0.07 < reuse["lru_4000000"]["fraction"] < 0.2


def test_generated_conversations_resend_their_history():
    entries = generate_conversations(small_conversations())
    assert entries == generate_conversations(small_conversations())  # seeded
    assert all(a.arrival_s <= b.arrival_s for a, b in zip(entries, entries[1:]))
    # a later turn starts with every full block of an earlier one of its conversation
    by_first = {}
    for e in entries:
        by_first.setdefault(e.hash_ids[0], []).append(e)
    chained = 0
    for turns in by_first.values():
        for a, b in zip(turns, turns[1:]):
            full = a.prompt_len // 512
            chained += b.hash_ids[:full] == a.hash_ids[:full]
    assert chained > 0
    assert reuse_by_lru(entries, [])["unbounded"]["fraction"] > 0.5


def sim_with_cache(requests, kv_memory_gb=1.0, **sched):
    sim = Simulator(
        ClusterConfig(kv_memory_gb=kv_memory_gb),
        ParallelConfig(),
        SchedulerConfig(iteration_budget_s=1 / 16, **sched),
        predictor=FixedCostPredictor(TOKEN_S),
    )
    sim.run(requests)
    return requests


def trace_requests(time_scale=1.0):
    entries = generate_conversations(small_conversations())
    return [
        Request(f"r{i}", e.arrival_s * time_scale, e.prompt_len, e.output_len,
                prefix_hash_ids=list(e.hash_ids))
        for i, e in enumerate(entries)
    ]  # fmt: skip


def test_an_unbounded_cache_hits_exactly_the_direct_count():
    # arrivals spread out: every earlier prompt is computed before a request starts
    reqs = sim_with_cache(trace_requests(time_scale=50), prefix_cache="device")
    direct = reusable_prefix_tokens(reqs, 16)
    assert sum(direct.values()) > 0.5 * sum(r.prompt_len for r in reqs)
    assert {r.request_id: r.num_cached_tokens for r in reqs} == direct
    # a host tier that never fills, behind a device that holds little: the same hits
    reqs = sim_with_cache(
        trace_requests(time_scale=50),
        kv_memory_gb=8192 * 256 / 2**30,  # 8,192 tokens of the toy model
        prefix_cache="device+host",
        host_cache_blocks=1 << 40,
    )
    assert {r.request_id: r.num_cached_tokens for r in reqs} == direct
    assert sum(r.num_host_cached_tokens for r in reqs) > 0


def test_bounded_tiers_report_what_the_host_adds(tmp_path):
    trace = tmp_path / "conv.jsonl"
    write_trace(generate_conversations(small_conversations(conversations=80)), str(trace))
    out = {}
    for mode in ("off", "device", "device+host"):
        spec = RunSpec(
            name=mode,
            cluster=ClusterConfig(kv_memory_gb=1.5),  # 12,288 tokens of Llama-3-8B
            parallel=ParallelConfig(),
            scheduler=SchedulerConfig(prefix_cache=mode, host_cache_blocks=4096),
        )  # fmt: skip
        out[mode] = simulate(spec, WorkloadConfig(trace=str(trace)))
    pc = {m: o.summary.get("prefix_cache") for m, o in out.items()}
    assert pc["off"] is None
    dev, host = pc["device"]["all"], pc["device+host"]["all"]
    assert dev["reusable_tokens"] == host["reusable_tokens"] > 0
    assert 0 < dev["hit_rate"] < host["hit_rate"] <= host["reusable_fraction"] + 1e-9
    assert dev["host_hit_tokens"] == 0 < host["host_hit_tokens"]
    assert host["prefill_flops_saved"] > dev["prefill_flops_saved"] > 0
    ttft = {m: o.summary["ttft_s"]["mean"] for m, o in out.items()}
    assert ttft["device+host"] < ttft["device"] < ttft["off"]


def test_the_trace_command_generates_and_counts(tmp_path, capsys):
    from medha.cli import main

    out = tmp_path / "conv.csv"
    assert (
        main(["trace", "generate", "-o", str(out), "--format", "csv", "--conversations", "30"]) == 0
    )
    assert "requests" in capsys.readouterr().out
    assert main(["trace", "reuse", str(out), "--capacity", "2K", "--json"]) == 0
    counts = json.loads(capsys.readouterr().out)
    entries = load_trace(out)
    assert counts == reuse_by_lru(entries, [2000])
    assert counts["lru_2000"]["fraction"] < counts["unbounded"]["fraction"]
    assert main(["trace", "reuse", "sharegpt"]) == 2  # lengths only: no hash ids
    assert "carry no hash_ids" in capsys.readouterr().err
