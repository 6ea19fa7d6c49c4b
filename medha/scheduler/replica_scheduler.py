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
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.packers import make_packer
from medha.scheduler.policies import make_policy


class SchedulerInvariantError(AssertionError):
    pass


@dataclass
class SchedulerStats:
    batches: int = 0
    preemptions: int = 0
    finished: int = 0
    aborted: int = 0


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
        self._next_batch_id = 0
        self._admissions = 0
        self._inflight = 0  # batches scheduled and not yet updated
        self.stats = SchedulerStats()

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

    def abort(self, request_id: str, now: float) -> Request | None:
        """Stop a live request and release its KV (once no running batch still writes it)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        self._prefilling.pop(request_id, None)
        self._decoding.pop(request_id, None)
        r.transition(RequestState.ABORTED)
        r.finish_s, r.finish_reason = now, "abort"
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

    def has_unfinished(self) -> bool:
        return bool(self._requests)

    def __len__(self) -> int:
        return len(self._requests)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self, now: float) -> Batch | None:
        batch = Batch(self._next_batch_id, now)
        if self.config.prefill_only_iterations:
            builder = self._prefills_alone(batch, now)
        else:
            builder = self._builder(batch, now, self.config.max_num_seqs)
            self._add_decodes(builder)
            self._add_prefills(builder, now)
        if builder.is_empty:
            return None
        for chunk in batch.prefills:
            r = chunk.request
            if r.state is not RequestState.PREFILLING:
                r.transition(RequestState.PREFILLING)
            if r.first_scheduled_s is None:
                r.first_scheduled_s = now
        batch.predicted_time_s = builder.timer.time()
        self._inflight += 1
        self._next_batch_id += 1
        self.stats.batches += 1
        return batch

    def _builder(self, batch: Batch, now: float, max_seqs: int) -> BatchBuilder:
        return BatchBuilder(self, batch, self.predictor.timer(), now, max_seqs,
                            self._max_batch_tokens)

    def _add_prefills(self, builder: BatchBuilder, now: float) -> None:
        batch = builder.batch
        queue = self.policy.admit(list(self._prefilling.values()), self._requests.__contains__)
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
        if len(short) <= self.blocks.num_free and len(decodes) <= builder.room_seqs:
            for r in short:
                self.reserve_kv(r, r.num_scheduled + 1, builder)
            builder.add_decodes(decodes)
            return
        # Someone will wait or be preempted: the oldest decodes keep their place, and each one
        # joins the batch before the next looks for victims, so it cannot become one.
        decodes.sort(key=lambda r: (r.arrival_s, r.admission_seq))
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
        bm = self.blocks
        need = bm.blocks_needed(r.request_id, num_tokens)
        decode = r.state is RequestState.DECODING
        reserve = 0 if decode or builder.is_empty else self._watermark_blocks
        # A prefill starts (or restarts after preemption) only when its whole context fits,
        # so that it is not evicted half-way by the decodes it would crowd out.
        starting = r.num_scheduled == 0
        must_fit = bm.blocks_needed(r.request_id, r.num_tokens) if starting else need
        if must_fit > bm.num_free - reserve:
            self._evict_below(r, must_fit + reserve, builder, evict_decodes=decode)
            if (all_or_nothing or starting) and must_fit > bm.num_free - reserve:
                return r.num_scheduled
        held = bm.grow(r.request_id, num_tokens, reserve)
        r.kv_capacity = bm.tokens_held(r.request_id)
        return held

    def _eviction_rank(self, now: float):
        """Lower ranks are kept longer. Running decodes outrank every prefill (evicting one
        throws away admitted work and stalls its token stream); among decodes the newest goes
        first, as in vLLM; among prefills the policy decides."""
        key = self.policy.sort_key(now)
        return lambda r: ((0, r.arrival_s, r.admission_seq) if r.state is RequestState.DECODING
                          else (1, key(r), r.admission_seq))

    def _evict_below(self, r: Request, free_target: int, builder: BatchBuilder,
                     evict_decodes: bool) -> None:
        rank = self._eviction_rank(builder.now)
        mine = rank(r)
        victims = [v for v in self._requests.values()  # batch members are in flight
                   if v is not r and v.num_inflight_batches == 0 and v.num_scheduled > 0
                   and (evict_decodes or v.in_prefill) and rank(v) > mine]
        victims.sort(key=rank, reverse=True)
        for v in victims:
            if self.blocks.num_free >= free_target:
                break
            self._preempt(v, builder)

    def _preempt(self, r: Request, builder: BatchBuilder) -> None:
        """Recompute preemption: drop the KV; the whole context is prefilled again later."""
        self.blocks.free(r.request_id)
        r.num_computed = r.num_scheduled = r.kv_capacity = 0
        r.transition(RequestState.PREEMPTED)
        r.num_preemptions += 1
        self._decoding.pop(r.request_id, None)
        self._prefilling[r.request_id] = r
        r.total_work_s = max(self.prefill_times.time(r.num_tokens), 1e-12)
        r.remaining_work_s = r.total_work_s
        builder.batch.preempted.append(r)
        self.stats.preemptions += 1

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
            queued = (rid in self._prefilling) + (rid in self._decoding)
            if queued != 1 or r.in_prefill != (rid in self._prefilling):
                raise SchedulerInvariantError(f"{r} is in the wrong queue")
            if bm.tokens_held(rid) < r.num_scheduled:
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

    def predicted_isolated_prefill_s(self, num_tokens: int) -> float:
        return self.prefill_times.time(num_tokens)
