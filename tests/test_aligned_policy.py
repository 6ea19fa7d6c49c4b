"""AlignedServe: the length quad-tree, Density First Search (Algorithm 1), batch-level scheduling
(Algorithm 2), the host-pool transfers and the starvation rule. The paper gives no worked example
with numbers, so the cases are hand-computed: blocks of 16 tokens, leaves of 64 tokens, the root
covering [0, 65536) in quarters of 16384, 4096, 1024, 256 and 64 tokens."""

import pytest
from conftest import toy_scheduler

from medha.core.request import Request, RequestState
from medha.perf import make_predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.length_tree import LengthQuadTree
from medha.scheduler.policies.aligned_policy import AlignedPolicy
from medha.sim.replay import replay


def decode(rid: str, kv_len: int) -> Request:
    r = Request(rid, 0.0, kv_len, 64)
    r.num_scheduled = r.num_computed = kv_len
    r.transition(RequestState.PREFILLING)
    r.transition(RequestState.DECODING)
    return r


def many(prefix: str, n: int, kv_len: int) -> list[Request]:
    return [decode(f"{prefix}{i}", kv_len) for i in range(n)]


def policy(num_blocks=1000, predictor="roofline-padded", **config) -> AlignedPolicy:
    """M_thr = memory_fraction x num_blocks (100 blocks by default)."""
    config = {"aligned_memory_fraction": 0.1, **config}
    p = AlignedPolicy(SchedulerConfig.from_flat(policy="aligned", **config))
    p.bind(make_predictor(predictor, "llama-3-8b", "h100"), BlockManager(num_blocks), 32768)
    return p


def pooled(p: AlignedPolicy, reqs: list[Request], now: float = 0.0) -> None:
    p._sync(reqs, now)


def ids(reqs) -> list[str]:
    return sorted(r.request_id for r in reqs)


def test_defaults_are_the_papers():
    settings = SchedulerConfig(policy="aligned").aligned
    assert (settings.min_batch, settings.memory_fraction) == (36, 0.4)
    assert settings.prefetch and settings.batching == "dfs"
    p = policy(num_blocks=5000, aligned_memory_fraction=0.4)
    assert (p.max_blocks, p.tree.root.width) == (2000, 65536)


def test_tree_counts_requests_and_blocks_after_inserts_moves_and_removes():
    tree = LengthQuadTree(max_len=4096, leaf_tokens=64, block_size=16)
    a, b, c = decode("a", 10), decode("b", 100), decode("c", 3000)
    for r in (a, b, c):
        tree.insert(r, r.num_scheduled)
    assert (tree.root.count, tree.root.blocks) == (3, 1 + 7 + 188)
    low = tree.path(10)[1]  # [0, 1024): a and b
    assert (low.lo, low.width, low.count, low.blocks) == (0, 1024, 2, 8)
    tree.insert(a, 40)  # a grows within its leaf: two blocks more
    assert (tree.root.count, tree.root.blocks, low.blocks) == (3, 198, 10)
    tree.insert(b, 1500)  # b moves to another quarter
    assert (low.count, low.blocks, tree.path(1500)[1].count) == (1, 3, 1)
    tree.remove("c")
    tree.remove("a")
    assert (tree.root.count, tree.root.blocks, low.count, low.blocks) == (1, 94, 0, 0)
    assert [r.request_id for r in tree.root.requests()] == ["b"]


def test_dfs_case1_takes_the_first_node_top_down_within_both_thresholds():
    """Root and the [0, 16384), [0, 4096) quarters hold 695 blocks > M_thr = 100: case 2
    descends to the densest child each time. [0, 1024) holds 9 requests in 81 blocks: the batch,
    both leaves in it (not only the denser one a deeper search would stop at)."""
    p = policy(aligned_min_batch=4)
    a, b, long = many("a", 6, 100), many("b", 3, 200), many("l", 5, 2000)
    pooled(p, a + b + long)
    batch, node = p._dfs([p.tree.root])
    assert (node.lo, node.width) == (0, 1024)
    assert ids(batch) == ids(a + b)


def test_dfs_case3_widens_with_right_siblings_when_too_few():
    """M_thr = 100, N_thr = 8. [0, 1024) holds 135 blocks: over M_thr, so the search goes to its
    densest quarter [0, 256) (3 requests, 21 blocks): within M_thr but under N_thr, case 3.
    No left sibling; R-Search takes [256, 512) whole (59 blocks, 5 requests) and of [512, 768)
    its nearest request that still fits (97 blocks); the second would make 135."""
    p = policy(aligned_min_batch=8)
    a, b, c = many("a", 3, 100), many("b", 2, 300), many("c", 2, 600)
    pooled(p, a + b + c + many("l", 2, 20000))
    batch, node = p._dfs([p.tree.root])
    assert (node.lo, node.width) == (0, 1024)
    assert ids(batch) == ids(a + b + c[:1])
    assert sum(p.tree.blocks_for(r.num_scheduled) for r in batch) == 97 <= p.max_blocks


def test_dfs_case3_searches_left_siblings_first_and_stops_at_n_thr():
    """N_thr = 5: the densest quarter [256, 512) has 3 requests (57 blocks); L-Search adds
    [0, 256) (14 blocks) and reaches 5 requests, so R-Search leaves [512, 768) alone."""
    p = policy(aligned_min_batch=5)
    a, b, c = many("a", 2, 100), many("b", 3, 300), many("c", 1, 600)
    pooled(p, a + b + c + many("l", 2, 20000))
    batch, _ = p._dfs([p.tree.root])
    assert ids(batch) == ids(a + b)


def test_dfs_edge_cases_root_within_m_thr_partial_sibling_and_a_leaf_over_m_thr():
    p = policy(aligned_min_batch=36)
    pooled(p, many("a", 3, 100))  # the root holds 21 blocks but 3 < N_thr: all of it
    batch, node = p._dfs([p.tree.root])
    assert node is p.tree.root and len(batch) == 3
    p = policy(aligned_min_batch=36)
    few = many("a", 3, 100) + many("b", 2, 5000)  # 21 + 2 x 313 = 647 blocks
    pooled(p, few)
    batch, _ = p._dfs([p.tree.root])
    # root and [0, 16384) > M_thr; [0, 4096) has 3 (21 blocks) < N_thr: case 3 under
    # [0, 16384), whose R-Search meets [4096, 8192) (626 blocks) and takes none of its 313-block
    # requests
    assert ids(batch) == ids(few[:3])
    p = policy(aligned_min_batch=2)
    pooled(p, many("x", 3, 2000))  # one leaf of 3 x 125 blocks: its shortest up to 100 blocks
    batch, node = p._dfs([p.tree.root])
    assert node.width == 64 and len(batch) == 1  # 125 blocks each: only one, never none


def test_fcfs_batching_ablation_takes_the_pool_in_order():
    """M_thr = 200. In pool order: 38 + 75 + 38 + 38 blocks fit, the fifth would make 227. DFS
    takes the four 600s of [0, 1024) (152 blocks) instead, leaving the 1200 out."""
    lens = (600, 1200, 600, 600, 600)
    for batching, expected in (
        ("fcfs", ["x0", "x1", "x2", "x3"]),
        ("dfs", ["x0", "x2", "x3", "x4"]),
    ):
        p = policy(aligned_batching=batching, aligned_min_batch=2, aligned_memory_fraction=0.2)
        reqs = [decode(f"x{i}", n) for i, n in enumerate(lens)]
        for i in range(len(reqs)):
            pooled(p, reqs[: i + 1], now=float(i))
        p._generate(now=5.0)
        assert ids(p.batch_buffer) == expected


def run_iteration(p: AlignedPolicy, decodes: list[Request], now: float = 0.0) -> list[Request]:
    return p.select_decodes(decodes, now)


def test_algorithm2_first_batch_runs_and_the_next_is_prepared():
    """Two length clusters: the first search gives the dense one; it runs, and the candidate
    batch buffer already holds the other."""
    p = policy(aligned_min_batch=4)
    a, b = many("a", 6, 100), many("b", 4, 2100)  # 42 and 4 x 132 blocks
    running = run_iteration(p, a + b)
    assert ids(running) == ids(a)
    assert ids(p.batch_buffer) == ["b0"]  # a leaf over M_thr: its first request within 100
    assert p.stats["batches"] == 2 and p.switch_fraction() == 0.0


def test_algorithm2_refills_from_requests_buffer_before_switching():
    """Case 1 before case 2: a request that finished leaves room; the prefetched one of the
    running batch's length takes it, not the candidate batch."""
    p = policy(aligned_min_batch=4, aligned_running_seqs=6)
    a = many("a", 6, 100)
    late = decode("z", 140)  # the leaf [128, 192), next to the running batch's [64, 128)
    other = many("b", 4, 2100)
    run_iteration(p, a + other)
    pooled_now = a + other + [late]
    run_iteration(p, pooled_now)  # z enters the pool, out of the running batch's range
    assert "z" not in p.requests_buffer
    for r in a:
        r.num_scheduled += 40  # the running batch grew to 140
    run_iteration(p, pooled_now)
    assert "z" in p.requests_buffer  # now in range: prefetched
    a[0].transition(RequestState.FINISHED)
    running = run_iteration(p, [r for r in pooled_now if r is not a[0]])
    assert ids(running) == ids(a[1:] + [late])
    assert p.stats["switch_iterations"] == 0


def test_algorithm2_switch_takes_the_candidate_batch_and_evicts_the_old_longest():
    """Case 2: no requests buffer and a running batch under N_thr = 3: the candidate batch joins
    (a switch iteration). Case 3 during the switch: the longest request of the old batch is
    evicted to the requests buffer, even though a new one is longer."""
    p = policy(
        aligned_min_batch=3, aligned_decode_blocks=200, aligned_memory_fraction=0.5
    )  # M_thr = 100 of the decode device's 200 blocks
    a = many("a", 2, 100) + [decode("a2", 150)]  # 7, 7, 10 blocks
    b = many("b", 2, 700)  # 44 blocks each
    everyone = a + b
    running = run_iteration(p, everyone)
    assert ids(running) == ids(a)
    a[0].transition(RequestState.FINISHED)
    everyone = everyone[1:]
    running = run_iteration(p, everyone)
    assert ids(running) == ids(a[1:] + b)
    assert p.stats["switch_iterations"] == 1
    for r in b:
        r.num_scheduled = 1500  # 94 blocks each next iteration: 7 + 10 + 188 > 200
    run_iteration(p, everyone)
    assert ids(p.requests_buffer.values()) == ["a2"]  # the old batch's longest, not a b
    assert p.stats["blocks_out"] == 10


@pytest.mark.parametrize("on_room", [False, True])
def test_switch_waits_for_a_batch_under_n_thr_unless_read_literally(on_room):
    """N_thr = 2: after one of three finishes, two still run. By default that batch saturates
    the device and keeps running alone; read literally, the candidate batch joins at once."""
    p = policy(aligned_min_batch=2, aligned_switch_on_room=on_room)
    a = many("a", 2, 100) + [decode("a2", 150)]
    b = many("b", 2, 700)
    run_iteration(p, a + b)
    a[0].transition(RequestState.FINISHED)
    running = run_iteration(p, a[1:] + b)
    assert ids(running) == (ids(a[1:] + b) if on_room else ids(a[1:]))
    assert p.stats["switch_iterations"] == on_room


def test_transfers_cost_their_bytes_over_nvlink_or_pcie():
    reqs = many("a", 4, 160)  # 10 blocks each, all move into the decode device
    times = {}
    for prefetch in (True, False):
        p = policy(aligned_min_batch=2, aligned_prefetch=prefetch)
        run_iteration(p, reqs)
        times[prefetch] = p.kv_move_time_s()
        assert p.kv_move_time_s() == 0.0  # read once
    model = make_predictor("roofline", "llama-3-8b", "h100")
    block_bytes = model.model.kv_bytes_per_token(2) * 16
    assert times[True] == pytest.approx(40 * block_bytes / model.hardware.link_bw)
    assert times[False] == pytest.approx(40 * block_bytes / model.hardware.host_link_bw)


def test_a_starving_subtree_gets_the_next_batch():
    """A lone long request never forms a dense batch; once its subtree has generated no batch
    for starvation_s, the next batch is its own."""
    p = policy(aligned_min_batch=4, aligned_starvation_s=1.0, aligned_running_seqs=4)
    lone = decode("lone", 9000)
    shorts = many("s", 12, 100)
    pooled(p, [lone], now=0.0)
    pooled(p, [lone] + shorts, now=0.5)
    p._generate(now=0.9)
    assert "lone" not in ids(p.batch_buffer)
    p.batch_buffer = []  # (dropped, as if run)
    p._generate(now=1.2)  # lone has waited 1.2 s; its subtrees have never batched
    assert ids(p.batch_buffer) == ["lone"]
    assert p.stats["starved_batches"] == 1
    p2 = policy(aligned_min_batch=4, aligned_starvation_s=None, aligned_running_seqs=4)
    pooled(p2, [lone] + shorts, now=0.0)
    p2._generate(now=100.0)
    assert "lone" not in ids(p2.batch_buffer)


def test_every_ready_decode_still_runs_under_a_tight_threshold():
    sched = toy_scheduler(
        policy="aligned",
        num_blocks=200,
        aligned_min_batch=2,
        aligned_memory_fraction=0.05,
        aligned_decode_blocks=60,
    )
    reqs = [Request(f"r{i}", 0.01 * i, 40 + 150 * (i % 3), 20) for i in range(12)]
    replay(sched, reqs, on_batch=lambda b, t: sched.check_invariants())
    assert all(r.state.is_done and r.num_output_tokens == 20 for r in reqs)
    assert sched.blocks.num_used == 0


@pytest.mark.parametrize(
    "bad",
    [
        {"aligned_memory_fraction": 0.0},
        {"aligned_memory_fraction": 1.5},
        {"aligned_min_batch": 0},
        {"aligned_starvation_s": -1.0},
        {"aligned_batching": "lifo"},
        {"aligned_decode_blocks": 0},
        {"aligned_widen": "grandparent"},
        {"aligned_starvation_scope": "all"},
    ],
)
def test_config_validation(bad):
    with pytest.raises(ValueError):
        SchedulerConfig.from_flat(policy="aligned", **bad)


def test_padded_predictor_pads_decodes_to_the_longest_context():
    plain = make_predictor("roofline", "llama-3-8b", "h100")
    padded = make_predictor("roofline-padded", "llama-3-8b", "h100")
    lens = [100, 20000, 300]
    expected = plain.linear_time(3, 3) + 3 * plain.decode_attention_time(20000)
    assert padded.shape_time((), lens) == pytest.approx(expected)
    assert padded.shape_time((), lens) > plain.shape_time((), lens)
    assert padded.shape_time((), [500] * 4) == pytest.approx(plain.shape_time((), [500] * 4))
    # a prefill chunk is priced as before; only the decodes are padded
    with_chunk = padded.shape_time([(256, 0)], lens)
    assert with_chunk - padded.shape_time((), lens) == pytest.approx(
        plain.shape_time([(256, 0)], lens) - plain.shape_time((), lens)
    )
    timer = padded.timer()
    timer.add_decodes(lens)
    assert timer.time_with_prefill(256, 0) == pytest.approx(with_chunk)


def test_cta_predictor_bounds_decode_attention_by_its_longest_thread_block():
    """llama-3-8b on h100: one CTA keeps 4 warps x 16 tokens x 128 dims x 2 B = 16 KiB in flight,
    27.3 GB/s at 600 ns; a token's K and V of one head over 32 layers take 16 KiB / that rate."""
    plain = make_predictor("roofline", "llama-3-8b", "h100")
    cta = make_predictor("roofline-cta", "llama-3-8b", "h100")
    token_s = 2 * 128 * 2 * 32 / (4 * 16 * 128 * 2 / 600e-9)
    assert cta._token_s == pytest.approx(token_s)
    lens = [632] * 63 + [4696]  # v1: 64 x 32 (head, sequence) pairs > 512, context <= 8192
    tail = 4697 * token_s
    assert tail > plain.decode_attention_total(lens)  # the long CTA outlasts the whole batch
    assert cta.shape_time((), lens) == pytest.approx(plain.linear_time(64, 64) + tail)
    short = [632] * 64  # one length: the tail is below the roofline sum, nothing changes
    assert cta.shape_time((), short) == pytest.approx(plain.shape_time((), short))
    # v2 (past 8192, or few pairs) splits a context into 512-token partitions
    assert cta.cta_tail(9000, 64) == pytest.approx(512 * token_s)
    assert cta.cta_tail(4696, 8) == pytest.approx(512 * token_s)
    timer = cta.timer()
    timer.add_decodes(lens[:40])
    timer.add_decode(4696)
    timer.add_decodes(lens[40:63])
    assert timer.time() == pytest.approx(cta.shape_time((), lens))


def test_cta_rate_can_be_set_by_spec():
    """roofline-cta:4.4: one CTA streams 4.4 GB/s; a 4697-token context's K and V of one head
    in 32 layers (4697 x 512 B x 32) then take 4697 x 512 x 32 / 4.4e9 s."""
    cta = make_predictor("roofline-cta:4.4", "llama-2-7b", "h100")
    assert cta.name == "roofline-cta:4.4"
    assert cta.cta_tail(4696, 64) == pytest.approx(4697 * 512 * 32 / 4.4e9)


def test_case3_climbs_bottom_up_as_the_paper_writes_when_told():
    """`--aligned-widen climb`: [0, 256) holds 3 requests (21 blocks) under N_thr = 8; its
    siblings under [0, 1024) add 2 (5 in all); the search climbs to [0, 4096) and takes in
    [1024, 2048) (3 more, 8). The default takes in the parent's siblings only."""
    reqs = many("a", 3, 100) + many("b", 2, 300) + many("c", 3, 1500)
    for widen, want, top in (("climb", reqs, 4096), ("parent", reqs[:5], 1024)):
        p = policy(num_blocks=10000, aligned_min_batch=8, aligned_widen=widen)
        pooled(p, reqs)
        path = p.tree.path(100)[:5]  # root .. [0, 256)
        assert (path[-1].lo, path[-1].width) == (0, 256)
        batch, node = p._dfs(path)
        assert ids(batch) == ids(want) and node.width == top


def test_case3_climb_takes_the_nearest_sibling_first_left_or_right():
    """[512, 768) under [0, 1024), N_thr = 4: its left neighbour is empty, so the nearest
    requests are in its right neighbour [768, 1024), not in [0, 256) two to the left (which
    the parent rule's left-first L-Search takes)."""
    x, y, z = many("x", 2, 600), many("y", 2, 100), many("z", 2, 800)
    for widen, want in (("climb", x + z), ("parent", x + y)):
        p = policy(num_blocks=10000, aligned_min_batch=4, aligned_widen=widen)
        pooled(p, x + y + z)
        path = p.tree.path(600)[:5]
        assert (path[-1].lo, path[-1].width) == (512, 256)
        assert ids(p._dfs(path)[0]) == ids(want)


def test_starvation_reads_every_nodes_time_stamp_when_told():
    """The longest-pooled request's subtrees generated a batch at t = 1; another lone request's
    have never: at t = 2 (threshold 1 s) the oldest-request rule serves the first (its wait
    since the stamp is 1 s), every node's stamps the second (1.5 s since it was pooled)."""
    for scope, want in (("oldest", "o"), ("nodes", "p")):
        p = policy(aligned_min_batch=4, aligned_starvation_s=1.0, aligned_starvation_scope=scope)
        o, q = decode("o", 9000), decode("p", 30000)
        pooled(p, [o], now=0.0)
        pooled(p, [o, q], now=0.5)
        for n in p.tree.path(9000):
            p.stamps[(n.lo, n.width)] = 1.0
        p._generate(now=2.0)
        assert ids(p.batch_buffer) == [want] and p.stats["starved_batches"] == 1
