"""Does the simulator make the engine's decisions? Runs one request list through the real engine
and through the simulator with the engine's predictor, and records every batch either forms.

A decision is (prefill chunks, decodes, batches completed before it, KVP groups holding each
chunk's request, the prefix cache's hit for each prefill that starts: tokens from the device
and the host tier, and the host tier's copies). With fcfs and adaptive chunking nothing
reads the clock while every TTFT deadline is ahead (a passed one lets the packer run longer
steps: replica_rules.step_budget_s, overload), so two runs with deadlines out of reach that agree
on the state agree on every decision; measured times enter only through the stage
timestamps, which are compared separately (`overlaps`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

from medha.core.request import Request
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import ReplicaScheduler

Decision = tuple[tuple, tuple, int, tuple, tuple]


@contextlib.contextmanager
def recording() -> Iterator[list[Decision]]:
    """Record the batches every ReplicaScheduler forms inside the block."""
    log: list[Decision] = []
    schedule = ReplicaScheduler.schedule

    def record(self, now):
        batch = schedule(self, now)
        if batch is not None:
            groups = getattr(self.blocks, "groups_holding", lambda _: 1)
            log.append(
                (
                    tuple((c.request.request_id, c.start, c.num_tokens) for c in batch.prefills),
                    tuple(sorted((c.request.request_id, c.start) for c in batch.decodes)),
                    self.stats.batches - self._inflight,
                    tuple(groups(c.request.request_id) for c in batch.prefills),
                    (
                        tuple(
                            (c.request.request_id, c.start, c.request.num_host_cached_tokens)
                            for c in batch.prefills
                            if c.start == c.request.num_cached_tokens
                        ),
                        tuple(batch.cache_out),
                        tuple(batch.cache_in),
                    ),
                )
            )
        return batch

    ReplicaScheduler.schedule = record
    try:
        yield log
    finally:
        ReplicaScheduler.schedule = schedule


def engine_run(
    prompts: list[list[int]], max_tokens: int, scheduler: SchedulerConfig, **engine_options
):
    """(decisions, request ids, the engine's predictor, its stage times or None, its number
    of KV blocks)."""
    from medha.engine.llm import LLM
    from medha.engine.sampling_params import SamplingParams

    llm = LLM(scheduler=scheduler, **engine_options)
    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        with recording() as log:
            outs = llm.generate(prompts, params)
        pipeline = llm.engine.pipeline
        return (
            log,
            [o.request_id for o in outs],
            llm.engine.predictor,
            pipeline.stage_times if pipeline is not None else None,
            llm.engine.num_kv_blocks,
        )
    finally:
        llm.engine.close()


def sim_run(
    ids: list[str],
    prompts: list[int] | list[list[int]],
    max_tokens: int,
    scheduler: SchedulerConfig,
    predictor,
    num_blocks: int | None = None,
):
    """(decisions, stage times as (batch, stage, start, end)) of the same requests, all
    arriving at once, simulated with `predictor` and its parallel layout. `prompts`: their
    lengths, or their token ids (what the prefix cache's keys are made of); `num_blocks`: the
    engine's KV blocks (default: 1 GiB of them)."""
    from medha.sim.simulator import KV_BLOCK_SIZE, ClusterConfig, Simulator

    requests = [
        Request.from_tokens(rid, 0.0, p, max_tokens)
        if isinstance(p, list)
        else Request(rid, 0.0, p, max_tokens)
        for rid, p in zip(ids, prompts)
    ]
    kv_gb = 1.0
    if num_blocks is not None:  # the byte count that kv_blocks_per_replica turns into them
        per_block = KV_BLOCK_SIZE * predictor.model.kv_bytes_per_token(
            predictor.hardware.dtype_bytes
        )
        kv_gb = (num_blocks + 0.5) * per_block / 2**30
    sim = Simulator(
        ClusterConfig(hardware=predictor.hardware.name, kv_memory_gb=kv_gb),
        predictor.parallel,
        scheduler,
        predictor=predictor,
    )
    with recording() as log:
        result = sim.run(requests)
    return log, [(b, s, a, e) for _, b, s, a, e in result.stage_times]


def overlaps(stage_times) -> list[bool]:
    """For each batch after the first: did stage 0 start it before stage 1 finished the
    previous batch?"""
    t = {(b, s): (a, e) for b, s, a, e in stage_times}
    batches = sorted({b for b, _ in t})
    return [t[(b1, 0)][0] < t[(b0, 1)][1] for b0, b1 in zip(batches, batches[1:])]


def first_difference(a: list, b: list) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))
