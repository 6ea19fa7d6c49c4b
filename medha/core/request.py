"""A request and its life cycle.

A request's context is its prompt followed by the tokens generated so far. The scheduler moves
through that context in chunks: `num_computed` tokens have their KV in the cache, `num_scheduled`
counts those plus the ones in batches still running. A chunk that reaches the end of the context
samples one new token, so a decode is simply a one-token chunk that reaches the end. Under
async scheduling (vLLM's: the next step is planned while one runs) the context also counts
`num_placeholders`, the tokens sampled by batches still running: their values are not known
yet, but the next step may already feed them.
Preemption by recompute drops the KV and starts over on the whole context (prompt + outputs);
preemption by swap moves the KV to a host-memory pool and back, keeping the progress.

The fields below the constructor's are the request's state and progress. Only the scheduler's
request table (medha/scheduler/request_table.py) writes them, through its named operations;
everyone else reads.

A request may carry a priority class (REALTIME > HIGH > NORMAL > LOW; none is NORMAL), which
the `priority` policy orders by.
"""

from __future__ import annotations

import enum
import math
from dataclasses import dataclass, field

from medha.core.config import iteration_budget


def mean_due_s(first_token_s: float, tokens: int, tpot_target_s: float, spp: int = 1) -> float:
    """When the token after the first `tokens` of an answer falls due by a TPOT target kept as
    a mean over the answer: the first token plus that many targets, scaled for pipelining as
    the iteration budget is (Request.own_due_s; the router's model of a replica counts the
    tokens it has seen)."""
    return first_token_s + tokens * iteration_budget(tpot_target_s, spp)


PREFIX_HASH_BLOCK = 512  # tokens per prefix hash id in a trace (the Mooncake format's block)
PRIORITY_CLASSES = ("REALTIME", "HIGH", "NORMAL", "LOW")  # most urgent first
DEFAULT_PRIORITY_CLASS = "NORMAL"
_PRIORITY_RANK = {name: i for i, name in enumerate(PRIORITY_CLASSES)}
DEFAULT_PRIORITY_RANK = _PRIORITY_RANK[DEFAULT_PRIORITY_CLASS]


class RequestState(enum.Enum):
    WAITING = "waiting"  # admitted, nothing computed yet
    PREFILLING = "prefilling"  # some prompt (or recompute) chunks done
    DECODING = "decoding"  # KV complete, one token per iteration
    PREEMPTED = "preempted"  # KV dropped under memory pressure; waits to recompute
    SWAPPED = "swapped"  # KV moved to host memory; waits for device blocks to come back
    FINISHED = "finished"
    ABORTED = "aborted"

    @property
    def is_done(self) -> bool:
        return self in (RequestState.FINISHED, RequestState.ABORTED)


_ALLOWED = {
    RequestState.WAITING: {RequestState.PREFILLING, RequestState.ABORTED},
    RequestState.PREFILLING: {
        RequestState.DECODING,
        RequestState.FINISHED,  # a one-token completion ends with its first token
        RequestState.PREEMPTED,
        RequestState.SWAPPED,
        RequestState.ABORTED,
    },
    RequestState.DECODING: {
        RequestState.FINISHED,
        RequestState.PREEMPTED,
        RequestState.SWAPPED,
        RequestState.ABORTED,
    },
    RequestState.PREEMPTED: {RequestState.PREFILLING, RequestState.ABORTED},
    # back to the phase it was swapped out of
    RequestState.SWAPPED: {RequestState.PREFILLING, RequestState.DECODING, RequestState.ABORTED},
    RequestState.FINISHED: set(),
    RequestState.ABORTED: set(),
}


class InvalidTransition(RuntimeError):
    pass


def _positive_finite(value: float | None, name: str) -> None:
    if value is None:
        return
    if not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be a positive number of seconds, got {value!r}")


@dataclass(eq=False, slots=True)
class Request:
    """One generation request.

    `ttft_deadline_s` is relative to arrival; None lets the scheduler apply its default
    (max(1.5 x predicted isolated prefill time, 0.5 s), configurable). `priority_class` is one of
    PRIORITY_CLASSES (any case; None counts as NORMAL); the `priority` policy orders by it and
    evicts lower classes first, the other policies ignore it.
    """

    request_id: str
    arrival_s: float
    prompt_len: int
    max_tokens: int
    prompt_token_ids: list[int] | None = None
    ttft_deadline_s: float | None = None
    tpot_target_s: float | None = None
    priority_class: str | None = None
    # The trace's prefix block hashes (Mooncake format): one id per `PREFIX_HASH_BLOCK` prompt
    # tokens, the last block partial, an id standing for its block and every token before it.
    # What the prefix cache identifies blocks by when the request carries no token ids.
    prefix_hash_ids: list[int] | None = None

    state: RequestState = field(default=RequestState.WAITING, init=False)
    num_computed: int = field(default=0, init=False)
    num_scheduled: int = field(default=0, init=False)
    num_inflight_batches: int = field(default=0, init=False)
    output_token_ids: list[int] = field(default_factory=list, init=False)
    num_output_tokens: int = field(default=0, init=False)
    # tokens sampled by batches in flight, not yet returned, that the context already counts
    # (async scheduling only: see the module's docstring); always 0 otherwise
    num_placeholders: int = field(default=0, init=False)
    token_times_s: list[float] = field(default_factory=list, init=False)
    finish_s: float | None = field(default=None, init=False)
    finish_reason: str | None = field(default=None, init=False)
    num_preemptions: int = field(default=0, init=False)  # recomputes and swaps
    num_swaps: int = field(default=0, init=False)  # preemptions that swapped the KV out
    first_scheduled_s: float | None = field(default=None, init=False)
    admission_seq: int = field(default=-1, init=False)  # order of admission, breaks ties
    # Prompt tokens whose KV the prefix cache supplied at the latest start (device and host
    # tier; num_host_cached_tokens of them were copied back from the host tier for it). The
    # request's chunks begin after them: it has started once it schedules more (`started`).
    num_cached_tokens: int = field(default=0, init=False)
    num_host_cached_tokens: int = field(default=0, init=False)
    page_keys: list | None = field(default=None, init=False)  # prefix_cache.prompt_page_keys
    # Set by the scheduler's request table from its prefill-time cache; policies read them.
    deadline_s: float = field(default=math.inf, init=False)  # absolute TTFT deadline
    total_work_s: float = field(default=0.0, init=False)
    remaining_work_s: float = field(default=0.0, init=False)

    @classmethod
    def from_tokens(
        cls,
        request_id: str,
        arrival_s: float,
        prompt_token_ids: list[int],
        max_tokens: int,
        **kwargs,
    ) -> Request:
        return cls(
            request_id,
            arrival_s,
            len(prompt_token_ids),
            max_tokens,
            prompt_token_ids=list(prompt_token_ids),
            **kwargs,
        )

    def __post_init__(self) -> None:
        if isinstance(self.priority_class, str):
            self.priority_class = self.priority_class.upper()
        self.validate()

    def validate(self, max_model_len: int | None = None) -> None:
        """Raise ValueError naming the offending field."""
        if not isinstance(self.request_id, str) or not self.request_id:
            raise ValueError(f"request_id must be a non-empty string, got {self.request_id!r}")
        if not isinstance(self.arrival_s, (int, float)) or not math.isfinite(self.arrival_s):
            raise ValueError(f"arrival_s must be a finite number, got {self.arrival_s!r}")
        if not isinstance(self.prompt_len, int) or self.prompt_len <= 0:
            raise ValueError(f"prompt must not be empty (prompt_len={self.prompt_len!r})")
        if self.prompt_token_ids is not None and len(self.prompt_token_ids) != self.prompt_len:
            raise ValueError(
                f"prompt_len ({self.prompt_len}) does not match len(prompt_token_ids) "
                f"({len(self.prompt_token_ids)})"
            )
        if not isinstance(self.max_tokens, int) or self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be a positive integer, got {self.max_tokens!r}")
        _positive_finite(self.ttft_deadline_s, "ttft_deadline_s")
        _positive_finite(self.tpot_target_s, "tpot_target_s")
        if self.priority_class is not None and self.priority_class not in _PRIORITY_RANK:
            raise ValueError(
                f"priority_class must be one of {', '.join(PRIORITY_CLASSES)} "
                f"(or None), got {self.priority_class!r}"
            )
        ids = self.prefix_hash_ids
        if ids is not None and (
            not isinstance(ids, list)
            or len(ids) != -(-self.prompt_len // PREFIX_HASH_BLOCK)
            or not all(isinstance(i, int) and not isinstance(i, bool) for i in ids)
        ):
            raise ValueError(
                f"prefix_hash_ids must be a list of ceil(prompt_len / {PREFIX_HASH_BLOCK}) = "
                f"{-(-self.prompt_len // PREFIX_HASH_BLOCK)} integers"
            )
        if max_model_len is not None:
            if self.prompt_len > max_model_len:
                raise ValueError(
                    f"prompt_len {self.prompt_len} exceeds the model context "
                    f"(max_model_len={max_model_len})"
                )
            if self.prompt_len + self.max_tokens > max_model_len:
                raise ValueError(
                    f"prompt_len + max_tokens = {self.prompt_len + self.max_tokens} "
                    f"exceeds the model context (max_model_len={max_model_len})"
                )

    # ---- context -------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        """Length of the context: prompt plus generated tokens (and, under async scheduling,
        the placeholders of tokens still being sampled)."""
        return self.prompt_len + self.num_output_tokens + self.num_placeholders

    def context_token_ids(self, start: int, end: int) -> list[int]:
        """Token ids of context positions [start, end): prompt, then generated tokens. Costs
        O(end - start), whatever the prompt's length (a decode reads one token)."""
        prompt, n = self.prompt_token_ids, self.prompt_len
        if prompt is None:
            raise ValueError(f"request {self.request_id} carries no token ids")
        if end <= n:
            return prompt[start:end]
        out = self.output_token_ids[max(0, start - n) : end - n]
        return prompt[start:] + out if start < n else out

    @property
    def num_unscheduled(self) -> int:
        return self.num_tokens - self.num_scheduled

    @property
    def num_uncached_tokens(self) -> int:
        """Context tokens the prefix cache does not supply: the prefill work left to plan (a
        prompt mostly served from the cache is not a long one)."""
        return self.num_tokens - self.num_cached_tokens

    @property
    def started(self) -> bool:
        """Whether a chunk of its (re)started prefill has been scheduled: tokens the prefix
        cache supplied do not count."""
        return self.num_scheduled > self.num_cached_tokens

    @property
    def told(self) -> bool:
        """Whether it carries a target of its own: a TTFT deadline or a TPOT target (the API's
        ttft_slo_s, tpot_slo_s), which the replica's steps are sized for
        (replica_rules.told_due_s)."""
        return self.ttft_deadline_s is not None or self.tpot_target_s is not None

    @property
    def in_prefill(self) -> bool:
        return self.state in (RequestState.WAITING, RequestState.PREFILLING, RequestState.PREEMPTED)

    @property
    def priority_rank(self) -> int:
        """0 (REALTIME) to 3 (LOW): lower is more urgent."""
        return _PRIORITY_RANK[self.priority_class or DEFAULT_PRIORITY_CLASS]

    # ---- time ----------------------------------------------------------------------------
    @property
    def first_token_s(self) -> float | None:
        return self.token_times_s[0] if self.token_times_s else None

    @property
    def ttft_s(self) -> float | None:
        return None if not self.token_times_s else self.token_times_s[0] - self.arrival_s

    def own_due_s(self, spp: int = 1) -> float | None:
        """When the next token of this decoding request falls due by its own TPOT target (the
        API's tpot_slo_s), None if it set none. The target is a mean over the answer, as SLO
        attainment counts it (sim/metrics/summary.py; `vllm bench serve --goodput`): token k
        by the first token plus k targets, scaled for pipelining as the iteration budget is.
        Tokens that came faster than the target bank the time they saved, for a step that
        runs longer (replica_rules.step_budget_s) or a paused step that is not paused for
        them (step_clock.token_due_s). Under async scheduling the next token is the one after
        those still in flight."""
        target = self.tpot_target_s
        if target is None or not self.token_times_s:
            return None
        k = len(self.token_times_s) + self.num_placeholders
        return mean_due_s(self.token_times_s[0], k, target, spp)

    def slack(self, now: float) -> float:
        """s_r(t) = a_r + d_r - t - w_r(t): the one slack formula (the lrs and lars keys, the
        packer's space sharing and the pla policy all read it here)."""
        return self.deadline_s - now - self.remaining_work_s

    def relative_slack(self, now: float, per: str) -> float:
        """LARS's rho_r: slack in units of the prefill work still ahead, s_r / w_r(t)
        (`per="remaining"`), or of the whole prefill's, s_r / w_r^total (`per="total"`, the
        paper's formula); --lars-slack (SchedulerConfig.lars.slack) chooses (docs/design.md
        compares them)."""
        if per == "remaining":
            return self.slack(now) / max(self.remaining_work_s, 1e-12)
        if per == "total":
            return self.slack(now) / max(self.total_work_s, 1e-12)
        raise ValueError(f"relative slack is per 'remaining' or 'total' work, got {per!r}")

    # ---- state machine -------------------------------------------------------------------
    def transition(self, new: RequestState) -> None:
        """Only the scheduler's request table calls this (tests/test_request_table.py checks)."""
        if new is self.state:
            return
        if new not in _ALLOWED[self.state]:
            raise InvalidTransition(
                f"request {self.request_id}: {self.state.value} -> {new.value} is not allowed"
            )
        self.state = new

    def __repr__(self) -> str:
        return (
            f"Request({self.request_id!r}, {self.state.value}, prompt={self.prompt_len}, "
            f"computed={self.num_computed}/{self.num_tokens}, out={self.num_output_tokens}/"
            f"{self.max_tokens})"
        )
