"""`MedhaScheduler`: vLLM's scheduler class, with medha deciding what each step runs.

Each vLLM request has a mirror `medha.core.request.Request` in a `ReplicaScheduler` whose KV
blocks mirror vLLM's (same count, same block size). A step:

1. medha's scheduler forms its batch at `now`: which decodes run, which prefill chunks of how
   many tokens (the policy, the packer's time budget, multi-prefill, one long prefill per
   batch), and whom to preempt when KV runs short;
2. the preempted requests are preempted in vLLM too, the batch's requests are put first in
   vLLM's running queue, its waiting queue holds only the batch's waiting requests while it
   schedules, and vLLM's own `Scheduler.schedule()` runs with each request capped at the
   tokens medha planned for it (0 for the others), through the one hook every request passes
   (`_reserve_prefill_lookahead`). vLLM allocates the KV blocks, looks up its prefix cache and
   builds the `SchedulerOutput` as always;
3. where vLLM ran something else (a prefix-cache hit starts a prompt later; a request it
   could not place), medha's batch is revised to what actually runs (`ReplicaScheduler.revise`);
   the count of such revisions is kept (`plan_revisions`);
4. `update_from_output` lets vLLM apply the sampled tokens and stops, then reports the batch
   to medha's scheduler with the requests vLLM stopped.

Async scheduling (vLLM's default on a GPU): `--scheduler-cls medha.vllm_executor.MedhaScheduler`
builds `MedhaAsyncScheduler`, the same class on vLLM's `AsyncScheduler`, when vLLM's config
has async scheduling on. The engine core then calls `schedule()` for step N+1 while step N
runs, and `update_from_output()` for N after it: medha's `ReplicaScheduler` (built with
`async_scheduling`) counts the token N samples for each request as a placeholder of its
context, as vLLM's output placeholders do, so its next decode joins N+1 (medha's part of the
step overlaps the forward pass instead of following it).

Not supported (refused at start, with the reason): speculative decoding, KV connectors,
pipeline parallelism, swap preemption.
"""

from __future__ import annotations

import collections
import logging
import math
import time
from collections.abc import Iterable

from vllm.v1.core.sched.async_scheduler import AsyncScheduler
from vllm.v1.core.sched.request_queue import RequestQueue, create_request_queue
from vllm.v1.core.sched.scheduler import Scheduler
from vllm.v1.request import RequestStatus

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.perf.profile_data import IterationRow
from medha.scheduler.replica_scheduler import ReplicaScheduler
from medha.vllm_executor.contract import contract_problems
from medha.vllm_executor.settings import build_replica_scheduler

logger = logging.getLogger(__name__)


class MedhaScheduler(Scheduler):
    def __new__(cls, vllm_config, *args, **kwargs):
        """`--scheduler-cls` names one class: this one, which is the async variant when vLLM's
        config has async scheduling on (a GPU's default), so a user passes nothing else."""
        if cls is MedhaScheduler and vllm_config.scheduler_config.async_scheduling:
            cls = MedhaAsyncScheduler
        return super().__new__(cls)

    def __init__(self, vllm_config, kv_cache_config, structured_output_manager, *args, **kwargs):
        _refuse_unsupported(vllm_config)
        super().__init__(vllm_config, kv_cache_config, structured_output_manager, *args, **kwargs)
        problems = contract_problems(Scheduler, self)
        if problems:
            raise RuntimeError("vLLM's scheduler contract changed: " + "; ".join(problems))
        # vLLM must not cut medha's chunks: medha sizes them (and vLLM's own long-prefill cap
        # would otherwise shorten a long prompt's chunk below what the packer timed)
        self.scheduler_config.long_prefill_token_threshold = 0
        self.medha: ReplicaScheduler = build_replica_scheduler(
            vllm_config,
            kv_cache_config,
            self.max_num_scheduled_tokens,
            async_scheduling=isinstance(self, AsyncScheduler),
        )
        self.clock = time.monotonic
        self.plan_revisions = 0  # chunks vLLM ran differently from medha's plan
        self._plan: dict[str, int] | None = None  # request id -> tokens, during schedule()
        self._inflight: collections.deque = collections.deque()  # (output, Batch, started at)
        self._last_update_s = -math.inf  # when the last update_from_output ended
        # (async scheduling) requests vLLM preempted while medha's batch before still ran them:
        # their KV is dropped in medha's mirror once that batch is back
        self._drop_when_back: set[str] = set()
        # where a profiler asks (it sets a list), the shape and measured time of each step: the
        # whole engine-core step, from the start of `schedule` to the end of
        # `update_from_output` (scheduling, the forward pass, sampling and the outputs'
        # bookkeeping), the cycle a request waits through between two tokens. A server records
        # none: a row holds every decode's KV length (about 9 KB at 256 decodes), and rows a
        # long-running server kept would only grow and lengthen Python's garbage collections
        self.steps: list[IterationRow] | None = None

    # ---- requests ----------------------------------------------------------------------------
    def add_request(self, request) -> None:
        super().add_request(request)
        now = self.clock()
        try:
            mirror = _mirror(request, now, self.max_model_len, self.medha.blocks.capacity_tokens)
            self.medha.add_request(mirror, now)
        except ValueError as e:
            # one request medha cannot take must not fail the engine core (and every other
            # request with it): medha never plans it, so vLLM never runs it, and it ends
            logger.error("request %s refused by medha's scheduler: %s", request.request_id, e)
            self._fail_at_next_step(request.request_id, f"medha's scheduler refused it: {e}")

    def _fail_at_next_step(self, request_id: str, reason: str) -> None:
        """End a request with an error at vLLM's next step. vLLM's scheduler has one way to
        fail a request from inside `add_request`: the requests whose structured-output grammar
        failed to compile, which its next `update_from_output()` finishes with FINISHED_ERROR
        (the client sees an error, the engine core goes on). The request has no grammar: the
        collection is only the way in (contract.py checks it still exists). vLLM 0.32 keeps a
        set of ids; 0.33 maps each id to the error its client is given, which names `reason`."""
        errors = self.grammar_compile_error_reqs
        if isinstance(errors, dict):
            from vllm.outputs import RequestError  # (vLLM 0.33 on)

            errors[request_id] = RequestError(code="validation_error", message=reason)
        else:
            errors.add(request_id)

    def finish_requests(self, request_ids: str | Iterable[str] | None, finished_status):
        finished = super().finish_requests(request_ids, finished_status)
        now = self.clock()
        reason = "error" if finished_status == RequestStatus.FINISHED_ERROR else "abort"
        for r in finished:
            self.medha.abort(r.request_id, now, reason)
        return finished

    # ---- one step ----------------------------------------------------------------------------
    def schedule(self, throttle_prefills: bool = False):
        now = self.clock()
        batch = self.medha.schedule(now)
        plan: dict[str, int] = {}
        if batch is not None:
            for r in batch.preempted:  # medha dropped their KV: so does vLLM
                vreq = self.requests.get(r.request_id)
                if vreq is not None and vreq.status == RequestStatus.RUNNING:
                    self.running.remove(vreq)
                    self._preempt_request(vreq, now)
            for chunk in batch.chunks:
                plan[chunk.request.request_id] = chunk.num_tokens
            self._put_first(plan)
        held, self.waiting = self.waiting, self._planned_waiting(batch, plan)
        self._plan = plan
        try:
            output = super().schedule(throttle_prefills)
        finally:
            self._plan = None
            # what vLLM left waiting (planned requests it could not place, requests it
            # preempted), ahead of those held back, in its order
            left, self.waiting = self.waiting, held
            if left:
                held.prepend_requests(reversed(list(left)))
        if batch is not None:
            self._reconcile(batch, plan, output)
            self._inflight.append((output, batch, now))
        return output

    def _reserve_prefill_lookahead(self, request, num_computed_tokens, num_new_tokens) -> int:
        """vLLM's last word on each request's tokens in both of its loops: capped at medha's."""
        n = super()._reserve_prefill_lookahead(request, num_computed_tokens, num_new_tokens)
        if self._plan is None:
            return n
        return min(n, self._plan.get(request.request_id, 0))

    def _put_first(self, plan: dict[str, int]) -> None:
        """The batch's running requests first in vLLM's running queue, in medha's order: vLLM
        spends its token budget in queue order. (Called every step with up to max_num_seqs
        planned requests: linear in the queue.) The queue is most often in that order already,
        from the step before (a steady batch of decodes): then it is left as it is."""
        head = self.running[: len(plan)]
        if len(head) == len(plan) and all(r.request_id == rid for r, rid in zip(head, plan)):
            return
        rank = {rid: i for i, rid in enumerate(plan)}
        last = len(rank)
        self.running.sort(key=lambda r: rank.get(r.request_id, last))

    def _planned_waiting(self, batch: Batch | None, plan: dict[str, int]) -> RequestQueue:
        """The batch's requests that wait in vLLM's waiting queue, taken out of it into a queue
        of their own, in medha's order: the waiting queue vLLM's `schedule()` sees. vLLM looks
        each waiting request up in its prefix cache before asking how many tokens it may run
        (the cap, 0 for the requests medha holds back); 0.32 then stops at the first one
        capped at 0, 0.33 skips it and goes on, so every request held back would be looked up,
        and counted in vLLM's prefix-cache stats, every step."""
        queue = create_request_queue(self.policy)
        # only a prefill can be waiting in vLLM (a decode's prompt ran, in vLLM too): with none
        # waiting (the steady state of decodes) the waiting queue is not walked
        requests, running = self.requests, RequestStatus.RUNNING
        if batch is None or not any(
            (vreq := requests.get(c.request.request_id)) is not None and vreq.status != running
            for c in batch.prefills
        ):
            return queue
        first = [vreq for vreq in self.waiting if vreq.request_id in plan]
        if first:
            rank = {rid: i for i, rid in enumerate(plan)}
            first.sort(key=lambda r: rank[r.request_id])
            self.waiting.remove_requests(first)
            for vreq in first:
                queue.add_request(vreq)
        return queue

    def _reconcile(self, batch: Batch, plan: dict[str, int], output) -> None:
        """Make medha's batch what vLLM runs (see the module's docstring, step 3)."""
        ran = output.num_scheduled_tokens
        # vLLM ran every chunk's token count (the common step): only a prefill can still have
        # started elsewhere (a prefix-cache hit); else look at every chunk
        chunks = batch.prefills if ran == plan else batch.chunks
        for chunk in list(chunks):
            rid = chunk.request.request_id
            n = ran.get(rid, 0)
            vreq = self.requests.get(rid)
            end = vreq.num_computed_tokens if vreq is not None and n else chunk.start + n
            if n == chunk.num_tokens and end == chunk.end:
                continue
            self.plan_revisions += 1
            logger.debug(
                "vLLM ran %s[%d:%d], planned [%d:%d]", rid, end - n, end, chunk.start, chunk.end
            )
            if not self.medha.revise(batch, chunk, end - n, n):
                logger.warning(
                    "medha's KV mirror is short of the blocks vLLM placed for %s: it counts "
                    "shared prefix blocks once per request; medha will preempt more than needed",
                    rid,
                )
        # vLLM preempts on its own when it cannot place a chunk (the mirror counted blocks it
        # did not have): those recompute in medha too
        ours = {r.request_id for r in batch.preempted}
        for rid in output.preempted_req_ids or ():
            if rid not in ours:
                self.plan_revisions += 1
                r = self.medha.get(rid)
                if r is not None and r.num_inflight_batches:
                    # (async scheduling) the batch before this one still samples its token,
                    # which vLLM delivers: medha drops its KV once it has counted that token
                    self._drop_when_back.add(rid)
                else:
                    self.medha.drop_kv(batch, rid)
        if ran != plan and (unplanned := set(ran) - set(plan)):
            # the hook caps every request; this would be a changed vLLM
            raise RuntimeError(f"vLLM scheduled requests medha did not plan: {sorted(unplanned)}")

    def update_from_output(self, scheduler_output, model_runner_output):
        outputs = super().update_from_output(scheduler_output, model_runner_output)
        if not self._inflight or self._inflight[0][0] is not scheduler_output:
            return outputs  # a step medha planned nothing for
        _, batch, scheduled = self._inflight.popleft()
        # the step's own time: from its schedule() or, when the step before was still running
        # then (async scheduling), from that one's end, to now
        ended = self.clock()
        ran_s = ended - max(scheduled, self._last_update_s)
        if batch.chunks and self.steps is not None:
            prefills, decodes = batch.shape()
            self.steps.append(IterationRow(1, prefills, decodes, ran_s))
        stopped = frozenset(
            o.request_id
            for client in outputs.values()
            for o in client.outputs
            if o.finish_reason is not None
        )
        self.medha.update(batch, BatchResult(ran_s, None, stopped), self.clock())
        for rid in list(self._drop_when_back):
            r = self.medha.get(rid)
            if r is None or not r.num_inflight_batches:
                self._drop_when_back.discard(rid)
                if r is not None:
                    self.medha.drop_kv(batch, rid)
        self._last_update_s = self.clock()
        return outputs


class MedhaAsyncScheduler(MedhaScheduler, AsyncScheduler):
    """`MedhaScheduler` on vLLM's `AsyncScheduler` (chosen by `MedhaScheduler` itself when
    vLLM's async scheduling is on): vLLM counts each in-flight token as an output placeholder
    and medha's mirror counts it the same (the module's docstring)."""


# a client's key in vLLM's extra_args (medha serve's API names, prefixed) -> the Request field
TARGETS = {
    "medha_priority": "priority_class",
    "medha_ttft_slo_s": "ttft_deadline_s",
    "medha_tpot_slo_s": "tpot_target_s",
}


def _mirror(request, now: float, max_model_len: int, capacity_tokens: int) -> Request:
    """medha's copy of a vLLM request: its lengths, and the targets a client may send in the
    request's `extra_args` (`vllm_xargs` in vLLM's API): medha_priority, medha_ttft_slo_s,
    medha_tpot_slo_s. An invalid one is left out (the server-wide defaults apply), with a
    warning: a client's bad value must not fail the engine core.

    vLLM accepts a max_tokens past the context and stops the request at max_model_len (or its
    KV room): the mirror's max_tokens is what vLLM can produce, which medha's scheduler (and its
    KV accounting) takes."""
    extra = getattr(request.sampling_params, "extra_args", None)
    targets = {}
    for key, name in TARGETS.items():
        if not isinstance(extra, dict) or extra.get(key) is None:
            continue
        try:
            Request("check", now, 1, 1, **{name: extra[key]})
        except (ValueError, TypeError) as e:
            logger.warning("request %s: %s ignored: %s", request.request_id, key, e)
            continue
        targets[name] = extra[key]
    prompt = request.num_prompt_tokens
    room = min(max_model_len, capacity_tokens) - prompt
    return Request(
        request.request_id, now, prompt, max(1, min(request.max_tokens, room)), **targets
    )


def _refuse_unsupported(vllm_config) -> None:
    reasons = []
    if vllm_config.speculative_config is not None:
        reasons.append("speculative decoding")
    if vllm_config.kv_transfer_config is not None:
        reasons.append("KV connectors (--kv-transfer-config)")
    if vllm_config.parallel_config.pipeline_parallel_size > 1:
        reasons.append("pipeline parallelism (use medha's own engine for SPP)")
    if getattr(vllm_config.scheduler_config, "prefill_schedule_interval", 1) > 1:
        # (vLLM 0.33 applies it on one engine too: it would hold back the prefills medha
        # planned, every step but one in N)
        reasons.append("a prefill cadence (--prefill-schedule-interval): medha picks the steps")
    if reasons:
        raise ValueError("medha's scheduler on vLLM does not support " + ", ".join(reasons))
