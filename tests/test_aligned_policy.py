"""AlignedServe: the length quad-tree and the aligned policy's decode batches."""

import pytest
from conftest import toy_scheduler

from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.perf import make_predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.length_tree import LengthQuadTree
from medha.scheduler.policies.aligned_policy import AlignedPolicy
from medha.sim.replay import replay


def decode(rid: str, kv_len: int, last_token_s: float = 0.0) -> Request:
    r = Request(rid, 0.0, kv_len, 64)
    r.num_scheduled = r.num_computed = kv_len
    r.token_times_s.append(last_token_s)
    return r


def policy(predictor="roofline-padded", num_blocks=1 << 16, **config) -> AlignedPolicy:
    p = AlignedPolicy(SchedulerConfig.from_flat(policy="aligned", tpot_target_s=0.05, **config))
    p.bind(make_predictor(predictor, "llama-3-8b", "h100"), BlockManager(num_blocks), 32768)
    return p


# short (dense), medium, long: ids tell the cluster
CLUSTERS = {"s": (20, 100), "m": (5, 2000), "l": (3, 20000)}


def clustered(p: AlignedPolicy, now: float = 0.0) -> list[Request]:
    reqs = [
        decode(f"{name}{i}", base + 3 * i) for name, (n, base) in CLUSTERS.items() for i in range(n)
    ]
    p._sync(reqs)
    return reqs


def names(batch: list[Request]) -> set[str]:
    return {r.request_id[0] for r in batch}


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


def test_density_first_picks_the_dense_cluster_and_keeps_long_contexts_apart():
    p = policy(aligned_min_batch=8)
    clustered(p)
    assert p._dense_path()[-1].count >= 8
    batch = p.search(now=0.0)
    # Padded attention: the short and medium decodes are cheaper together (one weight read),
    # the long ones are not worth padding every short context to 20K tokens.
    assert names(batch) == {"s", "m"} and len(batch) == 25


def test_plain_roofline_batches_every_decode():
    p = policy(predictor="roofline", aligned_min_batch=8)
    reqs = clustered(p)
    assert len(p.search(now=0.0)) == len(reqs)


def test_batches_take_turns_and_the_candidate_is_prepared_ahead():
    p = policy(aligned_min_batch=8)
    reqs = clustered(p)
    first = p.select_decodes(reqs, now=0.0)
    assert names(first) == {"s", "m"} and names(p.candidate) == {"l"}
    second = p.select_decodes(reqs, now=0.01)
    assert names(second) == {"l"} and names(p.candidate) == {"s", "m"}


@pytest.mark.parametrize("min_batch", [3, 8])
def test_starvation_promotes_the_waiting_subtree(min_batch):
    p = policy(aligned_min_batch=min_batch, aligned_starvation_s=0.5)
    reqs = clustered(p)
    for r in reqs:
        r.token_times_s[-1] = 1.0
    reqs[-1].token_times_s[-1] = 0.2  # a long one has waited 0.8 s at t = 1
    promoted = p.search(now=1.0)
    assert reqs[-1] in promoted
    # With 3 long decodes their range is a batch; a batch of 8 needs every decode.
    assert len(promoted) == (3 if min_batch == 3 else len(reqs))
    assert names(p.search(now=0.6)) == {"s", "m"}  # 0.4 s: not starved yet


def test_min_batch_size_merges_a_sparse_range_with_its_neighbours():
    p = policy(aligned_min_batch=40)  # more than any cluster holds
    reqs = clustered(p)
    assert p._dense_path() == [p.tree.root]
    assert len(p.search(now=0.0)) == len(reqs)


def test_memory_threshold_caps_a_batch():
    p = policy(predictor="roofline", num_blocks=1000, aligned_memory_fraction=0.05)
    reqs = clustered(p)
    batch = p.search(now=0.0)
    assert sum(p.tree.blocks_for(r.num_scheduled) for r in batch) <= 50
    assert 0 < len(batch) < len(reqs)
    max_seqs = policy(predictor="roofline", max_num_seqs=7)
    clustered(max_seqs)
    assert len(max_seqs.search(now=0.0)) == 7


def test_every_ready_decode_still_runs_under_a_tight_threshold():
    sched = toy_scheduler(
        policy="aligned", num_blocks=200, aligned_min_batch=2, aligned_memory_fraction=0.05
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
