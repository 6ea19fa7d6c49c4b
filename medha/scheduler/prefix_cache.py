"""Prefix caching: KV of prompt prefixes reused by later requests, on the device and in a
host-memory tier.

The cache's unit is a page: the full blocks of a prompt that one key stands for. A key stands
for the page's tokens and every token before them (a chained hash), so two prompts share their
i-th page exactly when they agree on every token up to its end. With token ids a page is one
KV block and its key a 128-bit BLAKE2b digest chained over the tokens (a client cannot craft
two prefixes that collide and read another's KV). A trace's request carries no tokens: its
keys are the trace's prefix hash ids (Mooncake's format: one id per 512 tokens, itself
prefix-chained), and its pages are 512 tokens, all that such a trace can say is shared. The
simulator and the engine, given the same requests, make the same decisions.

Prompt pages are cached as they are computed. When a request with token ids finishes, the full
blocks of its answer whose KV was computed join them (`context_page_keys`: the prompt's chain
continued over the generated tokens), so that the next turn of a chat, which repeats the answer,
finds it too. A trace's request has no generated tokens to key: in the simulator only prompt
pages are cached (docs/prefix_cache.md says where its hits differ from the engine's).

`PrefixBlockManager` is the device side: pages shared by several requests carry a reference
count; a page nobody references keeps its key and stays cached until its memory is needed,
least recently released first (a request's pages are released tail first, so a chain is
evicted from its end and its shared head lives longest). `PrefixHostTier` holds pages evicted
from the device, in host memory, also least recently used first; the copies it plans (device
-> host on eviction, host -> device on a hit) run before the batch that needs them, in
`Batch.cache_out` and `Batch.cache_in` (see Batch for their order).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Callable, Hashable

from medha.core.request import PREFIX_HASH_BLOCK, Request
from medha.scheduler.block_manager import BlockAccountingError, BlockManager, KvpBlockManager

Key = Hashable


def page_blocks(r: Request, block_size: int) -> int:
    """KV blocks in one of `r`'s cache pages: 1 with token ids, 512 tokens' worth with a
    trace's hash ids."""
    if r.prompt_token_ids is not None or r.prefix_hash_ids is None:
        return 1
    if PREFIX_HASH_BLOCK % block_size:
        raise ValueError(
            f"a KV block of {block_size} tokens does not divide the trace's "
            f"{PREFIX_HASH_BLOCK}-token hash blocks"
        )
    return PREFIX_HASH_BLOCK // block_size


def prompt_page_keys(r: Request, block_size: int) -> list[Key]:
    """The keys of the full pages of `r`'s prompt (empty when it carries neither token ids
    nor prefix hash ids), computed once per request."""
    keys = r.page_keys
    if keys is not None:
        return keys
    if r.prompt_token_ids is not None:
        keys = _token_keys(r.prompt_token_ids, block_size, r.prompt_len // block_size)
    elif r.prefix_hash_ids is not None:
        keys = r.prefix_hash_ids[: r.prompt_len // PREFIX_HASH_BLOCK]
    else:
        keys = []
    r.page_keys = keys
    return keys


def context_page_keys(r: Request, block_size: int, n: int) -> list[Key]:
    """The keys of the first `n` full blocks of `r`'s context, prompt then generated tokens:
    its prompt's keys, the chain continued over the blocks after them (what a later prompt
    repeating those tokens computes). `r` carries token ids, prompt and output."""
    keys = prompt_page_keys(r, block_size)
    if n <= len(keys):
        return keys[:n]
    start = len(keys) * block_size
    tokens = r.context_token_ids(start, n * block_size)
    return keys + _token_keys(tokens, block_size, n - len(keys), keys[-1] if keys else b"")


def _token_keys(tokens: list[int], block_size: int, n: int, parent: bytes = b"") -> list[bytes]:
    """Chained keys of the first `n` full blocks of `tokens`, continuing from `parent`, the
    key of the block before them (b"": none)."""
    keys = []
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


def cacheable_pages(r: Request, block_size: int) -> tuple[list[Key], int, int]:
    """(page keys, blocks per page, pages a hit may cover): every full page but one holding
    the last prompt token, which is always computed (its logits sample the first token)."""
    keys, per = prompt_page_keys(r, block_size), page_blocks(r, block_size)
    return keys, per, min(len(keys), (r.prompt_len - 1) // (per * block_size))


def reusable_prefix_tokens(requests: list[Request], block_size: int) -> dict[str, int]:
    """A direct count over a request list, in arrival order: each request's prompt tokens that
    a prefix cache of `block_size`-token blocks could serve from earlier requests' prompts
    (the longest prefix of its page keys some earlier prompt had, all but a page holding its
    last token): what an unbounded cache hits when every earlier prompt was computed before
    the request starts."""
    seen: set = set()
    out = {}
    for r in sorted(requests, key=lambda r: r.arrival_s):
        keys, per, limit = cacheable_pages(r, block_size)
        n = 0
        while n < limit and keys[n] in seen:
            n += 1
        out[r.request_id] = n * per * block_size
        seen.update(keys)
    return out


class PrefixBlockManager(BlockManager):
    """Device blocks, with cached pages of prompts shared and reference-counted (see the
    module).

    A block is private (in one table, no key), in a cached page (the page holds a key and is
    referenced by `_ref[head]` tables, none while it waits in the LRU), or empty and free. A
    page is named by its first block (its head). Only cached pages carry a count: a private
    block has one owner by construction, which keeps the common path (a request's own blocks,
    taken and freed in bulk) as cheap as a plain manager's."""

    def __init__(self, num_blocks: int, block_size: int = 16) -> None:
        super().__init__(num_blocks, block_size)
        self._ref = [0] * num_blocks  # tables referencing each cached page, by its head
        self._page: dict[int, list[int]] = {}  # cached page's head -> its blocks
        self._key_of: dict[int, Key] = {}  # cached page's head -> its key
        self._cached: dict[Key, int] = {}  # key -> the head of the page holding it
        self._lru: OrderedDict[int, None] = OrderedDict()  # unreferenced pages, oldest first
        self._lru_blocks = 0
        # per table: (its leading pages taken from the cache or looked at to cache, blocks
        # per page); the blocks after those pages are private
        self._registered: dict[str, tuple[int, int]] = {}
        # called with (page blocks, key) when a cached page is evicted, before its memory is
        # reused
        self.on_evict: Callable[[list[int], Key], None] | None = None

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
        """Blocks a request can take: empty ones and those of pages nobody references."""
        return len(self._free) + self._lru_blocks

    @property
    def num_used(self) -> int:
        """Blocks some request references."""
        return self.num_blocks - self.num_free

    @property
    def num_cached(self) -> int:
        """Cached pages."""
        return len(self._cached)

    def ref_count(self, block: int) -> int:
        """Tables holding `block`."""
        return sum(block in t for t in self._tables.values())

    def match(self, keys: list[Key], limit: int | None = None) -> list[int]:
        """Heads of the cached pages of the longest prefix of `keys[:limit]` (none taken)."""
        out = []
        get = self._cached.get
        for j in range(len(keys) if limit is None else min(limit, len(keys))):
            head = get(keys[j])
            if head is None:
                break
            out.append(head)
        return out

    def is_cached(self, key: Key) -> bool:
        return key in self._cached

    def shortfall(
        self, request_id: str, num_tokens: int, reserve: int = 0, freeable: tuple[str, ...] = ()
    ) -> int:
        """As BlockManager's; a cached page of a `freeable` request counts as free only when no
        other request references it."""
        free = self.num_free
        if freeable:
            refs: dict[int, int] = {}
            for v in freeable:
                table = self._tables.get(v, ())
                n, per = self._registered.get(v, (0, 1))
                free += len(table) - n * per
                for p in range(n):
                    head = table[p * per]
                    if head in self._key_of:
                        refs[head] = refs.get(head, 0) + 1
                    else:
                        free += per  # a private page
            free += sum(len(self._page[h]) for h, n in refs.items() if n == self._ref[h])
        return max(0, self.blocks_needed(request_id, num_tokens) - (free - reserve))

    # ---- changes -----------------------------------------------------------------------------
    def _take(self, n: int) -> list[int]:
        """`n` blocks (the caller checked there are): empty ones first, in the order a plain
        manager hands them out, then those of the least recently released pages (their keys
        go: they are about to be overwritten; what one page has beyond `n` is empty now)."""
        free = self._free
        while len(free) < n:
            head, _ = self._lru.popitem(last=False)
            key = self._key_of.pop(head)
            del self._cached[key]
            page = self._page.pop(head)
            self._lru_blocks -= len(page)
            if self.on_evict is not None:
                self.on_evict(page, key)
            free[:0] = page[::-1]  # below the empty ones: taken right now, in page order
        out = free[: -n - 1 : -1] if n else []  # what n pops would return
        del free[len(free) - n :]
        return out

    def grow(self, request_id: str, num_tokens: int, reserve: int = 0) -> int:
        table = self._tables.setdefault(request_id, [])
        want = -(-num_tokens // self.block_size) - len(table)
        take = max(0, min(want, self.num_free - reserve))
        if take:
            table.extend(self._take(take))
        if not table:
            del self._tables[request_id]
        return min(num_tokens, len(table) * self.block_size)

    def acquire(self, request_id: str, heads: list[int], per: int) -> None:
        """Make the cached pages of `heads` (of `per` blocks each) the start of
        `request_id`'s empty table."""
        if self._tables.get(request_id):
            raise ValueError(f"{request_id} already holds blocks")
        if not heads:
            return
        lru, ref, pages = self._lru, self._ref, self._page
        table = []
        for h in heads:
            if not ref[h]:
                del lru[h]
                self._lru_blocks -= per
            ref[h] += 1
            table += pages[h]
        self._tables[request_id] = table
        self._registered[request_id] = (len(heads), per)

    def append_cached(self, request_id: str, key: Key, per: int) -> list[int]:
        """A fresh page of `per` blocks at the end of `request_id`'s table, cached under `key`
        now: the caller fills it (a copy from the host tier) before any batch reads it."""
        if key in self._cached:
            raise ValueError("append_cached: the key is cached on the device already")
        table = self._tables.get(request_id, [])
        n, _ = self._registered.get(request_id, (0, per))
        if n * per != len(table):
            raise ValueError(f"{request_id} holds private blocks: a cached page cannot follow")
        page = self._take(per)
        head = page[0]
        table += page
        self._tables[request_id] = table
        self._page[head], self._key_of[head], self._cached[key] = page, key, head
        self._ref[head] = 1
        self._registered[request_id] = (n + 1, per)
        return page

    def register(self, request_id: str, keys: list[Key], num_pages: int, per: int) -> None:
        """Cache the first `num_pages` pages (of `per` blocks) of `request_id`'s table under
        `keys`, once computed. A key another page already holds keeps that page (this one
        stays private and is freed with the request)."""
        start, _ = self._registered.get(request_id, (0, per))
        if num_pages <= start:
            return
        table = self._tables[request_id]
        cached, key_of, ref, pages = self._cached, self._key_of, self._ref, self._page
        for p in range(start, num_pages):
            key = keys[p]
            if key not in cached:
                page = table[p * per : (p + 1) * per]
                head = page[0]
                cached[key], key_of[head], pages[head] = head, key, page
                ref[head] = 1
        self._registered[request_id] = (num_pages, per)

    def free(self, request_id: str) -> int:
        """Release `request_id`'s blocks: private ones are empty again; a cached page nobody
        else references stays cached, evictable (tail first: a chain's end goes first)."""
        blocks = self._tables.pop(request_id, [])
        n, per = self._registered.pop(request_id, (0, 1))
        free = self._free
        free.extend(reversed(blocks[n * per :]))
        ref, lru, key_of = self._ref, self._lru, self._key_of
        for p in range(n - 1, -1, -1):
            head = blocks[p * per]
            if head not in key_of:
                free.extend(reversed(blocks[p * per : (p + 1) * per]))
            else:
                ref[head] -= 1
                if not ref[head]:
                    lru[head] = None
                    self._lru_blocks += per
        return len(blocks)

    def _free_ids(self) -> list[int]:
        return self._free + [b for h in self._lru for b in self._page[h]]

    def check_invariants(self) -> None:
        """Every block is exactly one of: empty and free; in an unreferenced cached page (in
        the LRU); in a cached page referenced by as many tables as its count says; private to
        one table. Keys and pages map one to one; no table holds a block twice. So no request
        can be given a block another still reads."""
        counts = [0] * self.num_blocks
        key_of, pages = self._key_of, self._page
        in_page = {b: h for h, page in pages.items() for b in page}
        if len(in_page) != sum(map(len, pages.values())):
            raise BlockAccountingError("a block is in two cached pages")
        for rid, table in self._tables.items():
            if not table:
                raise BlockAccountingError("an empty block table was left behind")
            if len(set(table)) != len(table):
                raise BlockAccountingError(f"{rid} holds a block twice")
            n, per = self._registered.get(rid, (0, 1))
            if n * per > len(table):
                raise BlockAccountingError(f"{rid} registered pages it does not hold")
            if any(b in in_page for b in table[n * per :]):
                raise BlockAccountingError(f"{rid} holds a cached page past its registered ones")
            for p in range(n):
                page = table[p * per : (p + 1) * per]
                if page[0] in key_of and pages[page[0]] != page:
                    raise BlockAccountingError(f"{rid} holds part of a cached page")
            for b in table:
                if not 0 <= b < self.num_blocks:
                    raise BlockAccountingError("a block id is out of range")
                counts[b] += 1
        for b in range(self.num_blocks):
            head = in_page.get(b)
            want = self._ref[head] if head is not None else min(counts[b], 1)
            if counts[b] != want or (b not in key_of and self._ref[b]):
                raise BlockAccountingError(
                    f"block {b} is referenced by {counts[b]} tables, counted {want}"
                )
        free = set(self._free)
        lru = {b for h in self._lru for b in pages[h]}
        if len(free) != len(self._free):
            raise BlockAccountingError("a block is on the free list twice")
        if free & set(in_page):
            raise BlockAccountingError("a block is both empty and cached")
        if any(counts[b] for b in free | lru):
            raise BlockAccountingError("a referenced block is free")
        if any(h not in key_of or self._ref[h] for h in self._lru):
            raise BlockAccountingError("an evictable page holds no key, or is referenced")
        if len(lru) != self._lru_blocks:
            raise BlockAccountingError("the evictable blocks are miscounted")
        if len(free) + len(lru) + sum(1 for n in counts if n) != self.num_blocks:
            raise BlockAccountingError("a block is neither free, cached nor referenced")
        if {h: k for k, h in self._cached.items()} != key_of or set(key_of) != set(pages):
            raise BlockAccountingError("cached keys and pages disagree")


class PrefixHostTier:
    """Pages evicted from the device, in `num_blocks` host blocks, least recently used first.
    The copies it plans are collected until the batch takes them (`drain`)."""

    def __init__(self, num_blocks: int) -> None:
        if not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"a host cache tier needs at least one block, got {num_blocks!r}")
        self.num_blocks = num_blocks
        # blocks never used yet are handed out by counting (a tier may be practically
        # unbounded); emptied ones go to the free list
        self._fresh = 0
        self._free: list[int] = []
        self._cached: OrderedDict[Key, list[int]] = OrderedDict()  # least recently used first
        self._pinned: set[int] = set()  # read by a copy of the batch being formed
        self.copies_out: list[tuple[int, int]] = []  # (device block, host block)
        self.copies_in: list[tuple[int, int]] = []  # (host block, device block)

    def __contains__(self, key: Key) -> bool:
        return key in self._cached

    def offer(self, page: list[int], key: Key) -> None:
        """A cached device page is being evicted: keep its KV, unless the tier has it already
        or cannot make room without dropping a page a copy of this batch reads (then it is
        only dropped)."""
        cached = self._cached
        if key in cached:
            cached.move_to_end(key)
            return
        need = len(page)
        while self.num_blocks - self._fresh + len(self._free) < need:
            # the least recently used page that no copy of this batch reads
            victim = next((k for k, hs in cached.items() if self._pinned.isdisjoint(hs)), None)
            if victim is None:
                return
            self._free += cached.pop(victim)
        fresh = min(need, self.num_blocks - self._fresh)
        host = list(range(self._fresh, self._fresh + fresh))
        self._fresh += fresh
        if fresh < need:
            host += self._free[fresh - need :]
            del self._free[fresh - need :]
        cached[key] = host
        self.copies_out += zip(page, host)

    def pin(self, key: Key) -> None:
        """Keep `key`'s host page until the batch being formed has read it."""
        self._pinned.update(self._cached[key])

    def load(self, key: Key, device_page: list[int]) -> None:
        """Plan the copy of `key`'s host page into `device_page` (a hit)."""
        host = self._cached[key]
        self._cached.move_to_end(key)
        self._pinned.update(host)
        self.copies_in += zip(host, device_page)

    def drain(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies planned since the last drain (out, in), for the batch being formed
        (pins are only ever taken with a copy in: none without)."""
        out, into = self.copies_out, self.copies_in
        self.copies_out, self.copies_in = [], []
        self._pinned.clear()
        return out, into

    def check_invariants(self) -> None:
        held = [h for hs in self._cached.values() for h in hs]
        if len(set(held)) != len(held) or set(held) & set(self._free):
            raise BlockAccountingError("a host cache block holds two pages, or is also free")
        if len(held) + len(self._free) != self._fresh or any(h >= self._fresh for h in held):
            raise BlockAccountingError("a host cache block is lost")
