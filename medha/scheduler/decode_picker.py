"""The decode side of a replica scheduler's batch: which decoding requests join it.

A `DecodePicker` answers for the scheduler (replica_scheduler.py) which decodes are ready
(no batch in flight, or under async scheduling a token to feed), which join the batch being
formed when KV runs short (the oldest keep their place; the KV arbiter preempts the rest), the
room an urgent prefill takes from them, and whom a class policy sheds to keep more urgent
decodes within their TPOT targets. It holds no state of its own: the request table writes what
it decides, the arbiter grants the KV.
"""

from __future__ import annotations

from medha.core.batch import Batch
from medha.core.request import Request, RequestState
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.kv_arbiter import KVArbiter
from medha.scheduler.policies.base_policy import Policy
from medha.scheduler.request_table import RequestTable
from medha.scheduler.step_clock import StepClock


class DecodePicker:
    def __init__(
        self,
        requests: RequestTable,
        kv: KVArbiter,
        policy,
        clock: StepClock,
        async_scheduling: bool,
    ) -> None:
        self.requests = requests
        self.kv = kv
        self.policy = policy  # the replica's policy (its config follows the scheduler's)
        self.clock = clock
        self.async_scheduling = async_scheduling

    def ready(self) -> list[Request]:
        """The decoding requests whose next token may join the batch being formed: those with
        no batch in flight; under async scheduling, every one whose context has a token not
        yet fed (its last token is a placeholder, or known) and whose answer has room for
        one more (a token past max_tokens would be thrown away, as vLLM's AsyncScheduler
        knows)."""
        decoding = self.requests.decoding.values()
        if not self.async_scheduling:
            return [r for r in decoding if r.num_inflight_batches == 0]
        return [  # (num_tokens spelled out: this runs over every decode of every step)
            r
            for r in decoding
            if (answer := r.num_output_tokens + r.num_placeholders) < r.max_tokens
            and r.num_scheduled < r.prompt_len + answer
        ]

    def add(self, builder: BatchBuilder) -> None:
        """The ready decodes the policy selects, into `builder`'s batch as far as KV and its
        sequence slots allow."""
        now = builder.now
        decodes = self.ready()
        if not decodes:
            return
        decodes = self.policy.select_decodes(decodes, now)
        blocks = self.kv.blocks
        short = blocks.at_capacity(decodes)  # their next token needs a new block
        if blocks.can_grow_each(len(short)) and len(decodes) <= builder.room_seqs:
            for r in short:
                builder.reserve(r, r.num_scheduled + 1)
            builder.add_decodes(decodes)
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
            if self.kv.tokens_held(r) > r.num_scheduled:  # its next token's block is there
                chosen.append(r)
            elif builder.reserve(r, r.num_scheduled + 1) > r.num_scheduled:
                chosen.append(r)
            elif not r.num_inflight_batches:
                builder.preempt(r)  # nobody below it to evict: it gives way
            # (else, async scheduling: its batch in flight still writes its KV; it sits this
            # batch out, and gives way at the next if it must)
        builder.add_decodes(chosen)

    def room_for(self, r: Request, builder: BatchBuilder) -> None:
        """An urgent prefill may preempt running decodes (and prefills) ranked below it. The
        decodes join the batch before any prefill and a batch member cannot be evicted, so the
        room is made first: enough for the prefill's whole context, plus a block for each
        decode that needs one."""
        if not self.kv.may_start(r):
            return
        growing = self.kv.blocks.at_capacity(self.ready())
        builder.make_room(r, len(growing))

    def shed_for_slo(self, batch: Batch, now: float) -> None:
        """Preempt the running decodes the policy sheds so that more urgent ones keep their
        TPOT targets (a class policy's SLO-risk preemption). Asked before the swap-ins, which
        its verdict limits, and even without decodes, so that no verdict outlives them. A
        policy that never sheds (the base's rule) is not asked: the list of ready decodes
        would cost a pass over every decode of every step."""
        if type(self.policy).slo_risk_victims is Policy.slo_risk_victims:
            return
        ready = [r for r in self.requests.decoding.values() if r.num_inflight_batches == 0]
        victims = self.policy.slo_risk_victims(
            ready, self.requests.swapped.values(), self.clock.decode_step_time, now
        )
        if victims:
            self.requests.evict([self.kv.preempt(r) for r in victims], batch)
