"""What every simulated iteration ran: batch composition, timing, prefill chunks."""

from __future__ import annotations

from medha.core.batch import Batch


class IterationLog:
    """Columnar, so that recording costs a few appends per batch."""

    def __init__(self) -> None:
        self.replica: list[int] = []
        self.start_s: list[float] = []
        self.end_s: list[float] = []
        self.latency_s: list[float] = []
        self.num_decodes: list[int] = []
        self.decode_kv: list[int] = []  # sum of the decodes' KV lengths
        self.num_prefills: list[int] = []
        self.prefill_tokens: list[int] = []
        # one row per prefill chunk
        self.chunk_iteration: list[int] = []
        self.chunk_request: list[str] = []
        self.chunk_start: list[int] = []
        self.chunk_tokens: list[int] = []

    def __len__(self) -> int:
        return len(self.start_s)

    def record(self, replica_id: int, batch: Batch, start: float, end: float) -> None:
        index = len(self.start_s)
        self.replica.append(replica_id)
        self.start_s.append(start)
        self.end_s.append(end)
        self.latency_s.append(batch.predicted_time_s)
        decodes = batch.decodes
        self.num_decodes.append(len(decodes))
        self.decode_kv.append(batch.decode_kv_sum)
        tokens = 0
        for c in batch.prefills:
            self.chunk_iteration.append(index)
            self.chunk_request.append(c.request.request_id)
            self.chunk_start.append(c.start)
            self.chunk_tokens.append(c.num_tokens)
            tokens += c.num_tokens
        self.num_prefills.append(len(batch.prefills))
        self.prefill_tokens.append(tokens)
