"""A batch being formed: its predicted time, its caps, and the KV memory behind each chunk.

The packer adds prefill chunks here; the KV arbiter grants the blocks behind each one (and may
preempt others for them, which it records in the batch for the scheduler to act on later).
"""

from __future__ import annotations

from medha.core.batch import Batch, Chunk
from medha.core.request import Request
from medha.perf.predictor import BatchTimer
from medha.scheduler.kv_arbiter import KVArbiter


class BatchBuilder:
    def __init__(
        self,
        kv: KVArbiter,
        batch: Batch,
        timer: BatchTimer,
        now: float,
        max_seqs: int,
        max_tokens: int | None,
        long_threshold: int,
    ) -> None:
        self._kv = kv
        self.long_threshold = long_threshold
        self.batch = batch
        self.timer = timer
        self.now = now
        self._max_seqs = max_seqs
        self._max_tokens = max_tokens
        # the tightest TPOT target among the requests whose decodes the batch carries (None:
        # none has its own); the packer bounds the batch's time budget by it
        self.tpot_target_s: float | None = None
        self.prepared: list[Request] = []  # requests prepare() gave a cached prefix

    def prepare(self, r: Request) -> None:
        """Before the packer plans `r`'s first chunk: the prefix cache's hit, if any, becomes
        computed KV, so the chunk starts after it (the scheduler gives it back if `r` gets no
        chunk after all)."""
        if not r.num_scheduled and self._kv.prefix_caching:
            self._kv.attach_cached(r)
            if r.num_cached_tokens:
                self.prepared.append(r)

    @property
    def is_empty(self) -> bool:
        return not (self.batch.decodes or self.batch.prefills)

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

    def add_decodes(self, requests: list[Request], own_targets: bool = True) -> None:
        """Add one decode token for each request (their KV blocks are already reserved).
        `own_targets`: some of them may carry their own TPOT target (the tightest bounds the
        batch's budget); False skips looking.

        A request is a member of the batch from here on: its `num_inflight_batches` is raised,
        which also keeps it from being chosen as a preemption victim."""
        kv_lens = [r.num_scheduled for r in requests]
        self.timer.add_decodes(kv_lens)
        self.batch.decode_kv_sum += sum(kv_lens)
        chunks = self.batch.decodes
        for r in requests:
            chunks.append(Chunk(r, r.num_scheduled, 1, True))
            r.num_scheduled += 1
            r.num_inflight_batches += 1
        if own_targets:
            targets = [r.tpot_target_s for r in requests if r.tpot_target_s is not None]
            if self.tpot_target_s is not None:
                targets.append(self.tpot_target_s)
            if targets:
                self.tpot_target_s = min(targets)

    def add_prefill(self, r: Request, num_tokens: int, all_or_nothing: bool = False) -> int:
        """Add up to `num_tokens` of `r` (fewer if KV memory runs short); returns how many."""
        start = r.num_scheduled
        held = self._kv.reserve(r, start + num_tokens, self.batch, self.now, all_or_nothing)
        n = held - start
        if n <= 0 or (all_or_nothing and n < num_tokens):
            return 0
        self.timer.add_prefill(n, start)
        self.batch.prefills.append(Chunk(r, start, n, start + n == r.num_tokens))
        self._claim(r, n)
        return n

    def _claim(self, r: Request, n: int) -> None:
        r.num_scheduled += n
        r.num_inflight_batches += 1
