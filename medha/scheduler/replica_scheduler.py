"""The replica scheduler: one object that both the simulator and the engine drive.

It never reads a clock. Callers pass `now` to every call and report each batch back with
`update`, which is what makes a simulated executor and a real one interchangeable.

    sched.add_request(request, now)
    batch = sched.schedule(now)          # None when there is nothing to run
    ... run it ...
    finished = sched.update(batch, BatchResult(duration_s, token_ids), now_after)
"""

from __future__ import annotations

from dataclasses import dataclass

from medha.core.batch import Batch, BatchResult
from medha.core.config import SchedulerConfig
from medha.core.request import Request, RequestState
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.perf.swap_cost import SwapCost
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.host_kv_pool import HostKVPool
from medha.scheduler.packers import make_packer
from medha.scheduler.policies import make_policy


class SchedulerInvariantError(AssertionError):
    pass


@dataclass
class SchedulerStats:
    batches: int = 0
    preemptions: int = 0  # recomputes + swap-outs
    finished: int = 0
    aborted: int = 0
    recomputes: int = 0
    recomputed_tokens: int = 0  # KV dropped by recompute preemption, to be prefilled again
    swap_outs: int = 0
    swap_ins: int = 0
    swapped_out_blocks: int = 0
    swapped_in_blocks: int = 0
    swap_time_s: float = 0.0  # predicted time the swaps added to batches


class ReplicaScheduler:
    def __init__(self, config: SchedulerConfig, predictor: Predictor,
                 blocks: BlockManager, prefill_times: PrefillTimeCache | None = None) -> None:
        """`prefill_times` lets replicas with the same predictor and packer share one cache."""
        self.config = config = config.resolve(predictor)
        self.predictor = predictor
        self.blocks = blocks
        self.packer = make_packer(config, predictor)
        self.policy = make_policy(config.policy or self.packer.default_policy, config)
        # A longer max_model_len than the spec's is allowed: the long-context variants of a
        # model (RoPE-scaled) share its shapes; the engine checks its real checkpoint's limit.
        self.max_model_len = config.max_model_len or predictor.model.max_context
        self.prefill_times = prefill_times or PrefillTimeCache(
            predictor, self.packer.plan_isolated, self.max_model_len)
        self.policy.bind(predictor, blocks, self.max_model_len)
        self._max_batch_tokens = self.packer.max_batch_tokens(self.max_model_len)
        self.long_threshold = (config.long_prefill_threshold
                               or min(32768, max(1, self.max_model_len // 4)))
        self._watermark_blocks = int(config.watermark * blocks.num_blocks)
        self._requests: dict[str, Request] = {}  # every live request
        self._prefilling: dict[str, Request] = {}  # waiting, prefilling or preempted
        self._decoding: dict[str, Request] = {}
        self._aborted_inflight: dict[str, Request] = {}  # aborted, KV freed when batches return
        self._swapped: dict[str, Request] = {}  # KV in the host pool, in swap-out order
        self._resume: dict[str, RequestState] = {}  # the phase each swapped request left
        self.swap_cost = SwapCost(predictor, blocks.block_size, config.swap_bandwidth_gbps)
        self.host_pool = self._host_pool(config, blocks)
        self._next_batch_id = 0
        self._admissions = 0
        self._inflight = 0  # batches scheduled and not yet updated
        self.stats = SchedulerStats()

    def _host_pool(self, config: SchedulerConfig, blocks: BlockManager) -> HostKVPool | None:
        if config.preemption_mode == "recompute":
            return None
        if self.predictor.parallel.kvp > 1:
            raise ValueError("preemption_mode swap/auto with kvp > 1 is not built yet: use "
                             "preemption_mode recompute")
        n = config.host_kv_blocks
        if n is None:
            n = self.swap_cost.blocks_in(config.swap_space_gb * 2**30)
        # an empty pool never has room: every preemption recomputes
        return HostKVPool(n, blocks.block_size, self.swap_cost,
                          config.preemption_mode) if n > 0 else None

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request, now: float | None = None) -> None:
        """Admit a request. Raises ValueError naming the field and changes nothing on bad input."""
        request.validate(self.max_model_len)
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.state is not RequestState.WAITING or request.num_scheduled:
            raise ValueError(f"request {request.request_id!r} was already scheduled elsewhere "
                             f"(state {request.state.value})")
        total_tokens = request.prompt_len + request.max_tokens
        if total_tokens > self.blocks.capacity_tokens:
            raise ValueError(f"prompt_len + max_tokens = {total_tokens} exceeds the KV cache "
                             f"capacity of {self.blocks.capacity_tokens} tokens")
        work = self.prefill_times.time(request.prompt_len)
        deadline = (request.ttft_deadline_s or self.config.ttft_deadline_s
                    or max(self.config.ttft_deadline_factor * work,
                           self.config.min_ttft_deadline_s))
        request.deadline_s = request.arrival_s + deadline
        request.total_work_s = max(work, 1e-12)
        request.remaining_work_s = work
        request.admission_seq = self._admissions
        self._admissions += 1
        self._requests[request.request_id] = request
        self._prefilling[request.request_id] = request

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        """Stop a live request and release its KV (once no running batch still writes it).
        `reason` becomes its finish_reason: "abort" (the client's choice) or "error" (it
        failed on its own)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        self._prefilling.pop(request_id, None)
        self._decoding.pop(request_id, None)
        if self._swapped.pop(request_id, None) is not None:
            del self._resume[request_id]
            self.host_pool.free(request_id)  # a swapped request runs in no batch
        r.transition(RequestState.ABORTED)
        r.finish_s, r.finish_reason = now, reason
        if r.num_inflight_batches:
            self._aborted_inflight[request_id] = r
        else:
            self.blocks.free(request_id)
        self.stats.aborted += 1
        return r

    def live_requests(self):
        """Every admitted request that has not finished or been aborted (a read-only view)."""
        return self._requests.values()

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        return len(self._prefilling)

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    @property
    def num_swapped(self) -> int:
        return len(self._swapped)

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def wake_at(self) -> float | None:
        """When the policy lets go of prefills it held back at the last `schedule` (None: it
        holds none); an executor left idle calls `schedule` again then."""
        return self.policy.wake_at()

    def __len__(self) -> int:
        return len(self._requests)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self, now: float) -> Batch | None:
        batch = Batch(self._next_batch_id, now)
        if self._swapped:
            self._swap_in(batch, now)
        builder = self._fill(batch, now)
        if builder.is_empty and batch.preempted:
            # the only decodes picked (aligned picks a subset) preempted themselves for lack of
            # blocks: form the batch again in the room they left, rather than stall the caller
            builder = self._fill(batch, now)
        if builder.is_empty and not (batch.swap_in or batch.swap_out):
            return None  # (a batch that only moves KV still runs: its copies must happen)
        tables = self.blocks.blocks_of
        for chunk in batch.decodes:
            chunk.block_table = tables(chunk.request.request_id)
        for chunk in batch.prefills:
            r = chunk.request
            chunk.block_table = tables(r.request_id)
            if r.state is not RequestState.PREFILLING:
                r.transition(RequestState.PREFILLING)
            if r.first_scheduled_s is None:
                r.first_scheduled_s = now
        if batch.swap_in or batch.swap_out:
            moved = sum(len(s.host_blocks) for s in (*batch.swap_in, *batch.swap_out))
            batch.swap_time_s = self.swap_cost.time(moved)
            self.stats.swap_time_s += batch.swap_time_s
        batch.predicted_time_s = builder.timer.time() + batch.swap_time_s
        self._inflight += 1
        self._next_batch_id += 1
        self.stats.batches += 1
        return batch

    def _fill(self, batch: Batch, now: float) -> BatchBuilder:
        if self.config.prefill_only_iterations:
            return self._prefills_alone(batch, now)
        builder = self._builder(batch, now, self.config.max_num_seqs)
        if self.policy.uses_classes:
            self._room_for_urgent_prefill(builder)
        self._add_decodes(builder)
        self._add_prefills(builder, now)
        return builder

    def _most_urgent_prefill(self, now: float) -> Request | None:
        """The first prefill-phase request in policy order that has work left to schedule."""
        queue = [r for r in self._prefilling.values() if r.num_scheduled < r.num_tokens]
        return min(queue, key=self.policy.sort_key(now)) if queue else None

    def _room_for_urgent_prefill(self, builder: BatchBuilder) -> None:
        """Under a class policy the most urgent prefill may preempt running decodes (and
        prefills) of less urgent classes. The decodes join the batch before any prefill and a
        batch member cannot be evicted, so the room is made first: enough for the prefill's
        whole context, plus a block for each decode that needs one."""
        r = self._most_urgent_prefill(builder.now)
        if r is None or (r.num_scheduled == 0 and self._swapped
                         and not self._outranks_swapped(r)):
            return
        growing = sum(1 for d in self._decoding.values()
                      if d.num_inflight_batches == 0 and d.kv_capacity <= d.num_scheduled)
        reserve = growing + self._watermark_blocks
        if self.blocks.shortfall(r.request_id, r.num_tokens, reserve):
            self._evict_below(r, r.num_tokens, reserve, builder, evict_decodes=True)

    def _builder(self, batch: Batch, now: float, max_seqs: int) -> BatchBuilder:
        return BatchBuilder(self, batch, self.predictor.timer(), now, max_seqs,
                            self._max_batch_tokens)

    def _add_prefills(self, builder: BatchBuilder, now: float) -> None:
        batch = builder.batch
        queue = self.policy.admit(list(self._prefilling.values()), self._requests.__contains__,
                                  now)
        if self._inflight or batch.preempted:
            # Skip requests whose remaining chunks are all running (pipelined batches), and
            # those preempted a moment ago: memory is short, they wait a turn.
            queue = [r for r in queue
                     if r.num_scheduled < r.num_tokens and r not in batch.preempted]
        if queue:
            self.packer.pack(now, self._prefill_order(queue, now), builder)

    def _prefills_alone(self, batch: Batch, now: float) -> BatchBuilder:
        """An iteration of prefills only, if any can run; else one of decodes. The prefills
        get the sequence slots the decodes leave, so running requests stay within
        max_num_seqs (vLLM's cap on its running batch)."""
        room = self.config.max_num_seqs - len(self._decoding)
        builder = self._builder(batch, now, room)
        if room > 0:
            self._add_prefills(builder, now)
        if builder.is_empty:
            builder = self._builder(batch, now, self.config.max_num_seqs)
            self._add_decodes(builder)
        return builder

    def _prefill_order(self, queue: list[Request], now: float) -> list[Request]:
        """Policy order, except that a short prefill already under way goes first.

        Slack-based keys rise as a request is served (its remaining work shrinks while its
        slack stays), so without this rule short prefills would take turns, each finishing
        just before its deadline instead of one after the other. Long prefills stay in policy
        order: their share is what space sharing and LARS arbitrate.
        """
        key = self.policy.sort_key(now)
        threshold = self.long_threshold
        if self.policy.uses_classes:  # the rule applies within a class, never across
            queue.sort(key=lambda r: (r.priority_rank,
                                      not (r.num_scheduled and r.num_tokens < threshold), key(r)))
            return queue
        started = [r for r in queue if r.num_scheduled and r.num_tokens < threshold]
        if not started:
            queue.sort(key=key)
            return queue
        rest = [r for r in queue if not (r.num_scheduled and r.num_tokens < threshold)]
        started.sort(key=key)
        rest.sort(key=key)
        return started + rest

    def _add_decodes(self, builder: BatchBuilder) -> None:
        decodes = [r for r in self._decoding.values() if r.num_inflight_batches == 0]
        if not decodes:
            return
        decodes = self.policy.select_decodes(decodes, builder.now)
        short = [r for r in decodes if r.kv_capacity <= r.num_scheduled]  # need a new block
        if self.blocks.can_grow_each(len(short)) and len(decodes) <= builder.room_seqs:
            for r in short:
                self.reserve_kv(r, r.num_scheduled + 1, builder)
            builder.add_decodes(decodes)
            return
        # Someone will wait or be preempted: the oldest decodes (of the most urgent class, under
        # a class policy) keep their place, and each one joins the batch before the next looks
        # for victims, so it cannot become one.
        decodes.sort(key=self._eviction_rank(builder.now))
        for r in decodes:
            if builder.room_seqs == 0:
                break
            if r.state is not RequestState.DECODING:
                continue  # preempted a moment ago to make room for an older decode
            if self.reserve_kv(r, r.num_scheduled + 1, builder) > r.num_scheduled:
                builder.add_decodes([r])
            else:
                self._preempt(r, builder)  # nobody below it to evict: it recomputes later

    def reserve_kv(self, r: Request, num_tokens: int, builder: BatchBuilder,
                   all_or_nothing: bool = False) -> int:
        """Make `r` hold KV for `num_tokens` tokens, evicting lower-priority requests if needed.

        Decodes may evict anyone ranked below them; prefill chunks only evict other prefills,
        so that admitting new work never throws away a running decode. New prefill chunks leave
        a watermark of blocks free for decodes, unless the batch would otherwise be empty.
        """
        if r.state is RequestState.SWAPPED:
            return r.num_scheduled  # swapped out while this batch formed (the packer's queue)
        bm = self.blocks
        decode = r.state is RequestState.DECODING
        reserve = 0 if decode or builder.is_empty else self._watermark_blocks
        # A prefill starts (or restarts after preemption) only when its whole context fits,
        # so that it is not evicted half-way by the decodes it would crowd out.
        starting = r.num_scheduled == 0
        if starting and self._swapped and not self._outranks_swapped(r):
            return r.num_scheduled  # swapped requests come back before new prefills start
        must_fit = r.num_tokens if starting else num_tokens
        if bm.shortfall(r.request_id, must_fit, reserve):
            # under a class policy the ranks alone keep a prefill off its own class's decodes
            self._evict_below(r, must_fit, reserve, builder,
                              evict_decodes=decode or self.policy.uses_classes)
            if (all_or_nothing or starting) and bm.shortfall(r.request_id, must_fit, reserve):
                return r.num_scheduled
        held = bm.grow(r.request_id, num_tokens, reserve)
        r.kv_capacity = bm.tokens_held(r.request_id)
        return held

    def _eviction_rank(self, now: float):
        """Lower ranks are kept longer. Running decodes outrank every prefill (evicting one
        throws away admitted work and stalls its token stream); among decodes the newest goes
        first, as in vLLM; among prefills the policy decides. A class policy ranks by class
        before all that: a LOW decode goes before a HIGH prefill."""
        key = self.policy.sort_key(now)
        decoding = RequestState.DECODING
        if self.policy.uses_classes:
            return lambda r: ((r.priority_rank, 0, r.arrival_s, r.admission_seq)
                              if r.state is decoding
                              else (r.priority_rank, 1, key(r), r.admission_seq))
        return lambda r: ((0, r.arrival_s, r.admission_seq) if r.state is decoding
                          else (1, key(r), r.admission_seq))

    def _evict_below(self, r: Request, num_tokens: int, reserve: int, builder: BatchBuilder,
                     evict_decodes: bool) -> None:
        """Preempt requests ranked below `r` until it can hold `num_tokens` tokens with
        `reserve` blocks left free."""
        rank = self._eviction_rank(builder.now)
        mine = rank(r)
        # batch members are in flight; swapped requests hold no device blocks; a request
        # swapped in for this batch stays (its copy is already planned)
        back = {s.request.request_id for s in builder.batch.swap_in}
        victims = [v for v in self._requests.values()
                   if v is not r and v.num_inflight_batches == 0 and v.num_scheduled > 0
                   and (evict_decodes or v.in_prefill) and v.request_id not in self._swapped
                   and v.request_id not in back and rank(v) > mine]
        # Evict only when that makes enough room: work thrown away for nothing can livelock
        # (a prefill evicted for a request that still does not fit restarts in the room it
        # left, and is evicted again by the next try).
        bm = self.blocks
        if bm.shortfall(r.request_id, num_tokens, reserve,
                        tuple(v.request_id for v in victims)):
            return
        victims.sort(key=rank, reverse=True)
        for v in victims:
            if not bm.shortfall(r.request_id, num_tokens, reserve):
                break
            self._preempt(v, builder)

    def _preempt(self, r: Request, builder: BatchBuilder) -> None:
        """Free `r`'s device blocks: by swapping its KV to the host pool (swap or auto mode,
        when the pool has room and, for auto, swapping is predicted cheaper) or by dropping it."""
        r.num_preemptions += 1
        self.stats.preemptions += 1
        pool = self.host_pool
        if pool is not None and pool.should_swap(r, self.prefill_times.time(r.num_computed)):
            self._swap_out(r, builder.batch)
        else:
            self._recompute(r, builder.batch)

    def _recompute(self, r: Request, batch: Batch) -> None:
        """Recompute preemption: drop the KV; the whole context is prefilled again later."""
        self.stats.recomputes += 1
        self.stats.recomputed_tokens += r.num_computed
        self.blocks.free(r.request_id)
        r.num_computed = r.num_scheduled = r.kv_capacity = 0
        r.transition(RequestState.PREEMPTED)
        self._decoding.pop(r.request_id, None)
        self._prefilling[r.request_id] = r
        r.total_work_s = max(self.prefill_times.time(r.num_tokens), 1e-12)
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
        self._decoding.pop(r.request_id, None)
        self._prefilling.pop(r.request_id, None)
        self._swapped[r.request_id] = r
        self.stats.swap_outs += 1
        self.stats.swapped_out_blocks += len(swap.host_blocks)

    def _swap_in(self, batch: Batch, now: float) -> None:
        """Bring swapped requests back while device blocks allow, most urgent first (under a
        class policy; else in swap-out order), each with room for its next token. New
        prefills leave the watermark to running decodes, and so do these, unless the cache is
        empty. Order is kept: a request that does not fit stops the others behind it."""
        pool, bm = self.host_pool, self.blocks
        waiting = list(self._swapped.values())
        urgent = None
        if self.policy.uses_classes:
            waiting.sort(key=lambda r: r.priority_rank)  # stable: swap-out order in a class
            urgent = self._most_urgent_prefill(now)
        for r in waiting:
            if urgent is not None and urgent.priority_rank < r.priority_rank:
                break  # a more urgent prefill would only evict it again
            need = pool.swap_in_need(r)
            reserve = self._watermark_blocks if bm.num_used else 0
            if bm.shortfall(r.request_id, need * bm.block_size, reserve):
                break
            swap = pool.swap_in(r, bm)
            bm.grow(r.request_id, need * bm.block_size)
            r.kv_capacity = bm.tokens_held(r.request_id)
            del self._swapped[r.request_id]
            resume = self._resume.pop(r.request_id)
            r.transition(resume)
            queue = self._decoding if resume is RequestState.DECODING else self._prefilling
            queue[r.request_id] = r
            batch.swap_in.append(swap)
            self.stats.swap_ins += 1
            self.stats.swapped_in_blocks += len(swap.host_blocks)

    def _outranks_swapped(self, r: Request) -> bool:
        """May `r` start while swapped requests wait for blocks? Only under a class policy, and
        only when it is of a more urgent class than every one of them (else they would starve
        behind new arrivals)."""
        if not self.policy.uses_classes:
            return False
        return r.priority_rank < min(s.priority_rank for s in self._swapped.values())

    # ---- results -----------------------------------------------------------------------------
    def update(self, batch: Batch, result: BatchResult, now: float) -> list[Request]:
        """Apply a finished batch: advance KV, append sampled tokens, retire finished requests."""
        finished: list[Request] = []
        self._inflight -= 1
        tokens, stopped = result.token_ids, result.stopped
        for chunk in batch.prefills:
            r = chunk.request
            r.num_inflight_batches -= 1
            if r.state is RequestState.ABORTED:
                self._release_aborted(r)
                continue
            r.num_computed = max(r.num_computed, chunk.start + chunk.num_tokens)
            if not chunk.samples:
                r.remaining_work_s = self.prefill_times.remaining(r.num_tokens, r.num_computed)
            elif self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
            else:
                r.transition(RequestState.DECODING)
                r.remaining_work_s = 0.0
                del self._prefilling[r.request_id]
                self._decoding[r.request_id] = r
        for chunk in batch.decodes:  # the hot loop of a long simulation: kept lean
            r = chunk.request
            r.num_inflight_batches -= 1
            if r.state is RequestState.ABORTED:
                self._release_aborted(r)
                continue
            r.num_computed = chunk.start + 1
            if self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
        return finished

    def discard(self, batch: Batch, now: float) -> list[Request]:
        """A batch that never completed (the executor failed): abort its requests and release
        their KV, since what it would have written is unknown."""
        self._inflight -= 1
        requests = {c.request.request_id: c.request for c in (*batch.prefills, *batch.decodes)}
        # the KV a failed batch was moving is as unknown as the KV it was writing
        requests.update((s.request.request_id, s.request)
                        for s in (*batch.swap_in, *batch.swap_out)
                        if s.request.request_id in self._requests)
        for r in requests.values():
            self.abort(r.request_id, now)
        for c in (*batch.prefills, *batch.decodes):
            c.request.num_inflight_batches -= 1
            self._release_aborted(c.request)
        return list(requests.values())

    def _sampled(self, r: Request, batch: Batch, tokens: dict[str, int] | None,
                 stopped: frozenset[str], now: float) -> bool:
        """Record the token a sampling chunk produced; True when it finished the request."""
        if tokens is not None:
            token = tokens.get(r.request_id)
            if token is None:
                raise ValueError(f"batch {batch.batch_id}: no token for {r.request_id}")
            r.output_token_ids.append(token)
        r.num_output_tokens += 1
        r.token_times_s.append(now)
        if r.request_id in stopped:
            self._finish(r, now, "stop")
            return True
        if r.num_output_tokens >= r.max_tokens:
            self._finish(r, now, "length")
            return True
        return False

    def _release_aborted(self, r: Request) -> None:
        if r.num_inflight_batches == 0 and self._aborted_inflight.pop(r.request_id, None):
            self.blocks.free(r.request_id)

    def _finish(self, r: Request, now: float, reason: str) -> None:
        r.transition(RequestState.FINISHED)
        r.finish_s, r.finish_reason = now, reason
        self.blocks.free(r.request_id)
        del self._requests[r.request_id]
        self._prefilling.pop(r.request_id, None)
        self._decoding.pop(r.request_id, None)
        self.stats.finished += 1

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Block accounting is exact, and every live request holds KV for what it scheduled.

        Raises SchedulerInvariantError (or BlockAccountingError); tests call it after every batch.
        """
        self.blocks.check_invariants()
        bm = self.blocks
        for rid, r in self._requests.items():
            queued = (rid in self._prefilling) + (rid in self._decoding) + (rid in self._swapped)
            if queued != 1 or r.in_prefill != (rid in self._prefilling):
                raise SchedulerInvariantError(f"{r} is in the wrong queue")
            if (r.state is RequestState.SWAPPED) != (rid in self._swapped):
                raise SchedulerInvariantError(f"{r} is in the wrong queue")
            if rid in self._swapped:
                if r.num_inflight_batches or r.num_scheduled != r.num_computed:
                    raise SchedulerInvariantError(f"{r} was swapped out with work in flight")
            elif bm.tokens_held(rid) < r.num_scheduled:
                raise SchedulerInvariantError(f"{r} scheduled tokens it holds no KV for")
            if r.kv_capacity != bm.tokens_held(rid):
                raise SchedulerInvariantError(f"{r} records KV capacity {r.kv_capacity}, "
                                              f"holds {bm.tokens_held(rid)}")
            if not r.num_computed <= r.num_scheduled <= r.num_tokens:
                raise SchedulerInvariantError(f"{r} has inconsistent progress")
        owners = set(self._requests) | set(self._aborted_inflight)
        for rid in bm.owners():
            if rid not in owners:
                raise SchedulerInvariantError(f"blocks of {rid} outlived the request")
        if self.host_pool is not None:
            self.host_pool.check_invariants(self._swapped, bm)
        elif self._swapped:
            raise SchedulerInvariantError("requests are swapped out without a host pool")

    def predicted_isolated_prefill_s(self, num_tokens: int) -> float:
        return self.prefill_times.time(num_tokens)
