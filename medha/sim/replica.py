"""A simulated replica: the real scheduler, with batches timed by the predictor.

With stream-pipeline parallelism the replica's layers form `spp` stages and a batch occupies
each stage for `latency / spp` in turn. A new batch is formed as soon as stage 1 is free and
fewer than `spp` batches are in flight, as the engine does, so the next chunk of a long prefill
enters stage 1 while the previous chunk is still in the later stages (it needs that chunk's KV,
not its output, and the KV of every layer of a stage is written before the chunk leaves the
stage). Under the scheduler's microbatched pipeline (`SchedulerConfig.pipeline`, vLLM's and
Sarathi's) the scheduler offers no request with a batch in flight, so the stages fill with other
requests' batches only; the replica's timing is the same for both.
"""

from __future__ import annotations

from medha.core.batch import Batch, BatchResult
from medha.core.request import Request
from medha.dispatch.base_dispatcher import DecodeShare, Pending, decode_token_s
from medha.scheduler.replica_scheduler import ReplicaScheduler


class SimReplica:
    """A replica and, for the dispatchers, its `ReplicaView`: read from its scheduler, exact."""

    def __init__(self, replica_id: int, scheduler: ReplicaScheduler) -> None:
        self.replica_id = replica_id
        self.scheduler = scheduler
        self.predictor = scheduler.predictor
        self.scheduler_config = scheduler.config
        self.prefix_caching = scheduler.kv.prefix_caching
        self.spp = scheduler.predictor.parallel.spp
        self._stage_free_at = [0.0] * self.spp
        self.stage1_free = True
        self.inflight = 0
        self.stage_times: list[tuple[int, int, float, float]] = []  # spp > 1: (batch, stage,
        # start, end), as the engine's pipeline records them
        self._decode_token_s = decode_token_s(scheduler.predictor)
        self._decode_share = DecodeShare(scheduler.predictor, scheduler.config.iteration_budget_s)

    def add(self, request: Request, now: float) -> None:
        self.scheduler.add_request(request, now)

    def start_batch(self, now: float) -> tuple[Batch, float, float] | None:
        """Form the next batch; returns it with the times it leaves stage 1 and the pipeline."""
        batch = self.scheduler.schedule(now)
        if batch is None:
            return None
        stage = batch.predicted_time_s / self.spp
        t = now
        free = self._stage_free_at
        for s in range(self.spp):
            start = max(t, free[s])
            t = free[s] = start + stage
            if s == 0:
                stage1_end = t
            if self.spp > 1:
                self.stage_times.append((batch.batch_id, s, start, t))
        self.stage1_free = False
        self.inflight += 1
        return batch, stage1_end, t

    @property
    def ready(self) -> bool:
        """Whether a new batch may enter the pipeline now."""
        return self.stage1_free and self.inflight < self.spp

    def finish_batch(self, batch: Batch, now: float) -> list[Request]:
        self.inflight -= 1
        return self.scheduler.update(batch, BatchResult(batch.predicted_time_s), now)

    def outstanding_work_s(self) -> float:
        """Predicted prefill work still ahead plus the decode tokens still to generate."""
        return sum(
            r.remaining_work_s + (r.max_tokens - r.num_output_tokens) * self._decode_token_s
            for r in self.scheduler.live_requests()
        )

    # ---- ReplicaView -------------------------------------------------------------------------
    def pending(self, now: float) -> list[Pending]:
        return [Pending.of(r) for r in self.scheduler.live_requests() if r.first_token_s is None]

    def iteration_left_s(self, now: float) -> float:
        return max(0.0, self._stage_free_at[0] - now) if self.inflight else 0.0

    def prefill_stretch(self) -> float:
        return self._decode_share.stretch(
            [
                r.prompt_len + r.num_output_tokens
                for r in self.scheduler.live_requests()
                if r.first_token_s is not None
            ]
        )

    def busy(self) -> bool:
        return self.inflight > 0

    def cached_tokens(self, request: Request) -> int:
        return self.scheduler.kv.peek_cached(request)

    def prefill_work_s(self, request: Request, cached: int) -> float:
        return self.scheduler.prefill_times.remaining(request.prompt_len, cached)

    def progress(self, request: Request) -> tuple[float | None, float, bool]:
        return request.first_token_s, request.deadline_s, request.state.is_done
