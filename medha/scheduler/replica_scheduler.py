"""The replica scheduler: one object that both the simulator and the engine drive.

It never reads a clock. Callers pass `now` to every call and report each batch back with
`update`, which is what makes a simulated executor and a real one interchangeable.

    sched.add_request(request, now)
    batch = sched.schedule(now)          # None when there is nothing to run
    ... run it ...
    finished = sched.update(batch, BatchResult(duration_s, token_ids), now_after)

The scheduler keeps the queues, the policy and the packer, and applies results; KV memory,
and whom to preempt when it runs short, is its KV arbiter's (`kv`, see kv_arbiter.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from medha.core.batch import Batch, BatchResult, Chunk
from medha.core.config import SchedulerConfig
from medha.core.request import Request, RequestState
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.kv_arbiter import KVArbiter, KVStats
from medha.scheduler.packers import make_packer
from medha.scheduler.policies import make_policy


class SchedulerInvariantError(AssertionError):
    pass


@dataclass
class SchedulerStats(KVStats):
    """The KV arbiter's preemption and swap counters, and the scheduler's own."""

    batches: int = 0
    finished: int = 0
    aborted: int = 0


class ReplicaScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        predictor: Predictor,
        blocks: BlockManager,
        prefill_times: PrefillTimeCache | None = None,
        block_tables: bool = True,
    ) -> None:
        """`prefill_times` lets replicas with the same predictor and packer share one cache.
        `block_tables`: each chunk of a batch carries its request's KV block ids, what an engine
        runs it with; the simulator, which runs no model, turns them off (setting them cost
        ~10% of its time)."""
        self.block_tables = block_tables
        # The one resolution of the config: the packer, the policy, the KV arbiter and the
        # simulator's metrics all read this object's defaults (resolve returns it unchanged).
        self.config = config = config.resolve(predictor)
        self.predictor = predictor
        self.packer = make_packer(config, predictor)
        self.policy = make_policy(config.policy or self.packer.default_policy, config)
        self.max_model_len: int = config.max_model_len
        self.prefill_times = prefill_times or PrefillTimeCache(
            predictor, self.packer.plan_isolated, self.max_model_len
        )
        self.policy.bind(predictor, blocks, self.max_model_len)
        self._max_batch_tokens = self.packer.max_batch_tokens(self.max_model_len)
        self.long_threshold: int = config.long_prefill_threshold
        self._requests: dict[str, Request] = {}  # every live request
        # how many of them carry their own TPOT target: batches look for the tightest only
        # while some do (a read per decode per batch is ~2% of the simulator's time)
        self._own_tpot_targets = 0
        # A live request is in exactly one of: _prefilling (waiting, prefilling or preempted),
        # _decoding, or the arbiter's `swapped` (its KV in the host pool).
        self._prefilling: dict[str, Request] = {}
        self._decoding: dict[str, Request] = {}
        self._aborted_inflight: dict[str, Request] = {}  # aborted, KV freed when batches return
        self.stats = SchedulerStats()
        self.kv = KVArbiter(
            config, predictor, blocks, self.policy, self.prefill_times, self._requests, self.stats
        )
        self._next_batch_id = 0
        self._admissions = 0
        self._inflight = 0  # batches scheduled and not yet updated

    @property
    def blocks(self) -> BlockManager:
        """The device KV blocks (the arbiter's; read them, never change them from outside)."""
        return self.kv.blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request, now: float | None = None) -> None:
        """Admit a request. Raises ValueError naming the field and changes nothing on bad input."""
        request.validate(self.max_model_len)
        if request.request_id in self._requests:
            raise ValueError(f"request_id {request.request_id!r} is already in the scheduler")
        if request.state is not RequestState.WAITING or request.num_scheduled:
            raise ValueError(
                f"request {request.request_id!r} was already scheduled elsewhere "
                f"(state {request.state.value})"
            )
        total_tokens = request.prompt_len + request.max_tokens
        if total_tokens > self.blocks.capacity_tokens:
            raise ValueError(
                f"prompt_len + max_tokens = {total_tokens} exceeds the KV cache "
                f"capacity of {self.blocks.capacity_tokens} tokens"
            )
        # the work still to do: what the prefix cache holds of the prompt now is not
        work = self.prefill_times.remaining(request.prompt_len, self.kv.peek_cached(request))
        deadline = (
            request.ttft_deadline_s
            or self.config.ttft_deadline_s
            or max(self.config.ttft_deadline_factor * work, self.config.min_ttft_deadline_s)
        )
        request.deadline_s = request.arrival_s + deadline
        request.total_work_s = max(work, 1e-12)
        request.remaining_work_s = work
        request.admission_seq = self._admissions
        self._admissions += 1
        self._requests[request.request_id] = request
        self._prefilling[request.request_id] = request
        if request.tpot_target_s is not None:
            self._own_tpot_targets += 1

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        """Stop a live request and release its KV (once no running batch still writes it).
        `reason` becomes its finish_reason: "abort" (the client's choice) or "error" (it
        failed on its own)."""
        r = self._requests.pop(request_id, None)
        if r is None:
            return None
        if r.tpot_target_s is not None:
            self._own_tpot_targets -= 1
        self._prefilling.pop(request_id, None)
        self._decoding.pop(request_id, None)
        r.transition(RequestState.ABORTED)
        r.finish_s, r.finish_reason = now, reason
        if r.num_inflight_batches:  # (a swapped request runs in no batch)
            self._aborted_inflight[request_id] = r
        else:
            self.kv.free(r)
        self.stats.aborted += 1
        return r

    def live_requests(self):
        """Every admitted request that has not finished or been aborted (a read-only view)."""
        return self._requests.values()

    def get(self, request_id: str) -> Request | None:
        return self._requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests whose prefill has not started: new ones, and those preempted by recompute
        (their KV dropped, they start over)."""
        return self.prefill_counts()[0]

    @property
    def num_prefilling(self) -> int:
        """Requests whose prefill has started (a chunk scheduled) and not finished."""
        return self.prefill_counts()[1]

    def prefill_counts(self) -> tuple[int, int]:
        """(num_waiting, num_prefilling) of one instant: together, the prefill-phase queue.
        The queue is copied without running Python code in between, so without letting another
        thread in: a metrics scrape may count while the engine's thread changes it."""
        queue = tuple(self._prefilling.values())
        prefilling = RequestState.PREFILLING
        started = sum(r.state is prefilling for r in queue)
        return len(queue) - started, started

    @property
    def num_decoding(self) -> int:
        return len(self._decoding)

    @property
    def num_swapped(self) -> int:
        return len(self.kv.swapped)

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
        """Form the next batch: swap-ins, then (under a class policy) room for the most urgent
        prefill, then decodes, then the packer's prefill chunks. The KV arbiter records whom
        it preempted or swapped in the batch; after each step `_settle` moves them between the
        queues, so no step iterates a queue that changes under it, and each step sees the
        requests the step before moved where they now belong."""
        batch = Batch(self._next_batch_id, now)
        if self.kv.swapped:
            urgent = self._most_urgent_prefill(now) if self.policy.uses_classes else None
            self.kv.swap_in(batch, urgent)
            self._settle(batch)  # their decodes join this batch
        builder = self._fill(batch, now)
        if builder.is_empty and batch.preempted:
            # the only decodes picked (aligned picks a subset) preempted themselves for lack of
            # blocks: form the batch again in the room they left, rather than stall the caller
            builder = self._fill(batch, now)
        self.kv.take_cache_copies(batch)
        moves = batch.swap_in or batch.swap_out or batch.cache_out or batch.cache_in
        if builder.is_empty and not moves:
            return None  # (a batch that only moves KV still runs: its copies must happen)
        tables = self.blocks.blocks_of if self.block_tables else None
        if tables is not None:
            for chunk in batch.decodes:
                chunk.block_table = tables(chunk.request.request_id)
        for chunk in batch.prefills:
            r = chunk.request
            if tables is not None:
                chunk.block_table = tables(r.request_id)
            if r.state is not RequestState.PREFILLING:
                r.transition(RequestState.PREFILLING)
            if r.first_scheduled_s is None:
                r.first_scheduled_s = now
            if chunk.start == r.num_cached_tokens and self.kv.prefix_caching:
                self.kv.count_start(r)  # the first chunk of a (re)started prefill
        if moves:
            self.kv.time_swaps(batch)
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
            self._settle(batch)
        self._add_decodes(builder)
        self._settle(batch)  # a decode recomputed for an older one is a prefill again
        self._add_prefills(builder, now)
        self._settle(batch)
        return builder

    def _settle(self, batch: Batch) -> None:
        """Move the requests the arbiter swapped in, recomputed or swapped out for this batch
        to the queue of their state, in the order it moved them. Each step repeats it for the
        whole batch: a request already in its queue keeps its place there."""
        if not (batch.preempted or batch.swap_in or batch.swap_out):
            return  # the common case, once per step of a long simulation
        for s in batch.swap_in:  # back in the phase it left (unless preempted again since)
            r = s.request
            if r.state is RequestState.DECODING:
                self._decoding[r.request_id] = r
            elif r.state is RequestState.PREFILLING:
                self._prefilling[r.request_id] = r
        for r in batch.preempted:  # its KV dropped: prefilled again from the start
            self._decoding.pop(r.request_id, None)
            self._prefilling[r.request_id] = r
        for s in batch.swap_out:  # out of every queue until it is swapped back in
            self._decoding.pop(s.request.request_id, None)
            self._prefilling.pop(s.request.request_id, None)

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
        if r is None or not self.kv.may_start(r):
            return
        growing = sum(
            1
            for d in self._decoding.values()
            if d.num_inflight_batches == 0 and d.kv_capacity <= d.num_scheduled
        )
        self.kv.make_room(r, growing, builder.batch, builder.now)

    def _builder(self, batch: Batch, now: float, max_seqs: int) -> BatchBuilder:
        return BatchBuilder(
            self.kv,
            batch,
            self.predictor.timer(),
            now,
            max_seqs,
            self._max_batch_tokens,
            self.long_threshold,
        )

    def _add_prefills(self, builder: BatchBuilder, now: float) -> None:
        batch = builder.batch
        queue = self.policy.admit(list(self._prefilling.values()), self._requests.__contains__, now)
        if self._inflight or batch.preempted:
            # Skip requests whose remaining chunks are all running (pipelined batches), and
            # those the arbiter recomputed for this batch so far (for its decodes, an urgent
            # prefill, or a first try at it): memory is short, they wait a turn.
            queue = [
                r for r in queue if r.num_scheduled < r.num_tokens and r not in batch.preempted
            ]
        if queue:
            self.packer.pack(now, self._prefill_order(queue, now), builder)
            for r in builder.prepared:  # a cached prefix taken by a request left out
                self.kv.detach_cached(r)

    def _prefills_alone(self, batch: Batch, now: float) -> BatchBuilder:
        """An iteration of prefills only, if any can run; else one of decodes. The prefills
        get the sequence slots the decodes leave, so running requests stay within
        max_num_seqs (vLLM's cap on its running batch)."""
        room = self.config.max_num_seqs - len(self._decoding)
        builder = self._builder(batch, now, room)
        if room > 0:
            self._add_prefills(builder, now)
            self._settle(batch)
        if builder.is_empty:
            builder = self._builder(batch, now, self.config.max_num_seqs)
            self._add_decodes(builder)
            self._settle(batch)
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
            queue.sort(
                key=lambda r: (
                    r.priority_rank,
                    not (r.started and r.num_tokens < threshold),
                    key(r),
                )
            )
            return queue
        started = [r for r in queue if r.started and r.num_tokens < threshold]
        if not started:
            queue.sort(key=key)
            return queue
        rest = [r for r in queue if not (r.started and r.num_tokens < threshold)]
        started.sort(key=key)
        rest.sort(key=key)
        return started + rest

    def _add_decodes(self, builder: BatchBuilder) -> None:
        batch, now = builder.batch, builder.now
        decodes = [r for r in self._decoding.values() if r.num_inflight_batches == 0]
        if not decodes:
            return
        decodes = self.policy.select_decodes(decodes, now)
        short = [r for r in decodes if r.kv_capacity <= r.num_scheduled]  # need a new block
        if self.blocks.can_grow_each(len(short)) and len(decodes) <= builder.room_seqs:
            for r in short:
                self.kv.reserve(r, r.num_scheduled + 1, batch, now)
            builder.add_decodes(decodes, self._own_tpot_targets > 0)
            return
        # Someone will wait or be preempted: the oldest decodes (of the most urgent class, under
        # a class policy) keep their place. The arbiter evicts only requests ranked below the
        # one it makes room for (later in this list), so those chosen before it cannot become
        # victims, and they join the batch together at the end.
        decodes.sort(key=self.policy.eviction_rank(now))
        chosen: list[Request] = []
        room = builder.room_seqs
        for r in decodes:
            if len(chosen) == room:
                break
            if r.state is not RequestState.DECODING:
                continue  # the arbiter preempted it for an older decode of this list
            if r.kv_capacity > r.num_scheduled:  # its next token's block is there
                chosen.append(r)
            elif self.kv.reserve(r, r.num_scheduled + 1, batch, now) > r.num_scheduled:
                chosen.append(r)
            else:
                self.kv.preempt(r, batch)  # nobody below it to evict: it recomputes later
        builder.add_decodes(chosen, self._own_tpot_targets > 0)

    def revise(self, batch: Batch, chunk: Chunk, start: int, num_tokens: int) -> bool:
        """The executor runs `num_tokens` of `chunk`'s request from `start` instead of what the
        chunk planned: vLLM's engine starts a prompt after its prefix-cache hit, or cannot run
        a chunk at all (0 tokens: the chunk leaves the batch and its request waits as before;
        the KV reserved for it stays reserved). Called before the batch runs. False when the
        KV the executor placed (cached blocks) did not fit in this scheduler's free blocks."""
        r = chunk.request
        if not (0 <= start and 0 <= num_tokens and start + num_tokens <= r.num_tokens):
            raise ValueError(f"cannot revise {r.request_id} to [{start}:{start + num_tokens}]")
        if num_tokens == 0:
            (batch.decodes if chunk in batch.decodes else batch.prefills).remove(chunk)
            r.num_scheduled = chunk.start
            r.num_inflight_batches -= 1
            return True
        if start > r.num_computed and r.num_inflight_batches == 1:
            r.num_computed = start  # cached: their KV is there already
        chunk.start, chunk.num_tokens = start, num_tokens
        chunk.samples = chunk.end == r.num_tokens
        r.num_scheduled = chunk.end
        return chunk.end <= r.kv_capacity or self.kv.hold(r, chunk.end)

    def drop_kv(self, batch: Batch, request_id: str) -> None:
        """The executor dropped a request's KV on its own (vLLM preempts when it cannot place
        a chunk): it recomputes, as if this scheduler had preempted it for `batch`."""
        r = self._requests.get(request_id)
        if r is None or r.state not in (RequestState.PREFILLING, RequestState.DECODING):
            return
        if r.num_inflight_batches:
            raise ValueError(f"{request_id} runs in a batch: its KV cannot be dropped now")
        self.kv.preempt(r, batch, swap=False)
        self._settle(batch)

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
            if self.kv.prefix_caching:
                self.kv.cache_computed(r)
            if not chunk.samples:
                r.remaining_work_s = self.prefill_times.remaining(r.num_tokens, r.num_computed)
            elif self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
            else:
                r.transition(RequestState.DECODING)
                r.remaining_work_s = 0.0
                del self._prefilling[r.request_id]
                self._decoding[r.request_id] = r
        aborted = RequestState.ABORTED
        for chunk in batch.decodes:  # the hot loop of a long simulation (and of a big batch)
            r = chunk.request
            r.num_inflight_batches -= 1
            if r.state is aborted:
                self._release_aborted(r)
                continue
            r.num_computed = chunk.start + 1
            if tokens is None:  # _sampled inlined: no token ids to keep (simulator, vLLM)
                r.num_output_tokens += 1
                r.token_times_s.append(now)
                if (r.num_output_tokens >= r.max_tokens or r.request_id in stopped) and self._stops(
                    r, stopped, now
                ):
                    finished.append(r)
            elif self._sampled(r, batch, tokens, stopped, now):
                finished.append(r)
        return finished

    def discard(self, batch: Batch, now: float) -> list[Request]:
        """A batch that never completed (the executor failed): abort its requests and release
        their KV, since what it would have written is unknown."""
        self._inflight -= 1
        requests = {c.request.request_id: c.request for c in (*batch.prefills, *batch.decodes)}
        # the KV a failed batch was moving is as unknown as the KV it was writing
        requests.update(
            (s.request.request_id, s.request)
            for s in (*batch.swap_in, *batch.swap_out)
            if s.request.request_id in self._requests
        )
        for r in requests.values():
            self.abort(r.request_id, now)
        for c in (*batch.prefills, *batch.decodes):
            c.request.num_inflight_batches -= 1
            self._release_aborted(c.request)
        return list(requests.values())

    def _sampled(
        self,
        r: Request,
        batch: Batch,
        tokens: dict[str, int] | None,
        stopped: frozenset[str],
        now: float,
    ) -> bool:
        """Record the token a sampling chunk produced; True when it finished the request."""
        if tokens is not None:
            token = tokens.get(r.request_id)
            if token is None:
                raise ValueError(f"batch {batch.batch_id}: no token for {r.request_id}")
            r.output_token_ids.append(token)
        r.num_output_tokens += 1
        r.token_times_s.append(now)
        return self._stops(r, stopped, now)

    def _stops(self, r: Request, stopped: frozenset[str], now: float) -> bool:
        """Finish `r` if its latest token ended it (a stop the executor saw, or max_tokens)."""
        if r.request_id in stopped:
            self._finish(r, now, "stop")
            return True
        if r.num_output_tokens >= r.max_tokens:
            self._finish(r, now, "length")
            return True
        return False

    def _release_aborted(self, r: Request) -> None:
        if r.num_inflight_batches == 0 and self._aborted_inflight.pop(r.request_id, None):
            self.kv.free(r)

    def _finish(self, r: Request, now: float, reason: str) -> None:
        r.transition(RequestState.FINISHED)
        r.finish_s, r.finish_reason = now, reason
        self.kv.free(r)
        del self._requests[r.request_id]
        if r.tpot_target_s is not None:
            self._own_tpot_targets -= 1
        self._prefilling.pop(r.request_id, None)
        self._decoding.pop(r.request_id, None)
        self.stats.finished += 1

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every live request is in the queue of its state with consistent progress, and the
        arbiter's accounting is exact (see KVArbiter.check_invariants).

        Raises SchedulerInvariantError (or BlockAccountingError); tests call it after every batch.
        """
        swapped = self.kv.swapped
        for rid, r in self._requests.items():
            queued = (rid in self._prefilling) + (rid in self._decoding) + (rid in swapped)
            if queued != 1 or r.in_prefill != (rid in self._prefilling):
                raise SchedulerInvariantError(f"{r} is in the wrong queue")
            if not r.num_computed <= r.num_scheduled <= r.num_tokens:
                raise SchedulerInvariantError(f"{r} has inconsistent progress")
        own = sum(r.tpot_target_s is not None for r in self._requests.values())
        if own != self._own_tpot_targets:
            raise SchedulerInvariantError(
                f"{own} live requests carry their own TPOT target, counted {self._own_tpot_targets}"
            )
        self.kv.check_invariants(self._aborted_inflight)

    def predicted_isolated_prefill_s(self, num_tokens: int) -> float:
        return self.prefill_times.time(num_tokens)
