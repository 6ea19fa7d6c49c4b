"""A batch being formed: its predicted time, its caps, and the KV memory behind each chunk.

The packer sizes prefill chunks and adds them here; the builder asks the KV arbiter for the
blocks behind each one (the arbiter may evict others for them) and has the request table apply
what the arbiter decided, so a packer needs neither.
"""

from __future__ import annotations

from collections.abc import Collection

from medha.core.batch import Batch
from medha.core.request import Request
from medha.perf.predictor import BatchTimer
from medha.scheduler.kv_arbiter import KVArbiter
from medha.scheduler.request_table import RequestTable


class BatchBuilder:
    def __init__(
        self,
        requests: RequestTable,
        kv: KVArbiter,
        batch: Batch,
        timer: BatchTimer,
        now: float,
        max_seqs: int,
        max_tokens: int | None,
        pausable: bool = False,
        beside_s: float | None = None,
    ) -> None:
        """`pausable`: the executor pauses the step for the decodes running beside it when
        their tokens fall due (SchedulerConfig.pause_steps), so none of them waits on it.
        `beside_s`: the batch runs while a pausable step is paused, and cannot pause itself:
        with a long prefill's chunk in it, it takes at most this long (base_packer)."""
        self._requests = requests
        self._kv = kv
        self.batch = batch
        self.timer = timer
        self.now = now
        self._max_seqs = max_seqs
        self._max_tokens = max_tokens
        self._pausable = pausable
        self.beside_s = beside_s

    @property
    def is_empty(self) -> bool:
        return not (self.batch.decodes or self.batch.prefills)

    @property
    def decoding(self) -> Collection[Request]:
        """The requests decoding, in this batch or in one still running (who may wait on the
        step's length: replica_rules.nobody_waits); none beside a pausable step."""
        return () if self._pausable else self._requests.decoding.values()

    @property
    def told(self) -> bool:
        """Whether a live request carries a target of its own (the packer then looks for the
        decodes' due times and the told prefills' latest starts: replica_rules.told_due_s)."""
        return self._requests.told_requests > 0

    @property
    def num_prefills(self) -> int:
        return len(self.batch.prefills)

    @property
    def room_seqs(self) -> int:
        return self._max_seqs - self.timer.num_seqs

    @property
    def room_tokens(self) -> int:
        if self._max_tokens is None:
            return 1 << 62
        return max(0, self._max_tokens - self.timer.num_tokens)

    def time_with_chunk(self, num_tokens: int, kv_offset: int) -> float:
        return self.timer.time_with_prefill(num_tokens, kv_offset)

    # ---- KV memory ---------------------------------------------------------------------------
    def reserve(self, r: Request, num_tokens: int, all_or_nothing: bool = False) -> int:
        """Make `r` hold KV for `num_tokens` tokens (the arbiter evicts lower-ranked requests
        if it must); the tokens it can hold now."""
        held, evicted = self._kv.reserve(r, num_tokens, self.batch, self.now, all_or_nothing)
        if evicted:
            self._requests.evict(evicted, self.batch)
        return held

    def make_room(self, r: Request, extra_blocks: int) -> None:
        """Evict requests ranked below `r`, decodes included, until its whole context fits
        with `extra_blocks` and the watermark left free."""
        evicted = self._kv.make_room(r, extra_blocks, self.batch, self.now)
        if evicted:
            self._requests.evict(evicted, self.batch)

    def preempt(self, r: Request) -> None:
        """`r` cannot hold its next token and nobody below it can make room: it gives its
        blocks up for this batch (and recomputes or swaps back later)."""
        self._requests.evict((self._kv.preempt(r),), self.batch)

    # ---- chunks ------------------------------------------------------------------------------
    def add_decodes(self, requests: list[Request]) -> None:
        """Add one decode token for each request (their KV blocks are already reserved)."""
        kv_lens = [r.num_scheduled for r in requests]
        self.timer.add_decodes(kv_lens)
        self.batch.decode_kv_sum += sum(kv_lens)
        self.batch.decodes += self._requests.schedule_decodes(requests)

    def add_prefill(self, r: Request, num_tokens: int, all_or_nothing: bool = False) -> int:
        """Add up to `num_tokens` of `r` (fewer if KV memory runs short); returns how many."""
        start = r.num_scheduled
        n = self.reserve(r, start + num_tokens, all_or_nothing) - start
        if n <= 0 or (all_or_nothing and n < num_tokens):
            return 0
        self.timer.add_prefill(n, start)
        self.batch.prefills.append(self._requests.schedule_chunk(r, n))
        return n
