"""`medha profile --engine vllm`: vLLM's step times on this machine, for medha's packer.

medha's adaptive packer sizes each batch from a predicted step time; on vLLM's engine the
prediction must be of vLLM's steps. The profiler runs vLLM's engine with `MedhaScheduler`
(fcfs, static chunks: a plain, predictable schedule) over workloads that produce the shapes to
learn, and keeps the scheduler's record of every step (`MedhaScheduler.steps`: the batch's
shape and the whole engine-core step, from the start of `schedule` to the end of
`update_from_output`, the cycle a request waits through):

- prefill chunks of 16-2048 tokens after 0-6144 cached ones: the cached part is a prompt run
  before, which vLLM's prefix cache then skips, so the step computes exactly the chunk;
- decode batches of 1-256 requests over 64-4096 tokens of KV (their prompts share a cached
  prefix, so setting a batch up costs one prefill of it);
- two mixed loads of short and long prompts, whose steps carry chunks beside decodes.

The engine core runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0) so that the profiler can
read the scheduler; the model runs in a worker process of vLLM's multiprocessing executor, whose
OpenMP threads vLLM binds exactly as its server does (on a CPU, by default, the model on all
cores but one, which is kept for the engine core and the front end). Without asking for that
executor, vLLM would run the model in this process unbound, on every core: on a 2-core machine
twice as fast as any server runs it, and the packer would plan with the wrong times.

A step slowed by something else on the machine is longer, never shorter: steps more than
`OUTLIER` times the first fit's prediction are dropped before the final fit, and the fit's
errors on steps it did not see are reported.
"""

from __future__ import annotations

import os
import random
import sys
import time
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from medha.engine.config import EngineConfig
from medha.perf.grid import doubling
from medha.perf.profile_data import IterationRow, Profile
from medha.perf.profiled_predictor import IterationModel
from medha.scheduler.config import SchedulerConfig

PREFILL_CHUNKS = (16, 64, 256, 512, 1024, 2048)
PREFILL_OFFSETS = (0, 1024, 3072, 6144)
PREFILL_REPEATS = 2
DECODE_BATCHES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
DECODE_KV = (64, 512, 1024, 2048, 4096)
DECODE_STEPS = 6  # output tokens per decode request: the first comes from its prefill
OUTLIER = 1.5
DEFAULT_BATCH_TOKENS = 2048


@dataclass
class Workload:
    """Prompts run together after `warm` (run first, alone, to fill the prefix cache)."""

    name: str
    prompts: list[list[int]]
    max_tokens: list[int]
    warm: list[list[int]] = field(default_factory=list)


def workloads(
    max_len: int,
    batch_tokens: int,
    max_seqs: int,
    capacity: int,
    block: int,
    vocab: int,
    seed: int = 0,
    quick: bool = False,
) -> list[Workload]:
    """What to run: prefill chunks at offsets, decode batches, two mixed loads. Every shape
    fits vLLM's limits and the KV cache (`capacity` tokens in blocks of `block`)."""
    rng = random.Random(seed)

    def tokens(n: int) -> list[int]:
        return [rng.randrange(100, vocab - 100) for _ in range(n)]

    chunks = PREFILL_CHUNKS[::2] if quick else PREFILL_CHUNKS
    # up to the context and max_num_seqs, as medha's own grid (medha/perf/grid.py): offsets,
    # decode batches and decode KV doubling past the fixed values while they fit
    offsets = PREFILL_OFFSETS[:2] if quick else doubling(PREFILL_OFFSETS, max_len - chunks[0] - 1)
    out: list[Workload] = []
    for k in offsets:
        prefix = tokens(k)
        for n in chunks:
            if n > batch_tokens or k + n + 1 > max_len or k + n + block > capacity:
                continue
            # twice even when quick: a shape's first step may pay its kernels' first call,
            # and a lone slow step would be dropped as an outlier, its shape with it
            for _ in range(PREFILL_REPEATS):
                warm = [prefix] if k else []
                out.append(Workload(f"prefill {n} after {k}", [prefix + tokens(n)], [1], warm))
    batches = DECODE_BATCHES[::2] if quick else doubling(DECODE_BATCHES, max_seqs)
    kvs = DECODE_KV[:2] if quick else doubling(DECODE_KV, max_len - DECODE_STEPS - 1)
    for kv in kvs:
        shared = (kv - 16) // block * block
        for b in batches:
            # medha's mirror counts a shared block once per request: size by the requests' KV
            need = b * (-(-(kv + DECODE_STEPS) // block) + 1) * block
            if b > max_seqs or kv + DECODE_STEPS > max_len or need > capacity:
                continue
            prefix = tokens(shared)
            prompts = [prefix + tokens(kv - shared) for _ in range(b)]
            out.append(
                Workload(
                    f"{b} decodes over {kv}",
                    prompts,
                    [DECODE_STEPS] * b,
                    [prefix] if shared else [],
                )
            )
    for i in range(1 if quick else 2):
        short = [tokens(rng.randrange(32, 257)) for _ in range(12 if quick else 24)]
        long_len = min(max_len - 64, rng.randrange(3000, 6001), capacity // 4)
        prompts = short + [tokens(long_len)]
        out.append(
            Workload(
                f"mixed load {i + 1}",
                prompts,
                [rng.randrange(16, 49) for _ in prompts],
            )
        )
    return out


def fit_errors(rows: list[IterationRow], model: IterationModel) -> np.ndarray:
    """Relative errors |predicted - measured| / measured of each row."""
    predicted = np.array([predict(model, r) for r in rows])
    measured = np.array([r.seconds for r in rows])
    return np.abs(predicted - measured) / measured


def predict(model: IterationModel, row: IterationRow) -> float:
    tokens = sum(n for n, _ in row.prefills) + len(row.decode_kv)
    return (
        model.linear(tokens, len(row.prefills) + len(row.decode_kv))
        + sum(model.prefill_attention(n, k) for n, k in row.prefills)
        + sum(model.decode_attention(k) for k in row.decode_kv)
    )


def clean(rows: list[IterationRow]) -> tuple[list[IterationRow], int]:
    """Rows without the ones a busy machine slowed (more than OUTLIER x a first fit's
    prediction), and how many were dropped."""
    model = IterationModel.fit(rows)
    keep = [r for r in rows if r.seconds <= OUTLIER * predict(model, r)]
    return keep, len(rows) - len(keep)


def holdout(rows: list[IterationRow], seed: int = 0, fraction: float = 0.2) -> np.ndarray:
    """Relative errors on a random `fraction` of the rows of a fit on the others."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    cut = max(1, int(len(rows) * fraction))
    held = [rows[i] for i in order[:cut]]
    model = IterationModel.fit([rows[i] for i in order[cut:]])
    return fit_errors(held, model)


class VllmProfiler:
    """Runs `workloads` on vLLM's offline engine with medha's scheduler, keeping each step."""

    def __init__(self, engine: EngineConfig, scheduler: SchedulerConfig, extra: dict | None = None):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the scheduler in this process
        import vllm

        from medha.vllm_executor.engine_args import vllm_engine_args
        from medha.vllm_executor.settings import vllm_dtype

        batch_tokens = scheduler.max_batch_tokens or DEFAULT_BATCH_TOKENS
        plain = SchedulerConfig(
            policy="fcfs",
            chunking=f"static:{batch_tokens}",
            max_model_len=scheduler.max_model_len,
            max_num_seqs=scheduler.max_num_seqs,
            max_batch_tokens=batch_tokens,
        )
        args = vllm_engine_args(engine, plain, extra)
        args.setdefault("enable_prefix_caching", True)
        args.setdefault("distributed_executor_backend", "mp")  # bound as when serving
        if not args["enable_prefix_caching"]:
            raise ValueError("profiling vLLM needs its prefix cache (enable_prefix_caching)")
        self.llm = vllm.LLM(**args)
        self.scheduler = self.llm.llm_engine.engine_core.engine_core.scheduler
        config = self.scheduler.vllm_config
        self.model = os.path.basename(os.path.normpath(str(config.model_config.model)))
        self.device = "cuda" if config.device_config.device_type == "cuda" else "cpu"
        self.dtype = vllm_dtype(config.model_config)
        self.tp = config.parallel_config.tensor_parallel_size
        self.executor = config.parallel_config.distributed_executor_backend
        self.max_len = config.model_config.max_model_len
        self.batch_tokens = self.scheduler.max_num_scheduled_tokens
        self.max_seqs = config.scheduler_config.max_num_seqs
        blocks = self.scheduler.medha.blocks
        self.block = blocks.block_size
        self.capacity = blocks.num_blocks * blocks.block_size
        self.vocab = config.model_config.get_vocab_size()

    def workloads(self, seed: int = 0, quick: bool = False) -> list[Workload]:
        return workloads(
            self.max_len,
            self.batch_tokens,
            self.max_seqs,
            self.capacity,
            self.block,
            self.vocab,
            seed,
            quick,
        )

    def _generate(self, prompts: list[list[int]], max_tokens: list[int]) -> None:
        from vllm import SamplingParams

        params = [
            SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in max_tokens
        ]
        self.llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)

    def run(self, work: list[Workload], progress: bool = True) -> list[IterationRow]:
        # a first run warms the worker up (allocations, kernels' first calls): not kept
        self._generate([[101] * min(512, self.batch_tokens)] * 2, [4, 4])
        rows: list[IterationRow] = []
        self.scheduler.steps = rows  # the scheduler records each step's row into it
        try:
            for w in tqdm(work, desc="profiling vLLM", unit="run", disable=not progress):
                for prefix in w.warm:  # (their steps are prefills from 0: kept too)
                    self._generate([prefix], [1])
                self._generate(w.prompts, w.max_tokens)
        finally:
            self.scheduler.steps = None
        return rows

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()


def profile_vllm(
    engine: EngineConfig,
    scheduler: SchedulerConfig,
    extra: dict | None = None,
    seed: int = 0,
    quick: bool = False,
    progress: bool = True,
) -> tuple[Profile, dict, VllmProfiler]:
    """Profile vLLM's engine: the profile, a report of the fit, and the (closed) profiler."""
    profiler = VllmProfiler(engine, scheduler, extra)
    try:
        work = profiler.workloads(seed, quick)
        print(
            f"profiling vLLM ({profiler.model}, {profiler.device}, {profiler.dtype}): "
            f"{len(work)} runs",
            file=sys.stderr,
        )
        t0 = time.monotonic()
        rows = profiler.run(work, progress)
        wall = time.monotonic() - t0
    finally:
        profiler.close()
    kept, dropped = clean(rows)
    profile = Profile(
        sources=[f"medha profile --engine vllm ({len(kept)} steps of {len(rows)})"],
        model=profiler.model,
        hardware=profiler.device,
        iteration_rows=kept,
    )
    seen = fit_errors(kept, IterationModel.fit(kept))
    unseen = holdout(kept, seed)
    report = {
        "executor": profiler.executor,
        "steps": len(rows),
        "dropped": dropped,
        "wall_s": wall,
        "fit_median": float(np.median(seen)),
        "fit_p90": float(np.quantile(seen, 0.9)),
        "holdout_median": float(np.median(unseen)),
        "holdout_p90": float(np.quantile(unseen, 0.9)),
    }
    return profile, report, profiler
