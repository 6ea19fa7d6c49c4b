"""The replica scheduler: one object that both the simulator and the engine drive.

It never reads a clock. Callers pass `now` to every call and report each batch back with
`update`, which is what makes a simulated executor and a real one interchangeable.

    sched.add_request(request, now)
    batch = sched.schedule(now)          # None when there is nothing to run
    ... run it ...
    finished = sched.update(batch, BatchResult(duration_s, token_ids), now_after)

The scheduler decides who runs: its policy orders, its packer sizes chunks, its KV arbiter
(`kv`, kv_arbiter.py) grants memory and picks whom to preempt when it runs short, and its
decode picker (`decode_picker`, decode_picker.py) says which decodes join a batch. What is
decided about a request is written by the request table (`requests`, request_table.py), which
alone changes a request's state and progress and keeps the queues. Its step clock (`clock`,
step_clock.py) times steps as the executor runs them; given a learner, its recalibration
(`recalibration`, recalibration.py) says when its defaults follow the corrected model.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Collection, Iterable, Iterator

from medha.core.batch import Batch, BatchResult, Chunk
from medha.core.request import Request, RequestState
from medha.perf.online_fit import StepLearner
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.decode_picker import DecodePicker
from medha.scheduler.kv_arbiter import KVArbiter
from medha.scheduler.packers import Packer, make_packer, replica_policy, replica_prefill_times
from medha.scheduler.paused_step import PausedStep
from medha.scheduler.recalibration import (
    REDEFAULT_FIRST,
    REDEFAULT_MOVE,
    RESOLVE_SLICE_S,
    Recalibration,
)
from medha.scheduler.replica_rules import is_long, prefill_order
from medha.scheduler.request_table import RequestTable, SchedulerInvariantError, SchedulerStats
from medha.scheduler.step_clock import STEP_SCALE_WEIGHT, StepClock
from medha.scheduler.step_log import StepLog

__all__ = [
    "REDEFAULT_FIRST",
    "REDEFAULT_MOVE",
    "RESOLVE_SLICE_S",
    "STEP_SCALE_WEIGHT",
    "ReplicaScheduler",
    "SchedulerInvariantError",
    "SchedulerStats",
]


class ReplicaScheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        predictor: Predictor,
        blocks: BlockManager,
        prefill_times: PrefillTimeCache | None = None,
        block_tables: bool = True,
        learner: StepLearner | None = None,
        async_scheduling: bool = False,
        resolve_slice_s: float | None = None,
        resolve_slice_steps: int | None = None,
    ) -> None:
        """`prefill_times` lets replicas with the same predictor and packer share one cache.
        `block_tables`: each chunk of a batch carries its request's KV block ids, what an engine
        runs it with; the simulator, which runs no model, turns them off (setting them is a
        sizeable share of its time).

        `async_scheduling`: the executor forms the next batch while the last one runs (vLLM's
        AsyncScheduler; `schedule` is called again before `update`). Each token the running
        batch samples is then counted as a placeholder of its request's context
        (`RequestTable.count_placeholders`), so that its next decode joins the next batch, as
        vLLM's output placeholders do; a request is never given a token past its max_tokens.
        Without it a request with a decode in flight sits the next batch out.

        `resolve_slice_s` / `resolve_slice_steps` (with a learner): how much of a re-resolution
        of its defaults one batch's update may run, timed (the vLLM executor's) or in chunks of
        its walks (medha's engine and the simulator's replay of it, which reads no clock); the
        rest follows with the next batches (Recalibration). Neither: a whole one at once."""
        self.block_tables = block_tables
        self.async_scheduling = async_scheduling
        # (async scheduling) the last batch formed, while it runs and before the next one forms
        self._running_ahead: Batch | None = None
        # The resolution of the config: the packer, the policy, the KV arbiter and the
        # simulator's metrics all read this object's defaults (resolve_config returns it
        # unchanged); only a learner's corrections resolve them again (`_apply`).
        self.config = config = resolve_config(given := config, predictor)
        self.predictor = predictor
        self.packer = make_packer(config, predictor)
        self.policy = replica_policy(config)
        self.max_model_len: int = config.max_model_len
        self.prefill_times = prefill_times or replica_prefill_times(config, predictor)
        self.policy.bind(predictor, blocks, self.max_model_len)
        self._max_batch_tokens = self.packer.max_batch_tokens(self.max_model_len)
        self.long_threshold: int = config.long_prefill_threshold
        self.stats = SchedulerStats()
        self.requests = RequestTable(self.prefill_times, self.stats)
        self.kv = KVArbiter(
            config,
            predictor,
            blocks,
            self.policy,
            self.prefill_times,
            self.requests.live,
            self.requests.swapped,
            self.stats,
        )
        self.requests.kv = self.kv
        self.policy.bind_prefix_cache(self.kv.peek_cached)
        self._next_batch_id = 0
        self._inflight = 0  # batches scheduled and not yet updated
        # microbatched pipeline (vLLM, Sarathi): a request runs in one batch at a time
        self._one_batch_each = config.pipeline == "microbatch"
        self.clock = StepClock(predictor)  # a step's time as the executor runs it (step_clock.py)
        # (pause_steps) the pausable batch in flight: batches beside it are formed meanwhile
        self.paused = PausedStep(self.clock, self.long_threshold)
        # which decodes join a batch (decode_picker.py)
        self.decode_picker = DecodePicker(
            self.requests, self.kv, self.policy, self.clock, async_scheduling
        )
        # an executor's: corrects `predictor` (a CorrectedPredictor) from the measured time of
        # each batch; the simulator has none, its predictor is the truth there and stays put
        self.learner = learner
        # what the caller set, and when the defaults it leaves unset follow the learner's
        # corrections (recalibration.py); None without a learner
        slices = {"slice_s": resolve_slice_s, "slice_steps": resolve_slice_steps}
        self.recalibration = Recalibration(given, predictor, learner, **slices) if learner else None
        self._step_log = StepLog.from_env()  # $MEDHA_STEP_LOG (step_log.py)

    @property
    def blocks(self) -> BlockManager:
        """The device KV blocks (the arbiter's; read them, never change them from outside)."""
        return self.kv.blocks

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request: Request, now: float | None = None) -> None:
        """Admit a request. Raises ValueError naming the field and changes nothing on bad input."""
        request.validate(self.max_model_len)
        if request.request_id in self.requests.live:
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
        deadline = self.config.ttft_allowed_s(request.ttft_deadline_s, work)
        self.requests.admit(request, deadline, work)

    def abort(self, request_id: str, now: float, reason: str = "abort") -> Request | None:
        """Stop a live request and release its KV (once no running batch still writes it).
        `reason` becomes its finish_reason: "abort" (the client's choice) or "error" (it
        failed on its own)."""
        return self.requests.abort(request_id, now, reason)

    def live_requests(self):
        """Every admitted request that has not finished or been aborted (a read-only view)."""
        return self.requests.live.values()

    def get(self, request_id: str) -> Request | None:
        return self.requests.get(request_id)

    @property
    def num_waiting(self) -> int:
        """Requests whose prefill has not started: new ones, and those preempted by recompute
        (their KV dropped, they start over)."""
        return self.requests.prefill_counts()[0]

    @property
    def num_prefilling(self) -> int:
        """Requests whose prefill has started (a chunk scheduled) and not finished."""
        return self.requests.prefill_counts()[1]

    def prefill_counts(self) -> tuple[int, int]:
        """(num_waiting, num_prefilling) of one instant (RequestTable.prefill_counts)."""
        return self.requests.prefill_counts()

    @property
    def num_decoding(self) -> int:
        return len(self.requests.decoding)

    @property
    def num_swapped(self) -> int:
        return len(self.requests.swapped)

    def has_unfinished(self) -> bool:
        return bool(self.requests.live)

    def wake_at(self) -> float | None:
        """When the policy lets go of prefills it held back at the last `schedule` (None: it
        holds none); an executor left idle calls `schedule` again then."""
        return self.policy.wake_at()

    def __len__(self) -> int:
        return len(self.requests)

    # ---- one iteration -----------------------------------------------------------------------
    def schedule(self, now: float) -> Batch | None:
        """Form the next batch: swap-ins, then room for a prefill the policy calls urgent (a
        class policy's), then decodes, then the packer's prefill chunks. Whom the KV arbiter
        preempts, swaps out or in along the way is recorded in the batch, and the request table
        moves each to its new queue at once, so every step sees the steps before it as they
        left the queues."""
        if self._running_ahead is not None:
            self.requests.count_placeholders(self._running_ahead)
            self._running_ahead = None
        batch = Batch(self._next_batch_id, now)
        self.decode_picker.shed_for_slo(batch, now)
        if self.requests.swapped:
            urgent = self.policy.urgent_prefill(self._schedulable_prefills(), now)
            order = self.policy.swap_in_order(list(self.requests.swapped.values()), urgent)
            self.requests.swap_in(self.kv.swap_in(order), batch)  # their decodes join the batch
        builder = self._fill(batch, now)
        if builder.is_empty and batch.preempted:
            # the only decodes picked (aligned picks a subset) preempted themselves for lack of
            # blocks: form the batch again in the room they left, rather than stall the caller
            builder = self._fill(batch, now)
        return self._issue(batch, builder, now)

    def schedule_beside(self, now: float) -> Batch | None:
        """(pause_steps) The batch to run now while a pausable one is paused between two of its
        layers, if anyone waits on steps (`waits_now`): the decodes ready and the short
        prefills, none of them in a batch in flight; None if nobody waits. The paused batch
        resumes after it (and after any more this returns)."""
        if not self.waits_now(now):
            return None
        batch = Batch(self._next_batch_id, now)
        beside_s = self.paused.beside_budget_s(self.config.iteration_budget_s)
        builder = self._builder(batch, now, self.config.max_num_seqs, beside_s=beside_s)
        self.decode_picker.add(builder)
        self._add_prefills(builder, now, longs=False)
        batch = self._issue(batch, builder, now)
        if batch is not None:
            self.paused.ran_beside(batch)
        return batch

    def _issue(self, batch: Batch, builder: BatchBuilder, now: float) -> Batch | None:
        """The formed batch with its KV copies, block tables and predicted time, counted as in
        flight; None if it holds nothing to run."""
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
            self.requests.begin_prefill(r, now)
            if chunk.start == r.num_cached_tokens and self.kv.prefix_caching:
                self.kv.count_start(r)  # the first chunk of a (re)started prefill
        if moves:
            self.kv.time_swaps(batch)
        batch.predicted_time_s = (
            builder.timer.time() + batch.swap_time_s + self.policy.kv_move_time_s()
        )
        self._inflight += 1
        self._next_batch_id += 1
        self.stats.batches += 1
        if self.async_scheduling:
            self._running_ahead = batch
        if batch.pausable:
            self.paused.began(batch)
        return batch

    def _fill(self, batch: Batch, now: float) -> BatchBuilder:
        if self.config.prefill_only_iterations:
            return self._prefills_alone(batch, now)
        # (pause_steps) a long prefill runs in steps of its own, which its company pauses
        longs = False if self.config.pause_steps else None
        if longs is False and not self.waits_now(now) and self._long_prefill_waits():
            # nobody waits on steps: the long prefills run alone, in a step that pauses for
            # whoever comes to wait (a short prompt, a decode whose token falls due)
            builder = self._builder(batch, now, self.config.max_num_seqs, pausable=True)
            self._add_prefills(builder, now, longs=True)
            if not builder.is_empty:
                batch.pausable = True
                return builder
            longs = None  # none fits alone: the usual batch, which may make room for one
        builder = self._builder(batch, now, self.config.max_num_seqs)
        urgent = self.policy.urgent_prefill(self._schedulable_prefills(), now)
        if urgent is not None:
            self.decode_picker.room_for(urgent, builder)
        self.decode_picker.add(builder)
        self._add_prefills(builder, now, longs=longs)
        return builder

    def waits_now(self, now: float) -> bool:
        """(pause_steps) Whether anyone waits on steps now (PausedStep.anyone_waits)."""
        prefilling = self.requests.prefilling.values()
        decodes = self.decode_picker.ready()
        return self.paused.anyone_waits(prefilling, decodes, self.config.iteration_budget_s, now)

    def _long_prefill_waits(self) -> bool:
        threshold = self.long_threshold
        return any(
            is_long(r, threshold) and r.num_scheduled < r.num_tokens
            for r in self.requests.prefilling.values()
            if not r.num_inflight_batches
        )

    def _builder(
        self,
        batch: Batch,
        now: float,
        max_seqs: int,
        pausable: bool = False,
        beside_s: float | None = None,
    ) -> BatchBuilder:
        return BatchBuilder(
            self.requests,
            self.kv,
            batch,
            self.predictor.timer(),
            now,
            max_seqs,
            self._max_batch_tokens,
            pausable,
            beside_s,
        )

    def _add_prefills(self, builder: BatchBuilder, now: float, longs: bool | None = None) -> None:
        """The packer's prefill chunks, from the requests the policy admits; `longs` True: long
        prefills only, False: short ones only (pause_steps), None: all."""
        batch = builder.batch
        requests = self.requests
        queue = self.policy.admit(
            list(requests.prefilling.values()), requests.live.__contains__, now
        )
        if longs is not None:
            threshold, left, paused = self.long_threshold, self.paused.left_s(now), self.paused
            if longs:
                queue = [r for r in queue if is_long(r, threshold) and not r.num_inflight_batches]
            else:  # whoever waits on steps, beside a paused step or between them
                queue = [r for r in queue if paused.waits_on_steps(r, now, left)]
        if self._inflight or batch.preempted:
            # Skip requests whose remaining chunks are all running (pipelined batches), and
            # those the arbiter recomputed for this batch so far (for its decodes, an urgent
            # prefill, or a first try at it): memory is short, they wait a turn. A microbatched
            # pipeline also skips requests with a chunk still in any stage.
            one_each = self._one_batch_each
            queue = [
                r
                for r in queue
                if r.num_scheduled < r.num_tokens
                and r not in batch.preempted
                and not (one_each and r.num_inflight_batches)
            ]
        if queue:
            order = functools.partial(prefill_order, self.policy, queue, now, self.long_threshold)
            candidates = _Candidates(queue, order, self, builder)
            self.packer.pack(now, candidates, builder)
            for r in candidates.attached:  # a cached prefix taken by a request left out
                requests.detach_cached(r)

    def _schedulable_prefills(self) -> Iterable[Request]:
        """The prefill-phase requests a chunk of this batch may come from: all of them in a
        stream pipeline (a prefill with chunks in flight takes its next one), those with no
        batch in flight in a microbatched one."""
        prefilling = self.requests.prefilling.values()
        if not (self._one_batch_each and self._inflight):
            return prefilling
        return [r for r in prefilling if not r.num_inflight_batches]

    def _prefills_alone(self, batch: Batch, now: float) -> BatchBuilder:
        """An iteration of prefills only, if any can run; else one of decodes. The prefills
        get the sequence slots the decodes leave, so running requests stay within
        max_num_seqs (vLLM's cap on its running batch)."""
        room = self.config.max_num_seqs - len(self.requests.decoding)
        builder = self._builder(batch, now, room)
        if room > 0:
            self._add_prefills(builder, now)
        if builder.is_empty:
            builder = self._builder(batch, now, self.config.max_num_seqs)
            self.decode_picker.add(builder)
        return builder

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
            self.requests.unschedule(chunk)
            return True
        self.requests.revise(chunk, start, start + num_tokens)
        chunk.start, chunk.num_tokens = start, num_tokens
        chunk.samples = chunk.end == r.num_tokens
        return chunk.end <= self.kv.tokens_held(r) or self.kv.hold(r, chunk.end)

    def drop_kv(self, batch: Batch, request_id: str) -> None:
        """The executor dropped a request's KV on its own (vLLM preempts when it cannot place
        a chunk): it recomputes, as if this scheduler had preempted it for `batch`."""
        r = self.requests.get(request_id)
        if r is None or r.state not in (RequestState.PREFILLING, RequestState.DECODING):
            return
        if r.num_inflight_batches:
            raise ValueError(f"{request_id} runs in a batch: its KV cannot be dropped now")
        self.requests.evict((self.kv.preempt(r, swap=False),), batch)

    # ---- results -----------------------------------------------------------------------------
    def update(self, batch: Batch, result: BatchResult, now: float) -> list[Request]:
        """Apply a finished batch: advance KV, append sampled tokens, retire finished requests."""
        self._inflight -= 1
        if batch is self._running_ahead:  # it returned before the next batch formed
            self._running_ahead = None
        self.paused.ended(batch)
        predicted, measured = batch.predicted_time_s, result.duration_s
        if self._step_log is not None and batch.chunks:
            self._step_log.write(batch, measured, now, self.predictor, self.config)
        if predicted > 0 and 0 < measured < math.inf:
            self.clock.observe(predicted, measured)
            if self.learner is not None:
                self._learn(batch, measured)
        return self.requests.complete(batch, result, now)

    def _learn(self, batch: Batch, measured_s: float) -> None:
        """Correct the predictor from one batch's measured time (its shape as it ran: the
        vLLM executor revises a batch's chunks to what vLLM ran before `update`). A batch that
        copied KV is left out: the copies' time is not the model's. When the correction moves
        the model, the prefill-time walk and the predicted work of the requests in prefill
        follow it."""
        if batch.swap_in or batch.swap_out or batch.cache_in or batch.cache_out:
            return
        learner = self.learner
        prefills, decodes = batch.shape()
        moved = learner.observe(prefills, decodes, measured_s) and learner.moved()
        if moved:
            self.prefill_times.reset()
        self.recalibration.saw(len(prefills), len(decodes))
        config, reprice = self.recalibration.follow(self.config, moved)
        if config is not None:
            self._apply(config)
        if reprice:
            self.requests.reprice()

    def probe(self, measure: Callable[[list, list], float | None]) -> tuple[int, int]:
        """The start-up probe, before any request (medha's engine with no profile; the
        simulator's replay of it): the learner's probe shapes within this replica's context
        and KV cache, each timed by `measure(prefills, decodes)` (None: skipped), shown to
        the learner; then, whatever `measure` raises, the tables derived from the model and
        the defaults the config leaves unset follow the corrected model. (timed, skipped)."""
        try:
            context = min(self.max_model_len, self.blocks.capacity_tokens)
            return self.recalibration.probe(measure, context)
        finally:
            self.prefill_times.reset()
            config = self.recalibration.resolve_again(self.config)  # (at once: before serving)
            if config is not None:
                self._apply(config)
            self.requests.reprice()

    def _apply(self, config: SchedulerConfig) -> None:
        """Plan with defaults resolved again from the corrected model, so that the packer and
        the policy plan with what the engine's steps cost now (issue 48, item 2). The deadlines
        given so far stay; the caller prices the requests' work again."""
        self.config = config
        self.packer = make_packer(config, self.predictor)
        self.policy.follow(config)
        self.prefill_times.plan_with(self.packer.plan_isolated)

    def discard(self, batch: Batch, now: float) -> list[Request]:
        """A batch that never completed (the executor failed): abort its requests and release
        their KV, since what it would have written is unknown."""
        self._inflight -= 1
        if batch is self._running_ahead:
            self._running_ahead = None
        self.paused.ended(batch)
        return self.requests.discard(batch, now)

    # ---- checks ------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every live request is in the queue of its state with consistent progress, and the
        arbiter's accounting is exact (see KVArbiter.check_invariants).

        Raises SchedulerInvariantError (or BlockAccountingError); tests call it after every batch.
        """
        self.requests.check_invariants()
        self.kv.check_invariants(self.requests.aborted_inflight)

    def predicted_isolated_prefill_s(self, num_tokens: int) -> float:
        return self.prefill_times.time(num_tokens)


class _Candidates(Collection):
    """The prefill-phase requests in the order the packer takes them. Iterating looks each one
    up in the prefix cache (at the start of its prefill) just before the packer sizes its
    chunk, so the chunk starts after a hit, and ends once the packer calls the batch full.

    The order is made when the packer first iterates: a packer that finds no room for any
    chunk (the decodes took the step's budget) never orders the queue. LARS orders 150
    waiting prefills in 0.1-0.2 ms on a 2-core Xeon, against a goal of 1 ms for medha's
    whole part of a vLLM step (issue 69); with 256 requests sent at once, where the budget
    holds about 100 decodes, a third of the steps or more have no room for any chunk."""

    def __init__(
        self,
        queue: list[Request],
        order: Callable[[], list[Request]],
        sched: ReplicaScheduler,
        builder: BatchBuilder,
    ):
        self._queue = queue
        self.order = order  # (the order the packer takes them, made without look-ups)
        self._packer: Packer = sched.packer
        self._builder = builder
        self._requests = sched.requests
        self._kv = sched.kv if sched.kv.prefix_caching else None
        self.attached: list[Request] = []  # requests given a cached prefix

    def __len__(self) -> int:
        return len(self._queue)

    def __contains__(self, r: object) -> bool:
        return r in self._queue

    @property
    def requests(self) -> list[Request]:
        """The queue as it stands, unordered, read without looking anyone up (the packer's
        budget reads who waits on the step before it takes the first)."""
        return self._queue

    def __iter__(self) -> Iterator[Request]:
        full, builder, kv = self._packer.is_full, self._builder, self._kv
        if full(builder):
            return
        for r in self.order():
            if full(builder):
                return
            if kv is not None and not r.num_scheduled:
                found = kv.attach_cached(r)
                if found is not None:
                    self._requests.attach_cached(r, *found)
                    if r.num_cached_tokens:
                        self.attached.append(r)
            yield r
