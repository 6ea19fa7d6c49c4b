"""Who holds KV memory: reservations, and who gives way when blocks run short.

The arbiter owns the device blocks (a BlockManager), the host pool swapped-out KV waits in,
and the watermark of blocks new prefills leave to running decodes. A batch being formed asks
it for blocks (`reserve`); when they run short it frees blocks of requests ranked below the
asker (the policy's `eviction_rank`), by dropping their KV (recompute) or copying it to the
host pool (swap). It never calls back into the scheduler: what it grants is its return value,
and every request it preempted or swapped is recorded in the batch (`preempted`, `swap_out`,
`swap_in`). The request's state says where its KV is, so the arbiter that moves the KV sets
it; the scheduler moves the request between its queues afterwards (`ReplicaScheduler._settle`).

    kv.swap_in(batch, urgent)            # before anything joins the batch
    kv.reserve(r, num_tokens, batch, now) -> tokens r can hold now
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from medha.core.batch import Batch
from medha.core.config import SchedulerConfig
from medha.core.request import Request, RequestState
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.swap_cost import SwapCost
from medha.scheduler.block_manager import BlockAccountingError, BlockManager
from medha.scheduler.host_kv_pool import HostKVPool
from medha.scheduler.policies import Policy
from medha.scheduler.prefix_cache import (
    HostCacheTier,
    PrefixBlockManager,
    cacheable_pages,
    page_blocks,
    prompt_page_keys,
)


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


class KVArbiter:
    def __init__(
        self,
        config: SchedulerConfig,
        predictor: Predictor,
        blocks: BlockManager,
        policy: Policy,
        prefill_times: PrefillTimeCache,
        live: Mapping[str, Request],
        stats: KVStats,
    ) -> None:
        """`live` is the scheduler's map of live requests (read only): the victims are chosen
        among them. `stats` receives the preemption and swap counters. With prefix caching
        the arbiter's blocks are a PrefixBlockManager of the size of `blocks`."""
        self.prefix_caching = config.prefix_cache != "off"
        if self.prefix_caching:
            blocks = PrefixBlockManager.like(blocks)
        self.blocks = blocks
        self._policy = policy
        self._prefill_times = prefill_times
        self._live = live
        self.stats = stats
        self.watermark_blocks = int(config.watermark * blocks.num_blocks)
        self.swap_cost = SwapCost(predictor, blocks.block_size, config.swap_bandwidth_gbps)
        self.host_pool = self._host_pool(config, predictor)
        self.host_cache: HostCacheTier | None = None
        if config.prefix_cache == "device+host":
            n = config.host_cache_blocks
            if n is None:
                n = self.swap_cost.blocks_in(config.host_cache_gb * 2**30)
            if n > 0:
                self.host_cache = HostCacheTier(n)
                blocks.on_evict = self.host_cache.offer
        self._swapped: dict[str, Request] = {}  # KV in the host pool, in swap-out order
        self._resume: dict[str, RequestState] = {}  # the phase each swapped request left

    def _host_pool(self, config: SchedulerConfig, predictor: Predictor) -> HostKVPool | None:
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
            HostKVPool(n, self.blocks.block_size, self.swap_cost, config.preemption_mode)
            if n > 0
            else None
        )

    # ---- queries -----------------------------------------------------------------------------
    @property
    def swapped(self) -> Mapping[str, Request]:
        """Requests whose KV waits in the host pool, in swap-out order (a read-only view)."""
        return self._swapped

    def may_start(self, r: Request) -> bool:
        """May `r` take blocks for its first chunk? Swapped requests come back before new
        prefills start, unless `r` is of a more urgent class than every one of them (under a
        class policy; else they would starve behind new arrivals)."""
        if r.started or not self._swapped:
            return True
        return self._policy.uses_classes and r.priority_rank < min(
            s.priority_rank for s in self._swapped.values()
        )

    # ---- reservations ------------------------------------------------------------------------
    def reserve(
        self, r: Request, num_tokens: int, batch: Batch, now: float, all_or_nothing: bool = False
    ) -> int:
        """Make `r` hold KV for `num_tokens` tokens, evicting lower-ranked requests if needed;
        returns the tokens it can hold now (its `num_scheduled` when it gets nothing).

        Decodes may evict anyone ranked below them; prefill chunks only evict other prefills,
        so that admitting new work never throws away a running decode. New prefill chunks leave
        a watermark of blocks free for decodes, unless the batch would otherwise be empty.
        """
        if r.request_id in self._swapped:
            # swapped out while this batch formed, after the packer's queue was drawn up: its
            # KV is on the host, and it gets device blocks only by being swapped back in
            return r.num_scheduled
        bm = self.blocks
        decode = r.state is RequestState.DECODING
        reserve = 0 if decode or not (batch.decodes or batch.prefills) else self.watermark_blocks
        # A prefill starts (or restarts after preemption) only when its whole context fits,
        # so that it is not evicted half-way by the decodes it would crowd out.
        starting = not r.started
        if not self.may_start(r):
            return r.num_scheduled
        must_fit = r.num_tokens if starting else num_tokens
        if bm.shortfall(r.request_id, must_fit, reserve):
            # under a class policy the ranks alone keep a prefill off its own class's decodes
            self._evict_below(
                r, must_fit, reserve, batch, now, evict_decodes=decode or self._policy.uses_classes
            )
            if (all_or_nothing or starting) and bm.shortfall(r.request_id, must_fit, reserve):
                return r.num_scheduled
        held = bm.grow(r.request_id, num_tokens, reserve)
        r.kv_capacity = bm.tokens_held(r.request_id)
        return held

    def hold(self, r: Request, num_tokens: int) -> bool:
        """Give `r` blocks for `num_tokens` tokens without evicting anyone: KV an executor
        already placed (vLLM's prefix-cache hits, blocks it shares). False when the free
        blocks fell short: then this mirror counts fewer blocks than the executor uses."""
        held = self.blocks.grow(r.request_id, num_tokens)
        r.kv_capacity = self.blocks.tokens_held(r.request_id)
        return held >= num_tokens

    def make_room(self, r: Request, extra_blocks: int, batch: Batch, now: float) -> None:
        """Evict requests ranked below `r`, decodes included, until its whole context fits
        with `extra_blocks` and the watermark left free; nothing is reserved for it yet."""
        reserve = extra_blocks + self.watermark_blocks
        if self.blocks.shortfall(r.request_id, r.num_tokens, reserve):
            self._evict_below(r, r.num_tokens, reserve, batch, now, evict_decodes=True)

    def _evict_below(
        self,
        r: Request,
        num_tokens: int,
        reserve: int,
        batch: Batch,
        now: float,
        evict_decodes: bool,
    ) -> None:
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
            return
        victims.sort(key=rank, reverse=True)
        for v in victims:
            if not bm.shortfall(r.request_id, num_tokens, reserve):
                break
            self.preempt(v, batch)

    # ---- preemption --------------------------------------------------------------------------
    def preempt(self, r: Request, batch: Batch, swap: bool = True) -> None:
        """Free `r`'s device blocks: by swapping its KV to the host pool (swap or auto mode,
        when the pool has room and, for auto, swapping is predicted cheaper) or by dropping it
        (always with `swap` False: an executor that dropped it already)."""
        r.num_preemptions += 1
        self.stats.preemptions += 1
        pool = self.host_pool
        if (
            swap
            and pool is not None
            and pool.should_swap(r, self._prefill_times.time(r.num_computed))
        ):
            self._swap_out(r, batch)
        else:
            self._recompute(r, batch)

    def _recompute(self, r: Request, batch: Batch) -> None:
        """Recompute preemption: drop the KV; the whole context is prefilled again later."""
        self.stats.recomputes += 1
        self.stats.recomputed_tokens += r.num_computed
        self.blocks.free(r.request_id)
        r.num_computed = r.num_scheduled = r.kv_capacity = 0
        r.num_cached_tokens = r.num_host_cached_tokens = 0
        r.transition(RequestState.PREEMPTED)
        r.total_work_s = max(self._prefill_times.time(r.num_tokens), 1e-12)
        r.remaining_work_s = r.total_work_s
        batch.preempted.append(r)

    def _swap_out(self, r: Request, batch: Batch) -> None:
        """Swap preemption: the KV goes to host blocks (copied before the batch runs); the
        request keeps its progress and waits, out of every queue, to be swapped back in."""
        swap = self.host_pool.swap_out(r, self.blocks)
        batch.swap_out.append(swap)
        self._resume[r.request_id] = r.state
        r.transition(RequestState.SWAPPED)
        r.kv_capacity = 0
        r.num_swaps += 1
        self._swapped[r.request_id] = r
        self.stats.swap_outs += 1
        self.stats.swapped_out_blocks += len(swap.host_blocks)

    def swap_in(self, batch: Batch, urgent: Request | None) -> None:
        """Bring swapped requests back while device blocks allow, most urgent first (under a
        class policy; else in swap-out order), each with room for its next token and in the
        phase it left. New prefills leave the watermark to running decodes, and so do these,
        unless the cache is empty. Order is kept: a request that does not fit stops the others
        behind it, and so does one of a less urgent class than `urgent`, the most urgent
        prefill waiting (it would only be evicted again)."""
        pool, bm = self.host_pool, self.blocks
        waiting = list(self._swapped.values())
        if self._policy.uses_classes:
            waiting.sort(key=lambda r: r.priority_rank)  # stable: swap-out order in a class
        for r in waiting:
            if urgent is not None and urgent.priority_rank < r.priority_rank:
                break
            need = pool.swap_in_need(r)
            reserve = self.watermark_blocks if bm.num_used else 0
            if bm.shortfall(r.request_id, need * bm.block_size, reserve):
                break
            swap = pool.swap_in(r, bm)
            bm.grow(r.request_id, need * bm.block_size)
            r.kv_capacity = bm.tokens_held(r.request_id)
            del self._swapped[r.request_id]
            r.transition(self._resume.pop(r.request_id))
            batch.swap_in.append(swap)
            self.stats.swap_ins += 1
            self.stats.swapped_in_blocks += len(swap.host_blocks)

    def time_swaps(self, batch: Batch) -> None:
        """Set the batch's `swap_time_s`, the predicted time of all its copies, in and out,
        and count it (the scheduler calls it for batches that move KV only)."""
        moved = sum(len(s.host_blocks) for s in (*batch.swap_in, *batch.swap_out))
        moved += len(batch.cache_out) + len(batch.cache_in)
        batch.swap_time_s = self.swap_cost.time(moved)
        self.stats.swap_time_s += batch.swap_time_s

    def free(self, r: Request) -> None:
        """Release every block `r` holds: on the device, or on the host if it is swapped out
        (it finished or was aborted; no running batch writes its KV any more)."""
        if self._swapped.pop(r.request_id, None) is not None:
            del self._resume[r.request_id]
            self.host_pool.free(r.request_id)
        self.blocks.free(r.request_id)

    # ---- prefix cache ------------------------------------------------------------------------
    def peek_cached(self, r: Request) -> int:
        """Prompt tokens the caches hold for `r` now (device, then host tier); nothing is
        taken. What its deadline and predicted work leave out when it is admitted."""
        if not self.prefix_caching:
            return 0
        bs = self.blocks.block_size
        keys, per, limit = cacheable_pages(r, bs)
        n = len(self.blocks.match(keys, limit))
        tier = self.host_cache
        if tier is not None:
            while n < limit and keys[n] in tier:
                n += 1
        return n * per * bs

    def attach_cached(self, r: Request) -> None:
        """At the (re)start of `r`'s prefill, before its first chunk is planned: take the
        longest cached prefix of its prompt. Device pages are shared; pages found only in the
        host tier are copied back into fresh device blocks when that is predicted cheaper than
        recomputing them and they fit above the watermark. The tokens count as computed."""
        if r.num_scheduled or not self.prefix_caching:
            return
        bm, tier, rid = self.blocks, self.host_cache, r.request_id
        bs = bm.block_size
        keys, per, limit = cacheable_pages(r, bs)
        if not limit:
            return
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
            r.num_host_cached_tokens = 0  # (what an earlier try copied back is gone again)
            return
        for key in load:  # pinned first: a device eviction below must not push them out
            tier.pin(key)
        for key in load:
            tier.load(key, bm.append_cached(rid, key, per))
        hit = bm.tokens_held(rid)
        r.num_computed = r.num_scheduled = r.kv_capacity = r.num_cached_tokens = hit
        # pages copied back for an earlier try of this start, and on the device since, came
        # from the host tier too (detach_cached keeps the count)
        r.num_host_cached_tokens = min(hit, r.num_host_cached_tokens + len(load) * per * bs)
        r.remaining_work_s = self._prefill_times.remaining(r.num_tokens, hit)

    def detach_cached(self, r: Request) -> None:
        """Give back the cached prefix of a request that attached one and was not scheduled
        after all: it looks again when it is next considered (the cache may hold more by
        then), and its blocks are evictable meanwhile."""
        if r.num_cached_tokens and not r.started and not r.num_inflight_batches:
            self.blocks.free(r.request_id)
            r.num_computed = r.num_scheduled = r.kv_capacity = r.num_cached_tokens = 0

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

    def take_cache_copies(self, batch: Batch) -> None:
        """Put the host tier's copies planned while `batch` formed on it."""
        tier = self.host_cache
        if tier is not None and (tier.copies_out or tier.copies_in):
            batch.cache_out, batch.cache_in = tier.drain()
            self.stats.host_cache_out_blocks += len(batch.cache_out)

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self, aborted_inflight: Mapping[str, Request]) -> None:
        """Block accounting is exact, and every live request holds KV for what it scheduled:
        on the device, or (swapped out, with nothing in flight) in the host pool. Blocks belong
        only to live requests and to aborted ones that a running batch still writes."""
        bm = self.blocks
        bm.check_invariants()
        for rid, r in self._live.items():
            if (r.state is RequestState.SWAPPED) != (rid in self._swapped):
                raise BlockAccountingError(f"{r}: its state and the swapped queue disagree")
            if rid in self._swapped:
                if r.num_inflight_batches or r.num_scheduled != r.num_computed:
                    raise BlockAccountingError(f"{r} was swapped out with work in flight")
            elif bm.tokens_held(rid) < r.num_scheduled:
                raise BlockAccountingError(f"{r} scheduled tokens it holds no KV for")
            if r.kv_capacity != bm.tokens_held(rid):
                raise BlockAccountingError(
                    f"{r} records KV capacity {r.kv_capacity}, holds {bm.tokens_held(rid)}"
                )
        for rid in bm.owners():
            if rid not in self._live and rid not in aborted_inflight:
                raise BlockAccountingError(f"blocks of {rid} outlived the request")
        if self.host_cache is not None:
            self.host_cache.check_invariants()
        if self.host_pool is not None:
            self.host_pool.check_invariants(self._swapped, bm)
        elif self._swapped:
            raise BlockAccountingError("requests are swapped out without a host pool")
