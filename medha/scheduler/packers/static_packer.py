"""Sarathi-Serve's chunking: a fixed token budget per iteration, decodes included."""

from __future__ import annotations

from collections.abc import Collection

from medha.core.request import Request
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.packers.base_packer import PACKERS, Packer


@PACKERS.register("static")
class StaticPacker(Packer):
    default_policy = "fcfs"

    def __init__(self, config, predictor, arg: int | None) -> None:
        super().__init__(config, predictor, arg)
        self.token_budget = int(arg)

    def max_batch_tokens(self, max_model_len: int) -> int | None:
        cap = self.config.max_batch_tokens
        return self.token_budget if cap is None else min(cap, self.token_budget)

    def pack(self, now: float, queue: Collection[Request], builder: BatchBuilder) -> None:
        for r in queue:
            n = min(r.num_unscheduled, builder.room_tokens)
            added = builder.add_prefill(r, n)
            if added < n:
                break  # out of KV memory: later requests wait their turn, as under FCFS
            if not self.config.multi_prefill:
                break

    def plan_isolated(self, kv_offset: int, remaining: int) -> int:
        return min(remaining, self.token_budget)
