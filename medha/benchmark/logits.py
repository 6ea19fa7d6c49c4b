"""The logits of a prompt's prefill on medha's engine, position by position, for comparing
chunkings, dtypes and kernels with each other and with transformers: tests/test_engine.py,
tests/test_vllm_kernels.py and bench/engine/engine_correctness.py compare the same numbers."""

from __future__ import annotations

import time

import torch

from medha.core.batch import BatchResult
from medha.engine.llm import LLM
from medha.engine.sampling_params import SamplingParams
from medha.scheduler.config import SchedulerConfig


def prefill_logits(
    chunking: str, ids: list[int], dtype: str = "auto", chunks: list | None = None, **engine
) -> torch.Tensor:
    """Logits at every prompt position (float32), prefilled in the chunks `chunking` picks
    (their sizes appended to `chunks` when given); `engine`: more engine options."""
    engine = LLM(
        "smollm2",
        # (unpaused: a paused engine prefills a lone prompt in one step, the chunks are the
        # point here)
        scheduler=SchedulerConfig(
            policy="fcfs", chunking=chunking, tpot_target_s=0.02, pause_steps=False
        ),
        kv_memory_gb=0.1,
        dtype=dtype,
        **engine,
    ).engine
    engine.add_request("x", None, SamplingParams(max_tokens=1, temperature=0), prompt_token_ids=ids)
    rows = []
    while engine.has_unfinished():
        batch = engine.scheduler.schedule(time.monotonic())
        logits, _ = engine.runner.execute(batch, all_logits=True)
        rows.append(logits.float())
        if chunks is not None:
            chunks.append(batch.prefills[-1].num_tokens)
        tokens = {"x": 0} if batch.prefills[-1].samples else None
        engine.scheduler.update(batch, BatchResult(0.01, tokens), time.monotonic())
    return torch.cat(rows)
