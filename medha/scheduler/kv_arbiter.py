"""Who holds KV memory: reservations, and who gives way when blocks run short.

The arbiter owns the device blocks (a BlockManager), the swap pool that swapped-out KV waits
in, the prefix cache's host tier and the watermark of blocks new prefills leave to running
decodes. It is an allocator and a victim chooser: a batch being formed asks it for blocks
(`reserve`); when they run short it frees the blocks of requests ranked below the asker (the
policy's `eviction_rank`), by dropping their KV (recompute) or copying it to the swap pool
(swap), and returns what it decided (`Eviction`s, `KVSwap`s, a prefix hit). It reads requests
and never changes one: the scheduler's request table applies each decision to the request and
moves it to the queue of its new state. It never calls back into the scheduler.

    held, evicted = kv.reserve(r, num_tokens, batch, now)
    swaps = kv.swap_in(candidates)       # before anything joins the batch
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from medha.core.batch import Batch, KVSwap
from medha.core.request import Request, RequestState
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.swap_cost import SwapCost
from medha.scheduler.block_manager import BlockAccountingError, BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.policies import Policy
from medha.scheduler.prefix_cache import (
    PrefixBlockManager,
    PrefixHostTier,
    cacheable_pages,
    context_page_keys,
    page_blocks,
    prompt_page_keys,
)
from medha.scheduler.swap_pool import SwapPool


@dataclass
class KVStats:
    preemptions: int = 0  # recomputes + swap-outs
    recomputes: int = 0
    recomputed_tokens: int = 0  # KV dropped by recompute preemption, to be prefilled again
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_time_s: float = 0.0  # predicted time the swaps (and host cache copies) added
    # prefix cache, counted at each (re)start of a prefill: prompt tokens looked up, and those
    # the cache supplied (from the device or, copied back, from the host tier)
    prefix_starts: int = 0
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_host_hit_tokens: int = 0
    host_cache_out_blocks: int = 0  # evicted device blocks copied to the host tier


class Eviction(NamedTuple):
    """A request the arbiter took blocks from: its KV dropped (`swap` None: it recomputes) or
    copied to the swap pool by `swap`."""

    request: Request
    swap: KVSwap | None


NO_EVICTIONS: tuple[Eviction, ...] = ()


class KVArbiter:
    def __init__(
        self,
        config: SchedulerConfig,
        predictor: Predictor,
        blocks: BlockManager,
        policy: Policy,
        prefill_times: PrefillTimeCache,
        live: Mapping[str, Request],
        swapped: Mapping[str, Request],
        stats: KVStats,
    ) -> None:
        """`live` and `swapped` are the request table's maps of live requests and of those
        whose KV waits in the swap pool (read only): victims are chosen among the first,
        swap-ins among the second. `stats` receives the preemption and swap counters. With
        prefix caching the arbiter's blocks are a PrefixBlockManager of the size of `blocks`."""
        self.prefix_caching = config.prefix_cache != "off"
        self.cache_outputs = self.prefix_caching and config.prefix_cache_outputs
        if self.prefix_caching:
            blocks = PrefixBlockManager.like(blocks)
        self.blocks = blocks
        self._policy = policy
        self._prefill_times = prefill_times
        self._live = live
        self._swapped = swapped
        self.stats = stats
        self.watermark_blocks = int(config.watermark * blocks.num_blocks)
        self.swap_cost = SwapCost(predictor, blocks.block_size, config.swap_bandwidth_gbps)
        self.swap_pool = self._swap_pool(config, predictor)
        self.prefix_host_tier: PrefixHostTier | None = None
        if config.prefix_cache == "device+host":
            n = config.host_cache_blocks
            if n is None:
                n = self.swap_cost.blocks_in(config.host_cache_gb * 2**30)
            if n > 0:
                self.prefix_host_tier = PrefixHostTier(n)
                blocks.on_evict = self.prefix_host_tier.offer

    def _swap_pool(self, config: SchedulerConfig, predictor: Predictor) -> SwapPool | None:
        if config.preemption_mode == "recompute":
            return None
        if predictor.parallel.kvp > 1:
            raise ValueError(
                "preemption_mode swap/auto with kvp > 1 is not built yet: use "
                "preemption_mode recompute"
            )
        n = config.host_kv_blocks
        if n is None:
            n = self.swap_cost.blocks_in(config.swap_space_gb * 2**30)
        # an empty pool never has room: every preemption recomputes
        return (
            SwapPool(n, self.blocks.block_size, self.swap_cost, config.preemption_mode)
            if n > 0
            else None
        )

    # ---- queries -----------------------------------------------------------------------------
    def tokens_held(self, r: Request) -> int:
        """Tokens `r`'s device blocks can hold (0 while it holds none)."""
        return self.blocks.tokens_held(r.request_id)

    def may_start(self, r: Request) -> bool:
        """May `r` take blocks for its first chunk? Swapped requests come back before new
        prefills start (else they would starve behind new arrivals), unless the policy lets
        `r` go first."""
        if r.started or not self._swapped:
            return True
        return self._policy.starts_before_swapped(r, self._swapped.values())

    # ---- reservations ------------------------------------------------------------------------
    def reserve(
        self, r: Request, num_tokens: int, batch: Batch, now: float, all_or_nothing: bool = False
    ) -> tuple[int, tuple[Eviction, ...]]:
        """Make `r` hold KV for `num_tokens` tokens, evicting lower-ranked requests if needed:
        (the tokens it can hold now, its `num_scheduled` when it gets nothing; the evictions).

        Decodes may evict anyone ranked below them; a prefill chunk only other prefills, unless
        the policy says otherwise (`Policy.may_evict_decodes`), so that admitting new work never
        throws away a running decode. New prefill chunks leave a watermark of blocks free for
        decodes, unless the batch would otherwise be empty.
        """
        if r.request_id in self._swapped:
            # swapped out while this batch formed, after the packer's queue was drawn up: its
            # KV is on the host, and it gets device blocks only by being swapped back in
            return r.num_scheduled, NO_EVICTIONS
        bm = self.blocks
        decode = r.state is RequestState.DECODING
        reserve = 0 if decode or not (batch.decodes or batch.prefills) else self.watermark_blocks
        # A prefill starts (or restarts after preemption) only when its whole context fits,
        # so that it is not evicted half-way by the decodes it would crowd out.
        starting = not r.started
        if not self.may_start(r):
            return r.num_scheduled, NO_EVICTIONS
        must_fit = r.num_tokens if starting else num_tokens
        evicted = NO_EVICTIONS
        if bm.shortfall(r.request_id, must_fit, reserve):
            evicted = self._evict_below(
                r, must_fit, reserve, batch, now, self._policy.may_evict_decodes(r)
            )
            if (all_or_nothing or starting) and bm.shortfall(r.request_id, must_fit, reserve):
                return r.num_scheduled, evicted
        return bm.grow(r.request_id, num_tokens, reserve), evicted

    def hold(self, r: Request, num_tokens: int) -> bool:
        """Give `r` blocks for `num_tokens` tokens without evicting anyone: KV an executor
        already placed (vLLM's prefix-cache hits, blocks it shares). False when the free
        blocks fell short: then this mirror counts fewer blocks than the executor uses."""
        return self.blocks.grow(r.request_id, num_tokens) >= num_tokens

    def make_room(
        self, r: Request, extra_blocks: int, batch: Batch, now: float
    ) -> tuple[Eviction, ...]:
        """Evict requests ranked below `r`, decodes included, until its whole context fits
        with `extra_blocks` and the watermark left free; nothing is reserved for it yet."""
        reserve = extra_blocks + self.watermark_blocks
        if self.blocks.shortfall(r.request_id, r.num_tokens, reserve):
            return self._evict_below(r, r.num_tokens, reserve, batch, now, evict_decodes=True)
        return NO_EVICTIONS

    def _evict_below(
        self,
        r: Request,
        num_tokens: int,
        reserve: int,
        batch: Batch,
        now: float,
        evict_decodes: bool,
    ) -> tuple[Eviction, ...]:
        """Preempt requests ranked below `r` until it can hold `num_tokens` tokens with
        `reserve` blocks left free."""
        rank = self._policy.eviction_rank(now)
        mine = rank(r)
        # batch members are in flight; swapped requests hold no device blocks; a request
        # swapped in for this batch stays (its copy is already planned)
        back = {s.request.request_id for s in batch.swap_in}
        victims = [
            v
            for v in self._live.values()
            if v is not r
            and v.num_inflight_batches == 0
            and v.started
            and (evict_decodes or v.in_prefill)
            and v.request_id not in self._swapped
            and v.request_id not in back
            and rank(v) > mine
        ]
        # Evict only when that makes enough room: work thrown away for nothing can livelock
        # (a prefill evicted for a request that still does not fit restarts in the room it
        # left, and is evicted again by the next try).
        bm = self.blocks
        if bm.shortfall(r.request_id, num_tokens, reserve, tuple(v.request_id for v in victims)):
            return NO_EVICTIONS
        victims.sort(key=rank, reverse=True)
        evicted = []
        for v in victims:
            if not bm.shortfall(r.request_id, num_tokens, reserve):
                break
            evicted.append(self.preempt(v))
        return tuple(evicted)

    # ---- preemption --------------------------------------------------------------------------
    def preempt(self, r: Request, swap: bool = True) -> Eviction:
        """Free `r`'s device blocks: by swapping its KV to the swap pool (swap or auto mode,
        when the pool has room and, for auto, swapping is predicted cheaper) or by dropping it
        (always with `swap` False: an executor that dropped it already)."""
        stats = self.stats
        stats.preemptions += 1
        pool = self.swap_pool
        if (
            swap
            and pool is not None
            and pool.should_swap(r, self._prefill_times.time(r.num_computed))
        ):
            plan = pool.swap_out(r, self.blocks)  # frees its device blocks
            stats.swap_outs += 1
            stats.swapped_out_blocks += len(plan.host_blocks)
            return Eviction(r, plan)
        stats.recomputes += 1
        stats.recomputed_tokens += r.num_computed
        self.blocks.free(r.request_id)
        return Eviction(r, None)

    def swap_in(self, candidates: Iterable[Request]) -> list[KVSwap]:
        """Bring swapped requests back, in the order of `candidates` (the policy's), while
        device blocks allow, each with room for its next token. New prefills leave the
        watermark to running decodes, and so do these, unless the cache is empty. Order is
        kept: a request that does not fit stops the others behind it."""
        pool, bm = self.swap_pool, self.blocks
        plans = []
        for r in candidates:
            need = pool.swap_in_need(r)
            reserve = self.watermark_blocks if bm.num_used else 0
            if bm.shortfall(r.request_id, need * bm.block_size, reserve):
                break
            plan = pool.swap_in(r, bm)
            bm.grow(r.request_id, need * bm.block_size)
            plans.append(plan)
            self.stats.swap_ins += 1
            self.stats.swapped_in_blocks += len(plan.host_blocks)
        return plans

    def time_swaps(self, batch: Batch) -> None:
        """Set the batch's `swap_time_s`, the predicted time of all its copies, in and out,
        and count it (the scheduler calls it for batches that move KV only)."""
        moved = sum(len(s.host_blocks) for s in (*batch.swap_in, *batch.swap_out))
        moved += len(batch.cache_out) + len(batch.cache_in)
        batch.swap_time_s = self.swap_cost.time(moved)
        self.stats.swap_time_s += batch.swap_time_s

    def free(self, request_id: str) -> None:
        """Release every block a request holds: on the device, or in the swap pool if it is
        swapped out (it finished or was aborted; no running batch writes its KV any more)."""
        if self.swap_pool is not None:
            self.swap_pool.free(request_id)
        self.blocks.free(request_id)

    # ---- prefix cache ------------------------------------------------------------------------
    def peek_cached(self, r: Request) -> int:
        """Prompt tokens the caches hold for `r` now (device, then host tier); nothing is
        taken. What its deadline and predicted work leave out when it is admitted."""
        if not self.prefix_caching:
            return 0
        bs = self.blocks.block_size
        keys, per, limit = cacheable_pages(r, bs)
        n = len(self.blocks.match(keys, limit))
        tier = self.prefix_host_tier
        if tier is not None:
            while n < limit and keys[n] in tier:
                n += 1
        return n * per * bs

    def attach_cached(self, r: Request) -> tuple[int, int] | None:
        """At the (re)start of `r`'s prefill, before its first chunk is planned: take the
        longest cached prefix of its prompt. Device pages are shared; pages found only in the
        host tier are copied back into fresh device blocks when that is predicted cheaper than
        recomputing them and they fit above the watermark. Returns (tokens `r` now holds from
        the cache, of them copied back from the host tier now), or None when its prompt has no
        page a hit could cover."""
        bm, tier, rid = self.blocks, self.prefix_host_tier, r.request_id
        bs = bm.block_size
        keys, per, limit = cacheable_pages(r, bs)
        if not limit:
            return None
        dev = bm.match(keys, limit)
        bm.acquire(rid, dev, per)  # (first: the free blocks left count without them)
        load: list = []
        if tier is not None and len(dev) < limit:
            room = (bm.num_free - self.watermark_blocks) // per
            for key in keys[len(dev) : limit]:
                # (a key also on the device, after a gap in its chain, ends the run)
                if len(load) >= room or key not in tier or bm.is_cached(key):
                    break
                load.append(key)
            if load:
                start = len(dev) * per * bs
                recompute_s = self._prefill_times.remaining(start + len(load) * per * bs, start)
                if self.swap_cost.time(len(load) * per) >= recompute_s:
                    load = []
        if not dev and not load:
            return 0, 0
        for key in load:  # pinned first: a device eviction below must not push them out
            tier.pin(key)
        for key in load:
            tier.load(key, bm.append_cached(rid, key, per))
        return bm.tokens_held(rid), len(load) * per * bs

    def count_start(self, r: Request) -> None:
        """Count the prefix lookup of a prefill whose first chunk was just scheduled."""
        st = self.stats
        st.prefix_starts += 1
        st.prefix_query_tokens += r.prompt_len
        st.prefix_hit_tokens += r.num_cached_tokens
        st.prefix_host_hit_tokens += r.num_host_cached_tokens

    def cache_computed(self, r: Request) -> None:
        """Cache the full prompt pages `r` has computed (after a batch that ran its chunk)."""
        bs = self.blocks.block_size
        keys, per = prompt_page_keys(r, bs), page_blocks(r, bs)
        n = min(r.num_computed // (per * bs), len(keys))
        if n:
            self.blocks.register(r.request_id, keys, n, per)

    def cache_finished(self, r: Request) -> None:
        """Cache the full blocks of a finished request's context whose KV was computed: its
        prompt's, and those of its answer, so that a next turn repeating the answer finds them
        (before its blocks are released). Only the engine's requests, which carry their tokens,
        and only blocks no batch still writes: the last sampled token was never fed, its KV does
        not exist, so `num_computed` (not the context's length) bounds the blocks."""
        if (
            not self.cache_outputs
            or r.prompt_token_ids is None
            or len(r.output_token_ids) != r.num_output_tokens
            or r.num_inflight_batches
        ):
            return
        bs = self.blocks.block_size
        n = r.num_computed // bs
        if n > len(prompt_page_keys(r, bs)):
            self.blocks.register(r.request_id, context_page_keys(r, bs, n), n, 1)

    def take_cache_copies(self, batch: Batch) -> None:
        """Put the host tier's copies planned while `batch` formed on it."""
        tier = self.prefix_host_tier
        if tier is not None and (tier.copies_out or tier.copies_in):
            batch.cache_out, batch.cache_in = tier.drain()
            self.stats.host_cache_out_blocks += len(batch.cache_out)

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self, aborted_inflight: Mapping[str, Request]) -> None:
        """Block accounting is exact, and every live request holds KV for what it scheduled:
        on the device, or (swapped out, with nothing in flight) in the swap pool, never both.
        Blocks belong only to live requests and to aborted ones that a running batch still
        writes."""
        bm = self.blocks
        bm.check_invariants()
        for rid, r in self._live.items():
            if (r.state is RequestState.SWAPPED) != (rid in self._swapped):
                raise BlockAccountingError(f"{r}: its state and the swapped queue disagree")
            if rid in self._swapped:
                if r.num_inflight_batches or r.num_scheduled != r.num_computed:
                    raise BlockAccountingError(f"{r} was swapped out with work in flight")
                if bm.tokens_held(rid):
                    raise BlockAccountingError(
                        f"{r} is swapped out, yet holds {bm.tokens_held(rid)} tokens of device "
                        "blocks"
                    )
            elif bm.tokens_held(rid) < r.num_scheduled:
                raise BlockAccountingError(f"{r} scheduled tokens it holds no KV for")
        for rid in bm.owners():
            if rid not in self._live and rid not in aborted_inflight:
                raise BlockAccountingError(f"blocks of {rid} outlived the request")
        if self.prefix_host_tier is not None:
            self.prefix_host_tier.check_invariants()
        if self.swap_pool is not None:
            self.swap_pool.check_invariants(self._swapped, bm)
        elif self._swapped:
            raise BlockAccountingError("requests are swapped out without a swap pool")
