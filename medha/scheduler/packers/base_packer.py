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

from medha.core.config import parse_chunking
from medha.core.request import Request
from medha.perf.predictor import Predictor
from medha.perf.prefill_time_cache import PrefillTimeCache
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import resolve_config
from medha.scheduler.policies import Policy, make_policy
from medha.scheduler.replica_rules import QueueSnapshot, StepRules, is_long, step_budget_s
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
        self.rules = StepRules.of(config, predictor.parallel.spp)

    def batch_budget_s(self, builder: BatchBuilder, queue: Collection[Request] = ()) -> float:
        """The time budget of the batch being built, from who waits for the step to end
        (replica_rules.step_budget_s): `queue` as it stands before anyone is looked up in the
        prefix cache, the requests decoding (and when their own TPOT targets make their next
        tokens due). Packers that size chunks by time (adaptive) use it; token-budget ones
        (static, none) have no time budget to bound."""
        waiting = getattr(queue, "requests", queue)  # (the scheduler's, without look-ups)
        snapshot = QueueSnapshot(builder.now, waiting, builder.decoding, builder.told)
        min_chunk = self.rules.min_chunk_tokens
        budget = step_budget_s(snapshot, self.rules, lambda: builder.time_with_chunk(min_chunk, 0))
        # beside a paused step the batch cannot pause, and whoever arrives during it waits for
        # its end: a long prefill there (one that cannot wait out the paused step) runs in
        # chunks within the scheduler's bound, not the arrival wait's
        beside_s = builder.beside_s
        if beside_s is not None and any(is_long(r, self.rules.long_threshold) for r in waiting):
            budget = min(budget, beside_s)
        return budget

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


def replica_policy(config: SchedulerConfig) -> Policy:
    """The policy a replica running `config` orders its prefills by: `config`'s, else its
    chunking mode's default (lars for adaptive chunking, fcfs for the others). A replica binds
    its own; the dispatchers and the router read an unbound one."""
    mode, _ = parse_chunking(config.chunking)
    return make_policy(config.policy or PACKERS.get(mode).default_policy, config)


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
