"""The shapes `medha profile` times reach what the engine will run (issue 48, item 3)."""

from medha.perf.grid import PREFILL_CHUNKS, PREFILL_OFFSETS, Shape, grid

LONG = 131072


def test_the_grid_reaches_the_context_and_the_batch_limit():
    """The 120K prompt's chunks: a chunk ending at the context, offsets doubling up to it, a
    whole prompt of half the context; decode batches up to max_num_seqs; decodes over KV up to
    the context. The grid of fixed constants stopped at offset 6,144, 64 decodes, KV 4,096."""
    shapes = grid(LONG, capacity=10**7, mixed=0, seed=0, max_num_seqs=256)
    prefills = [p for s in shapes for p in s.prefills]
    assert max(n + k for n, k in prefills) == LONG
    assert {k for n, k in prefills if n == 2048} >= {0, 6144, 12288, 49152, 98304, LONG - 2048}
    assert (65536, 0) in prefills and (LONG, 0) in prefills
    assert max(len(s.decode_kv) for s in shapes) == 256
    assert max(kv for s in shapes for kv in s.decode_kv) == LONG - 1
    quick = grid(LONG, capacity=10**7, mixed=0, seed=0, quick=True, max_num_seqs=256)
    assert max(n + k for s in quick for n, k in s.prefills) == LONG
    assert max(len(s.decode_kv) for s in quick) == 256
    assert len(quick) < len(shapes)


def test_every_shape_fits_the_cache_and_the_context():
    for max_len, capacity, seqs in ((LONG, 200_000, 256), (8192, 93_000, 256), (2048, 5_000, 7)):
        for quick in (False, True):
            shapes = grid(max_len, capacity, mixed=20, seed=3, quick=quick, max_num_seqs=seqs)
            assert shapes and len(set(shapes)) == len(shapes)
            for s in shapes:
                assert s.kv_tokens() <= capacity
                assert all(n + k <= max_len for n, k in s.prefills)
                assert all(kv < max_len for kv in s.decode_kv)
                assert len(s.decode_kv) <= max(seqs, 48)  # mixed batches hold up to 48
            assert any(len(s.decode_kv) == seqs for s in shapes if not s.prefills)


def test_the_old_grid_is_kept_where_the_limits_allow():
    """A profile of a short-context model keeps every shape the fixed grid timed."""
    shapes = set(grid(8192, capacity=10**6, mixed=40, seed=0, max_num_seqs=64))
    for n in PREFILL_CHUNKS:
        for k in PREFILL_OFFSETS:
            if n + k <= 8192:
                assert Shape(((n, k),), ()) in shapes
    for b in (1, 4, 16, 64):
        for kv in (128, 1024, 4096):
            assert Shape((), (kv,) * b) in shapes


def test_a_grid_cut_short_still_spans_what_the_engine_runs():
    """The engine's start-up profile runs the grid corners first until its time is up: the
    first few shapes already hold the smallest and the deepest prefill chunk, a lone decode and
    the widest decode batch, and a mixed batch; the order is a permutation of the grid."""
    from medha.perf.grid import corners_first

    shapes = grid(8192, capacity=100_000, mixed=8, seed=0, quick=True, max_num_seqs=128)
    order = corners_first(shapes)
    assert sorted(order, key=repr) == sorted(shapes, key=repr)
    first = order[:6]
    chunks = [p for s in first if not s.decode_kv for p in s.prefills]
    assert (1, 0) in chunks and max(n + k for n, k in chunks) == 8192
    decode_only = [s.decode_kv for s in first if not s.prefills]
    assert min(map(len, decode_only)) == 1
    assert any(s.prefills and s.decode_kv for s in first)
    widest = max(len(s.decode_kv) for s in shapes)
    assert widest in [len(s.decode_kv) for s in order[: len(order) // 2]]
