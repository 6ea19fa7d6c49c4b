"""The batch shapes `medha profile` times on medha's engine (torch-free, so that the core tests
check what it covers).

A fitted predictor extrapolates past its grid with the shape of its fits, which is how a quick
profile whose KV offsets stopped at 6,144 tokens predicted a 120,000-token prompt's chunks at
1/3.6 of their time on an H200 (issue 48). So the grid reaches what the engine will run: KV
offsets doubling up to the model's context (the deepest chunk ends at max_model_len), whole
prompts up to it at offset 0 (what `--chunking none` runs), decode batches doubling up to
max_num_seqs, and a few decodes over KV up to the context; each batch within the KV cache.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

PREFILL_CHUNKS = (1, 8, 32, 128, 512, 1024, 2048)
PREFILL_OFFSETS = (0, 1024, 3072, 6144)  # then doubling, up to the context
DECODE_BATCHES = (1, 4, 16, 64)  # then doubling, up to max_num_seqs
DECODE_KV = (128, 1024, 4096)  # then doubling, for batches of 1 and 4
DEEP_DECODE_BATCHES = (1, 4)


@dataclass(frozen=True)
class Shape:
    prefills: tuple[tuple[int, int], ...]  # (chunk, kv offset)
    decode_kv: tuple[int, ...]

    def kv_tokens(self) -> int:
        """KV tokens the batch's requests hold, rounded up to 16-token blocks."""
        return sum(-(-(n + k) // 16) * 16 for n, k in self.prefills) + sum(
            -(-(kv + 1) // 16) * 16 for kv in self.decode_kv
        )


def doubling(base: tuple[int, ...], limit: int) -> list[int]:
    """`base` up to `limit`, then doubling from its last value while under `limit`."""
    out = [v for v in base if v <= limit]
    v = base[-1] * 2
    while v <= limit:
        out.append(v)
        v *= 2
    return out


def offsets(chunk: int, max_len: int, quick: bool) -> list[int]:
    """KV offsets for a chunk of `chunk` tokens: the fixed ones, the doubling ones (not in a
    quick grid), and the deepest one, whose chunk ends at the context."""
    top = max_len - chunk
    if top < 0:
        return []
    out = [k for k in PREFILL_OFFSETS if k <= top] if quick else doubling(PREFILL_OFFSETS, top)
    return sorted({*out, top})


def grid(
    max_len: int,
    capacity: int,
    mixed: int,
    seed: int,
    quick: bool = False,
    max_num_seqs: int = 64,
) -> list[Shape]:
    """Shapes to time: every one within `capacity` (KV tokens the cache holds), the limits of
    `max_len` (the model's context) and `max_num_seqs` reached (module docstring). `quick`:
    every other chunk size, no doubling offsets and no whole prompts past 2,048 tokens."""
    chunks = PREFILL_CHUNKS[::2] if quick else PREFILL_CHUNKS
    shapes = [Shape(((n, k),), ()) for n in chunks for k in offsets(n, max_len, quick)]
    if not quick:  # whole prompts, up to the context
        longer = doubling(PREFILL_CHUNKS, max_len)[len(PREFILL_CHUNKS) :]
        shapes += [Shape(((n, 0),), ()) for n in longer]
    batches = doubling(DECODE_BATCHES, max(1, max_num_seqs))
    if max_num_seqs not in batches:
        batches.append(max_num_seqs)
    shapes += [Shape((), (kv,) * b) for b in batches for kv in DECODE_KV if kv < max_len]
    deep = doubling(DECODE_KV, max_len - 1)[len(DECODE_KV) :]
    if max_len - 1 > DECODE_KV[-1]:
        deep = sorted({*deep, max_len - 1})
    shapes += [Shape((), (kv,) * b) for b in DEEP_DECODE_BATCHES for kv in deep]
    shapes += random_mixed(mixed, max_len, capacity, seed)
    seen: set[Shape] = set()
    out = []
    for s in shapes:
        if s.kv_tokens() <= capacity and s not in seen:
            seen.add(s)
            out.append(s)
    return out


def random_mixed(count: int, max_len: int, capacity: int, seed: int) -> list[Shape]:
    """Batches like a busy server runs: a few prefill chunks beside many decodes."""
    rng = random.Random(seed)
    out: list[Shape] = []
    while len(out) < count:
        prefills = []
        for _ in range(rng.choice((0, 1, 1, 2))):
            n = rng.choice((16, 64, 128, 256, 512, 1024))
            prefills.append((n, rng.randrange(0, max(1, min(max_len - n - 1, 6000)))))
        decodes = tuple(
            rng.randrange(16, min(max_len - 1, 4096))
            for _ in range(rng.choice((0, 1, 4, 8, 16, 32, 48)))
        )
        if not prefills and not decodes:
            decodes = (256,)
        shape = Shape(tuple(prefills), decodes)
        if shape.kv_tokens() <= capacity:
            out.append(shape)
    return out


def corners_first(shapes: list[Shape]) -> list[Shape]:
    """`shapes` reordered so that a grid cut short still spans what the engine runs: one
    prefill chunk alone, decode batches of one KV length, and the rest (mixed batches) in turn,
    each kind by size in bisection order: its smallest and largest shape, then the middle, then
    the quarters, ... (the smallest chunk at offset 0 and the largest at the deepest offset; a
    lone short decode and the widest batch over the longest KV). The engine's start-up profile
    runs the grid in this order until its time is up."""
    alone = sorted((s for s in shapes if len(s.prefills) == 1 and not s.decode_kv), key=_size)
    decodes = sorted(
        (s for s in shapes if not s.prefills and len(set(s.decode_kv)) == 1), key=_size
    )
    chosen = set(alone) | set(decodes)
    mixed = [s for s in shapes if s not in chosen]
    spread = [_bisection(k) for k in (alone, decodes, mixed)]
    out = []
    for i in range(max(map(len, spread), default=0)):
        out += [k[i] for k in spread if i < len(k)]
    return out


def _size(s: Shape) -> tuple:
    return (s.prefills[0] if s.prefills else (), len(s.decode_kv), s.decode_kv[:1])


def _bisection(items: list) -> list:
    if len(items) <= 2:
        return list(items)
    order, seen = [0, len(items) - 1], {0, len(items) - 1}
    spans = [(0, len(items) - 1)]
    while spans:
        nxt = []
        for lo, hi in spans:
            if hi - lo < 2:
                continue
            mid = (lo + hi) // 2
            if mid not in seen:
                seen.add(mid)
                order.append(mid)
            nxt += [(lo, mid), (mid, hi)]
        spans = nxt
    return [items[i] for i in order]
