"""Prefix caching: KV blocks of prompt prefixes reused by later requests, on the device and in
a host-memory tier.

A full block of a prompt is identified by a key that stands for its tokens and every token
before it (a chained hash), so two prompts share their i-th block exactly when they agree on
every token up to its end. With token ids the key is a 128-bit BLAKE2b digest chained over the
tokens (a client cannot craft two prefixes that collide and read another's KV); a trace request
carries no tokens, and its keys come from the trace's prefix hash ids (Mooncake's format: one
id per 512 tokens, itself prefix-chained), so the simulator and the engine decide alike.

Only prompt blocks are cached, the blocks a later prompt can repeat and a trace describes;
blocks of generated tokens stay private (see docs/prefix_cache.md).

`PrefixBlockManager` is the device side: blocks shared by several requests carry a reference
count; a block nobody references keeps its key and stays cached until its memory is needed,
least recently released first (a request's blocks are released tail first, so a chain is
evicted from its end and its shared head lives longest). `HostCacheTier` holds keys of blocks
evicted from the device, in host memory, also least recently used first; the copies it plans
(device -> host on eviction, host -> device on a hit) run before the batch that needs them,
in `Batch.cache_out` and `Batch.cache_in` (see Batch for their order).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable

from medha.core.request import PREFIX_HASH_BLOCK, Request
from medha.scheduler.block_manager import BlockAccountingError, BlockManager, KvpBlockManager

Key = Hashable


def prompt_block_keys(r: Request, block_size: int) -> list[Key]:
    """The keys of the full blocks of `r`'s prompt (empty when it carries neither token ids
    nor prefix hash ids), computed once per request."""
    keys = r.block_keys
    if keys is not None:
        return keys
    n = r.prompt_len // block_size
    if r.prompt_token_ids is not None:
        keys = _token_keys(r.prompt_token_ids, block_size, n)
    elif r.prefix_hash_ids is not None:
        ids = r.prefix_hash_ids
        # a block's key is the id of the trace block holding its last token (which stands for
        # every token before) and where it ends within that block
        keys = [(ids[((j + 1) * block_size - 1) // PREFIX_HASH_BLOCK], j) for j in range(n)]
    else:
        keys = []
    r.block_keys = keys
    return keys


def _token_keys(tokens: list[int], block_size: int, n: int) -> list[bytes]:
    keys, parent = [], b""
    try:
        data = array("q", tokens[: n * block_size]).tobytes()
        step = 8 * block_size
        blocks = (data[j * step : (j + 1) * step] for j in range(n))
    except OverflowError:  # ids beyond int64 (a library caller's): their decimal text
        blocks = (repr(tokens[j * block_size : (j + 1) * block_size]).encode() for j in range(n))
    for b in blocks:
        parent = hashlib.blake2b(parent + b, digest_size=16).digest()
        keys.append(parent)
    return keys


def reusable_prefix_tokens(requests: list[Request], block_size: int) -> dict[str, int]:
    """A direct count over a request list, in arrival order: each request's prompt tokens that
    a prefix cache of `block_size`-token blocks could serve from earlier requests' prompts
    (the longest prefix of its block keys some earlier prompt had, all but a block holding
    its last token): what an unbounded cache hits when every earlier prompt was computed
    before the request starts."""
    seen: set = set()
    out = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        keys = prompt_block_keys(r, block_size)
        limit = min(len(keys), (r.prompt_len - 1) // block_size)
        n = 0
        while n < limit and keys[n] in seen:
            n += 1
        out[r.request_id] = n * block_size
        seen.update(keys)
    return out


class PrefixBlockManager(BlockManager):
    """Device blocks with reference counts and cached prompt blocks (see the module)."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._ref = [0] * num_blocks
        self._key_of: dict[int, Key] = {}  # cached block -> its key
        self._cached: dict[Key, int] = {}  # key -> the block holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # cached, unreferenced; oldest first
        self._registered: dict[str, int] = {}  # leading blocks of a table looked at to cache
        # called with (block, key) when a cached block is evicted, before its memory is reused
        self.on_evict: Callable[[int, Key], None] | None = None

    @classmethod
    def like(cls, blocks: BlockManager) -> PrefixBlockManager:
        """A prefix-caching manager of the same size as an unused plain one."""
        if isinstance(blocks, KvpBlockManager):
            raise ValueError(
                "prefix caching with kvp > 1 is not built yet: use prefix_cache off with KV-cache "
                "parallelism"
            )
        if blocks.num_used:
            raise ValueError("prefix caching needs an unused block manager")
        return blocks if isinstance(blocks, cls) else cls(blocks.num_blocks, blocks.block_size)

    # ---- queries -----------------------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks a request can take: empty ones and cached ones nobody references."""
        return len(self._free) + len(self._lru)

    @property
    def num_used(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        return self._ref[block]

    def match(self, keys: list[Key]) -> list[int]:
        """The cached blocks of the longest prefix of `keys` (nothing is referenced yet)."""
        out = []
        cached = self._cached
        for key in keys:
            b = cached.get(key)
            if b is None:
                break
            out.append(b)
        return out

    def is_cached(self, key: Key) -> bool:
        return key in self._cached

    def shortfall(
        self, request_id: str, num_tokens: int, reserve: int = 0, freeable: tuple[str, ...] = ()
    ) -> int:
        """As BlockManager's; a block of a `freeable` request counts as free only when no other
        request references it."""
        free = self.num_free
        if freeable:
            refs: dict[int, int] = {}
            for v in freeable:
                for b in self._tables.get(v, ()):
                    refs[b] = refs.get(b, 0) + 1
            free += sum(1 for b, n in refs.items() if n == self._ref[b])
        return max(0, self.blocks_needed(request_id, num_tokens) - (free - reserve))

    # ---- changes -----------------------------------------------------------------------------
    def _take(self) -> int:
        """A block for new tokens: an empty one, else the least recently released cached one
        (its key goes: the block is about to be overwritten)."""
        if self._free:
            b = self._free.pop()
        else:
            b, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(b)
            del self._cached[key]
            if self.on_evict is not None:
                self.on_evict(b, key)
        self._ref[b] = 1
        return b

    def grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> int:
        table = self._tables.setdefault(request_id, [])
        want = -(-num_tokens // self.block_size) - len(table)
        for _ in range(max(0, min(want, self.num_free - reserve))):
            table.append(self._take())
        if not table:
            del self._tables[request_id]
        return min(num_tokens, len(table) * self.block_size)

    def acquire(self, request_id: str, blocks: list[int]) -> None:
        """Make cached `blocks` the start of `request_id`'s (empty) table."""
        if self._tables.get(request_id):
            raise ValueError(f"{request_id} already holds blocks")
        if not blocks:
            return
        lru, ref = self._lru, self._ref
        for b in blocks:
            if not ref[b]:
                del lru[b]
            ref[b] += 1
        self._tables[request_id] = list(blocks)
        self._registered[request_id] = len(blocks)

    def append_cached(self, request_id: str, key: Key) -> int:
        """A fresh block at the end of `request_id`'s table, cached under `key` now: the
        caller fills it (a copy from the host tier) before any batch reads it."""
        if key in self._cached:
            raise ValueError("append_cached: the key is cached on the device already")
        b = self._take()
        self._tables.setdefault(request_id, []).append(b)
        self._key_of[b] = key
        self._cached[key] = b
        self._registered[request_id] = len(self._tables[request_id])
        return b

    def register(self, request_id: str, keys: list[Key], num_blocks: int) -> None:
        """Cache the first `num_blocks` blocks of `request_id`'s table under `keys`, once
        computed. A key another block already holds keeps that block (this one stays
        private and is freed with the request)."""
        start = self._registered.get(request_id, 0)
        if num_blocks <= start:
            return
        table = self._tables[request_id]
        cached, key_of = self._cached, self._key_of
        for j in range(start, num_blocks):
            key = keys[j]
            if key not in cached:
                b = table[j]
                cached[key] = b
                key_of[b] = key
        self._registered[request_id] = num_blocks

    def free(self, request_id: str) -> int:
        """Release `request_id`'s blocks: a block nobody else references is free again, and
        stays cached if it holds a key (tail first: the end of a chain is evicted first)."""
        blocks = self._tables.pop(request_id, [])
        self._registered.pop(request_id, None)
        ref, lru, key_of = self._ref, self._lru, self._key_of
        for b in reversed(blocks):
            ref[b] -= 1
            if not ref[b]:
                if b in key_of:
                    lru[b] = None
                else:
                    self._free.append(b)
        return len(blocks)

    def _free_ids(self) -> list[int]:
        return self._free + list(self._lru)

    def check_invariants(self) -> None:
        """Every block is exactly one of: empty and free, cached and unreferenced, or
        referenced by as many tables as hold it; keys and blocks map one to one; no table holds
        a block twice. So no request can be given a block another still reads."""
        counts = [0] * self.num_blocks
        for rid, table in self._tables.items():
            if not table:
                raise BlockAccountingError("an empty block table was left behind")
            if len(set(table)) != len(table):
                raise BlockAccountingError(f"{rid} holds a block twice")
            if self._registered.get(rid, 0) > len(table):
                raise BlockAccountingError(f"{rid} registered blocks it does not hold")
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise BlockAccountingError("a block id is out of range")
                counts[b] += 1
        if counts != self._ref:
            bad = next(b for b in range(self.num_blocks) if counts[b] != self._ref[b])
            raise BlockAccountingError(
                f"block {bad} is referenced by {counts[bad]} tables, counted {self._ref[bad]}"
            )
        free, lru = set(self._free), set(self._lru)
        if len(free) != len(self._free):
            raise BlockAccountingError("a block is on the free list twice")
        if free & lru:
            raise BlockAccountingError("a block is both empty and cached")
        if any(self._ref[b] for b in free | lru):
            raise BlockAccountingError("a referenced block is free")
        if any(b in self._key_of for b in free):
            raise BlockAccountingError("a free block still holds a key")
        if any(b not in self._key_of for b in lru):
            raise BlockAccountingError("an evictable block holds no key")
        if len(free) + len(lru) + sum(1 for n in counts if n) != self.num_blocks:
            raise BlockAccountingError("a block is neither free, cached nor referenced")
        if {b: k for k, b in self._cached.items()} != self._key_of:
            raise BlockAccountingError("cached keys and blocks disagree")


class HostCacheTier:
    """Keys of blocks evicted from the device, in `num_blocks` host blocks, least recently
    used first. The copies it plans are collected until the batch takes them (`drain`)."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a host cache tier needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # blocks never used yet are handed out by counting (a tier may be practically
        # unbounded); emptied ones are not (a key leaves the tier only when evicted)
        self._fresh = 0
        self._free: list[int] = []
        self._cached: OrderedDict[Key, int] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()  # read by a copy of the batch being formed
        self.copies_out: list[tuple[int, int]] = []  # (device block, host block)
        self.copies_in: list[tuple[int, int]] = []  # (host block, device block)

    def __len__(self) -> int:
        return len(self._cached)

    def __contains__(self, key: Key) -> bool:
        return key in self._cached

    def offer(self, device_block: int, key: Key) -> None:
        """A cached device block is being evicted: keep its KV, unless the tier has it already
        or every host block is read by a copy of this batch (then it is only dropped)."""
        cached = self._cached
        if key in cached:
            cached.move_to_end(key)
            return
        if self._fresh < self.num_blocks:
            h = self._fresh
            self._fresh += 1
        elif self._free:
            h = self._free.pop()
        else:
            # the least recently used block that no copy of this batch reads
            victim = next((k for k, h in cached.items() if h not in self._pinned), None)
            if victim is None:
                return
            h = cached.pop(victim)
        cached[key] = h
        self.copies_out.append((device_block, h))

    def pin(self, key: Key) -> None:
        """Keep `key`'s host block until the batch being formed has read it."""
        self._pinned.add(self._cached[key])

    def load(self, key: Key, device_block: int) -> None:
        """Plan the copy of `key`'s host block into `device_block` (a hit)."""
        h = self._cached[key]
        self._cached.move_to_end(key)
        self._pinned.add(h)
        self.copies_in.append((h, device_block))

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies planned since the last drain (out, in), for the batch being formed."""
        out, into = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        self._pinned.clear()
        return out, into

    def check_invariants(self) -> None:
        held = list(self._cached.values())
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise BlockAccountingError("a host cache block holds two keys, or is also free")
        if len(held) + len(self._free) != self._fresh or any(h >= self._fresh for h in held):
            raise BlockAccountingError("a host cache block is lost")
