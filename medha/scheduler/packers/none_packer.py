"""No chunking (Orca, vLLM without chunked prefill): a prompt runs whole in one iteration, so a
started prefill is never preempted, and everything behind it waits for it."""

from __future__ import annotations

from collections.abc import Collection

from medha.core.request import Request
from medha.scheduler.batch_builder import BatchBuilder
from medha.scheduler.packers.base_packer import PACKERS, Packer


@PACKERS.register("none")
class NonePacker(Packer):
    default_policy = "fcfs"

    def max_batch_tokens(self, max_model_len: int) -> int | None:
        return self.config.max_batch_tokens or max_model_len

    def is_full(self, builder: BatchBuilder) -> bool:
        """Full once out of sequence slots: a whole prompt takes the token room it needs."""
        return builder.room_seqs == 0

    def pack(self, now: float, queue: Collection[Request], builder: BatchBuilder) -> None:
        for r in queue:
            n = r.num_unscheduled
            if builder.num_prefills and n > builder.room_tokens:
                break
            if builder.add_prefill(r, n, all_or_nothing=True) == 0:
                break
            if not self.config.multi_prefill:
                break

    def plan_isolated(self, kv_offset: int, remaining: int) -> int:
        return remaining
