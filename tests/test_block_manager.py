import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from medha.perf.model_specs import get_model
from medha.perf.parallel_config import ParallelConfig
from medha.scheduler.block_manager import BlockAccountingError, BlockManager


def test_grow_rounds_up_to_blocks_and_free_returns_them():
    bm = BlockManager(10, block_size=16)
    assert bm.grow("a", 17) == 17
    assert bm.blocks_of("a") == [0, 1] and bm.num_free == 8
    assert bm.grow("a", 32) == 32 and bm.num_used == 2  # still fits in two blocks
    assert bm.blocks_needed("a", 33) == 1
    assert bm.free("a") == 2 and bm.num_free == 10
    bm.check_invariants()


def test_partial_grant_and_reserve():
    bm = BlockManager(4, block_size=16)
    assert bm.grow("a", 16 * 10) == 64  # only four blocks exist
    bm.free("a")
    assert bm.grow("b", 64, reserve=1) == 48  # one block stays free
    assert bm.num_free == 1
    assert bm.grow("c", 16, reserve=1) == 0 and "c" not in bm.owners()
    bm.check_invariants()


def test_invariant_check_catches_corruption():
    bm = BlockManager(4)
    bm.grow("a", 16)
    bm._free.append(bm.blocks_of("a")[0])  # the same block free and owned
    with pytest.raises(BlockAccountingError):
        bm.check_invariants()
    bm = BlockManager(4)
    bm.grow("a", 16)
    bm._tables["a"].pop()  # a leaked block
    with pytest.raises(BlockAccountingError):
        bm.check_invariants()


def test_capacity_from_memory():
    m = get_model("llama-3-8b")
    # 16 KiB of KV per token per device at TP8 in bf16: 2 * 32 layers * 1 kv head * 128 * 2 B
    bm = BlockManager.from_memory(16 * 1024 * 16 * 1000, m, ParallelConfig(tp=8), 2)
    assert bm.num_blocks == 1000
    bm2 = BlockManager.from_memory(16 * 1024 * 16 * 1000, m, ParallelConfig(tp=8, kvp=2), 2)
    assert bm2.num_blocks == 2000
    with pytest.raises(ValueError, match="no 16-token block"):
        BlockManager.from_memory(10, m, ParallelConfig(), 2)


@pytest.mark.parametrize("n", [0, -1, 2.5])
def test_bad_sizes(n):
    with pytest.raises(ValueError, match="num_blocks"):
        BlockManager(n)


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.tuples(st.sampled_from("abcde"), st.integers(0, 200), st.booleans()), max_size=60)
)
def test_random_operations_keep_accounting_exact(ops):
    bm = BlockManager(20, block_size=8)
    for rid, tokens, free in ops:
        if free:
            bm.free(rid)
        else:
            held = bm.grow(rid, tokens)
            assert held <= tokens and held <= bm.tokens_held(rid) or held == 0
        bm.check_invariants()
    for rid in "abcde":
        bm.free(rid)
    assert bm.num_free == 20


def test_kvp_blocks_fill_groups_in_order_and_count_room_per_group():
    from medha.scheduler.block_manager import KvpBlockManager

    m = KvpBlockManager(4, 16, 2, 32)  # 2 groups of 4 blocks; 32 tokens in group 0 first
    assert m.capacity_tokens == (2 + 4) * 16
    assert m.grow("a", 96) == 96
    assert m.blocks_of("a") == [0, 1, 4, 5, 6, 7] and m.groups_holding("a") == 2
    # two blocks are free, but in group 0: b's third block onwards lies in the full group 1
    assert m.num_free == 2
    assert m.shortfall("b", 32) == 0
    assert m.shortfall("b", 80) == 3
    assert m.shortfall("b", 80, freeable=("a",)) == 0
    assert not m.can_grow_each(1)
    assert m.grow("b", 80) == 32  # what group 0 could give
    m.check_invariants()
    m.free("a")
    assert m.grow("b", 80) == 80 and m.shortfall("b", 80) == 0
    m.check_invariants()
    with pytest.raises(ValueError, match="multiple of the block size"):
        KvpBlockManager(4, 16, 2, 40)
