"""How many tokens each request gets in the next iteration.

The scheduler puts every decode in first (they are cheap and their TBT is on the line), then
hands the prefill-phase requests to the packer in policy order, each looked up in the prefix
cache just before the packer sees it (a hit counts as computed, so the chunk starts after it).
A packer only sizes chunks: the batch builder finds the KV memory behind each one (and may
shrink it to the blocks it can find), and the scheduler stops handing out requests once
`is_full` says the batch has no room.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Collection
from typing import TYPE_CHECKING, ClassVar

from medha.core.config import SchedulerConfig, iteration_budget, parse_chunking
from medha.core.request import Request
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.config_defaults import resolve_config
from medha.utils.registry import Registry

if TYPE_CHECKING:
    from medha.scheduler.batch_builder import BatchBuilder


class Packer(ABC):
    name: ClassVar[str]
    default_policy: ClassVar[str]

    def __init__(self, config: SchedulerConfig, predictor: Predictor, arg: int | None) -> None:
        """`config` must be resolved (make_packer resolves it)."""
        self.config = config
        self.predictor = predictor
        self.iteration_budget_s: float = config.iteration_budget_s
        self._spp = predictor.parallel.spp

    def batch_budget_s(self, builder: BatchBuilder, queue: Collection[Request] = ()) -> float:
        """The time budget of the batch being built, from who waits for the step to end:

        - decodes (their next token): the iteration budget, or less when one of them has its
          own TPOT target (the API's tpot_slo_s): at most that target, scaled for pipelining
          as the default budget is, never below the decodes plus one fresh --min-chunk-tokens
          prefill chunk (a request still in prefill is judged by its TTFT, not its TPOT);
        - short prefills beside others in `queue` (their first token, or their turn): the
          iteration budget;
        - nobody (no request decoding, and one prefill alone or long ones only):
          `arrival_wait_s`, the longest a request arriving during the step may wait, so that
          a long prefill alone runs in few large chunks (docs/design.md, "The iteration
          budget"). Under overload a request that has missed its TTFT deadline (decoding
          after a late first token, or still waiting past it) can no longer meet its SLO and
          waits on no step either: when every one has, steps run to the arrival wait, which
          buys throughput (the queue drains sooner) where small steps buy nobody's SLO.

        Packers that size chunks by time (adaptive) use it; token-budget ones (static, none)
        have no time budget to bound."""
        if self._nobody_waits(builder, queue):
            return self.config.arrival_wait_s
        target = builder.tpot_target_s
        if target is None:
            return self.iteration_budget_s
        capped = min(self.iteration_budget_s, iteration_budget(target, self._spp))
        # A target never stops the prefills: the batch keeps room for one minimum chunk of a
        # new prompt beside its decodes, or one client asking for token times the hardware
        # cannot give would hold every newcomer at zero progress until it finished.
        floor = builder.time_with_chunk(self.config.min_chunk_tokens, 0)
        return max(capped, min(floor, self.iteration_budget_s))

    def _nobody_waits(self, builder: BatchBuilder, queue: Collection[Request]) -> bool:
        """Whether nobody waits on this step's end: no request is decoding on time (one in a
        batch still in the pipeline joins the next step too) and `queue` holds one prefill
        alone, or long ones and late ones only (a long prefill waits for its whole prefill,
        not a step; a late one, past its TTFT deadline, for nothing the step could save).
        Read from the queue's shape and, once deadlines have passed, the deadlines: while
        every deadline is ahead of both clocks the simulator, given the engine's requests,
        makes the engine's decisions (analysis/schedule_match.py)."""
        if self.config.arrival_wait_s <= self.iteration_budget_s:
            return False
        if builder.any_decoding_on_time:
            return False
        waiting = getattr(queue, "requests", queue)  # (the scheduler's, without look-ups)
        if len(waiting) <= 1:
            return True
        long, now = builder.long_threshold, builder.now
        return all(r.num_uncached_tokens >= long or r.deadline_s < now for r in waiting)

    def is_full(self, builder: BatchBuilder) -> bool:
        """Whether the batch has no room for another prefill chunk: the scheduler hands the
        packer no more requests (nor looks them up in the prefix cache) once it has none."""
        return builder.room_seqs == 0 or builder.room_tokens == 0

    @abstractmethod
    def pack(self, now: float, queue: Collection[Request], builder: BatchBuilder) -> None:
        """Add prefill chunks for `queue` (highest priority first) to the builder's batch.
        Iterate `queue` once, in order; it ends where `is_full` says the batch is full."""

    @abstractmethod
    def plan_isolated(self, kv_offset: int, remaining: int) -> int:
        """Chunk this packer gives a prefill at `kv_offset` with `remaining` tokens in steps
        of the iteration budget, the budget it runs at beside any other request (Algorithm 3's
        walk: the work w_r every policy reads)."""

    def max_batch_tokens(self, max_model_len: int) -> int | None:
        return self.config.max_batch_tokens


PACKERS: Registry[Packer] = Registry("chunking mode", __package__, suffix="_packer")


def make_packer(config: SchedulerConfig, predictor: Predictor) -> Packer:
    """The packer of `config`'s chunking mode. The scheduler passes its resolved config, which
    `resolve_config` returns unchanged; a tool that builds a packer alone gets the same defaults."""
    config = resolve_config(config, predictor)
    mode, arg = parse_chunking(config.chunking)
    return PACKERS.get(mode)(config, predictor, arg)


def replica_prefill_times(config: SchedulerConfig, predictor: Predictor) -> PrefillTimeCache:
    """The prefill-time walk (Algorithm 3) of a replica that runs `config`: its packer's
    isolated chunks up to its context length, overlapped across pipeline stages unless the
    pipeline is microbatched. ReplicaScheduler builds its own with this and the router its
    model of a replica, so both read the same times without the router building a scheduler."""
    config = resolve_config(config, predictor)
    return PrefillTimeCache(
        predictor,
        make_packer(config, predictor).plan_isolated,
        config.max_model_len,
        overlapped=config.pipeline == "stream",
    )
