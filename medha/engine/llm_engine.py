"""LLMEngine: the replica scheduler driving a real model.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.delta_text, out.finished)

Each `step` schedules one batch with the wall clock as `now`, runs it, samples, and reports the
measured time back to the scheduler (and to `engine.metrics`): one batch at a time, under async
scheduling or pipelined, as its step mode runs them (medha/engine/step_modes.py). An engine with
no profile of its own measures itself once before serving (medha/engine/start_measurement.py).

A request that fails on its own (medha/engine/errors.py says which errors those are) comes out
of `step` finished with finish_reason "error" and the message in `error`; the other requests
go on (medha/engine/isolation.py). `step` raises only errors that break the engine. What the
engine is built from (device, dtype, checkpoint, workers, predictor) is resolved once, in
medha/engine/setup.py.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass

import torch

from medha.core.config import parse_chunking
from medha.core.request import Request
from medha.engine.config import EngineConfig
from medha.engine.errors import EngineError, InvalidRequestError
from medha.engine.host_kv import HostKVBlocks
from medha.engine.isolation import FailureIsolation
from medha.engine.outputs import RequestOutput, RequestState
from medha.engine.pauses import Pauses, can_pause
from medha.engine.sampling_params import SamplingParams
from medha.engine.setup import EngineSetup, tune_process
from medha.engine.start_measurement import MIN_SELF_PROFILE_ROWS, probe_start, profile_self
from medha.engine.step_modes import step_mode
from medha.engine.tokenizer import Tokenizer
from medha.perf.online_fit import CorrectedPredictor, StepLearner
from medha.perf.predictor import Predictor
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.config_defaults import price_report
from medha.scheduler.packers import replica_policy
from medha.scheduler.recalibration import RESOLVE_SLICE_STEPS
from medha.scheduler.replica_scheduler import ReplicaScheduler

# (MIN_SELF_PROFILE_ROWS: start_measurement.py's, also read from here)
__all__ = [
    "MIN_SELF_PROFILE_ROWS",
    "EngineConfig",
    "EngineMetrics",
    "EngineStats",
    "LLMEngine",
    "check_prompt",
    "resolve_async_scheduling",
]

log = logging.getLogger("medha.engine")


@dataclass(frozen=True)
class EngineStats:
    """The engine's queues and KV cache at one instant (LLMEngine.stats)."""

    waiting: int  # requests whose prefill has not started: new, or preempted by recompute
    prefilling: int  # requests whose prefill has started and not finished
    running: int  # requests decoding
    swapped: int  # requests whose KV is in the host pool
    kv_blocks_used: int
    kv_blocks_free: int
    preemptions: int  # recomputes and swap-outs since start
    # prefix cache, over every prefill started so far: prompt tokens looked up and served
    prefix_query_tokens: int = 0
    prefix_hit_tokens: int = 0
    prefix_host_hit_tokens: int = 0  # of the hits, copied back from the host tier


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, scheduler: SchedulerConfig | None = None
    ) -> None:
        config = config or EngineConfig()
        tune_process(config)
        self.setup = setup = EngineSetup.resolve(config)
        self.config = setup.config  # block_size filled in
        self.device, self.dtype, self.kernels = setup.device, setup.dtype, setup.kernels
        self.model_path, self.spec = setup.model_path, setup.spec
        self.tokenizer = Tokenizer(self.model_path)
        scheduler = setup.scheduler_config(scheduler or SchedulerConfig())
        one_process = setup.parallel.world_size == 1
        self.async_scheduling = resolve_async_scheduling(self.config, self.device, one_process)
        # (settled before any worker process starts: a refusal leaves nothing running)
        scheduler = self._pause_steps(scheduler, one_process)
        self.pauses = Pauses(self)
        self.workers = setup.start_workers()
        self.pipeline = self.workers and self.workers.pipeline  # None: no stages
        self.runner = setup.model_runner(self.workers)
        # (on a CPU, where the tests run CUDA's decode path, the graphs' padded steps run eagerly)
        if self.runner.triton_decode and self.workers is None and self.config.cuda_graphs:
            self.runner.capture_decode_graphs(scheduler.max_num_seqs, scheduler.max_model_len)
        # one batch at a time, async or pipelined (step_modes.py)
        self.step_mode = step_mode(self)
        self._plan(scheduler, setup.predictor())
        # what it measures of itself before serving (start_measurement.py)
        if setup.self_profile_due():
            if profile_self(self):
                self._plan(scheduler, setup.predictor())
        elif setup.start_probe_due() and self.scheduler.learner is not None:
            probe_start(self)
        log.info("planning with %s: %s", self.predictor.describe(),
                 price_report(self.scheduler.config, self.predictor))  # fmt: skip
        self.swap_blocks = HostKVBlocks.for_swap_pool(scheduler, self.runner)
        self.prefix_host_blocks = HostKVBlocks.for_prefix_host_tier(scheduler, self.runner)
        self._states: dict[str, RequestState] = {}
        self.isolation = FailureIsolation(self.runner, self.workers, self.scheduler, self._states)
        self.metrics = EngineMetrics()
        self.governor = setup.governor(self.workers)

    def _pause_steps(self, scheduler: SchedulerConfig, one_process: bool) -> SchedulerConfig:
        """`scheduler` with pause_steps settled: on where this engine can pause its steps and
        the policy lets it (medha/engine/pauses.py), unless given; refused where asked for and
        impossible."""
        able = can_pause(self.device.type, one_process, self.async_scheduling)
        if scheduler.pause_steps is None:
            # (static:N and none keep the baselines' steps, Sarathi's and Orca's, as they are)
            adaptive = parse_chunking(scheduler.chunking)[0] == "adaptive"
            able = able and adaptive and replica_policy(scheduler).pauses_steps
            return dataclasses.replace(scheduler, pause_steps=able)
        if scheduler.pause_steps and not able:
            raise EngineError(
                "pause_steps runs in one process on a CPU, one batch at a time (not with "
                "tp/spp/kvp > 1, async scheduling or a GPU)"
            )
        if scheduler.pause_steps and not replica_policy(scheduler).pauses_steps:
            raise EngineError(
                f"pause_steps: policy {scheduler.policy} holds prefills back or picks decodes "
                "itself; its batches cannot be paused for others"
            )
        return scheduler

    def _plan(self, scheduler: SchedulerConfig, predictor: Predictor) -> None:
        """The scheduler (over a fresh KV cache) planning with `predictor`, corrected online
        unless --calibrate off. A pipeline's batch times overlap other batches', so they time no
        one batch: the model is corrected only where each batch runs alone."""
        learner = None
        if self.config.calibrate == "online" and self.pipeline is None:
            predictor = CorrectedPredictor(predictor)
            learner = StepLearner(predictor)
        setup = self.setup
        blocks = BlockManager.for_layout(setup.num_blocks, self.config.block_size, setup.parallel)
        self.predictor = predictor
        self.scheduler = ReplicaScheduler(
            scheduler,
            predictor,
            blocks,
            learner=learner,
            async_scheduling=self.async_scheduling,
            # (a re-resolution of the defaults, a few hundred chunks of its walks a batch: at a
            # 32K context one at once held every stream for 0.5-0.8 s)
            resolve_slice_steps=RESOLVE_SLICE_STEPS,
        )

    def close(self) -> None:
        """Stop the worker processes, if any (also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.close()

    @property
    def profile_path(self) -> str:
        """Where `medha profile` writes this engine's profile and `predictor: auto` reads it."""
        return self.setup.profile_path

    # ---- requests ----------------------------------------------------------------------------
    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | None,
        params: SamplingParams | None = None,
        *,
        prompt_token_ids: list[int] | None = None,
        arrival_s: float | None = None,
        ttft_deadline_s: float | None = None,
        tpot_target_s: float | None = None,
        priority_class: str | None = None,
    ) -> None:
        """Admit a request, all or nothing: a refused one (ValueError; InvalidRequestError
        names the field) leaves the engine as it was."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"params must be SamplingParams, got {type(params)}")
        if prompt_token_ids is None:
            if isinstance(prompt, str):
                prompt_token_ids = self.encode_prompt(prompt)
            elif prompt is not None:
                prompt_token_ids = list(prompt)
        check_prompt(prompt_token_ids, self.max_model_len, self.runner.args.vocab_size)
        request = Request.from_tokens(
            request_id,
            time.monotonic() if arrival_s is None else arrival_s,
            prompt_token_ids,
            params.max_tokens,
            ttft_deadline_s=ttft_deadline_s,
            tpot_target_s=tpot_target_s,
            priority_class=priority_class,
        )
        state = RequestState.new(params, self.tokenizer)
        self.scheduler.add_request(request, request.arrival_s)  # validates; raises ValueError
        self._states[request_id] = state  # nothing after the scheduler took it may fail

    def encode_prompt(self, text: str, param: str = "prompt") -> list[int]:
        """Token ids of a text prompt; one that cannot fit the context is refused without
        tokenizing all of it (InvalidRequestError)."""
        return self.tokenizer.encode(text, param, limit=self.max_model_len)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """Token ids of a chat through the model's template; refused (InvalidRequestError)
        without templating when its contents alone cannot fit the context."""
        return self.tokenizer.apply_chat_template(messages, limit=self.max_model_len)

    def abort(self, request_id: str) -> bool:
        self._states.pop(request_id, None)
        return self.scheduler.abort(request_id, time.monotonic()) is not None

    def has_unfinished(self) -> bool:
        """Whether a request is live, or a batch still runs (async scheduling)."""
        return self.scheduler.has_unfinished() or self.step_mode.ahead is not None

    # ---- read-only facts and counters (the server and CLI read these, not the scheduler) ----
    @property
    def max_model_len(self) -> int:
        """The longest context (prompt + output) a request may have."""
        return self.scheduler.max_model_len

    @property
    def kv_capacity_tokens(self) -> int:
        """The most KV tokens one request can hold (with KVP: across its groups)."""
        return self.scheduler.blocks.capacity_tokens

    @property
    def num_kv_blocks(self) -> int:
        return self.scheduler.blocks.num_blocks

    @property
    def policy(self) -> str:
        """The scheduling policy in use (the packer's default when none was asked for)."""
        return self.scheduler.config.policy or self.scheduler.packer.default_policy

    @property
    def chunking(self) -> str:
        return self.scheduler.config.chunking

    def stats(self) -> EngineStats:
        """A snapshot of plain counters: safe to take from any thread (a metrics scrape),
        though one taken while a step runs may mix before and after."""
        s, blocks = self.scheduler, self.scheduler.blocks
        waiting, prefilling = s.prefill_counts()
        return EngineStats(
            waiting=waiting,
            prefilling=prefilling,
            running=s.num_decoding,
            swapped=s.num_swapped,
            kv_blocks_used=blocks.num_used,
            kv_blocks_free=blocks.num_free,
            preemptions=s.stats.preemptions,
            prefix_query_tokens=s.stats.prefix_query_tokens,
            prefix_hit_tokens=s.stats.prefix_hit_tokens,
            prefix_host_hit_tokens=s.stats.prefix_host_hit_tokens,
        )

    # ---- one iteration -----------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        """Run one batch; the outputs of its requests, and of any that failed on their own.
        Under async scheduling: launch one batch and return the outputs of the one before."""
        if self.governor is not None:
            self.governor.tick()
        # schedule -> run -> postprocess, one batch at a time, async or pipelined
        outputs = self.step_mode.step()
        return self.isolation.take_failed() + self.pauses.take() + outputs

    def execute(self, batch, all_logits: bool = False) -> tuple[torch.Tensor, list]:
        """Run one batch through every rank and stage now (no overlap with other batches):
        (logits, sampling chunks) as ModelRunner.execute. The profiler and tests use it."""
        if self.pipeline is None:
            return self.runner.execute(batch, all_logits)
        step, chunks = self.runner.prepare(batch, all_logits)
        self.step_mode.launch(step)
        return self.step_mode.collect(batch, step), chunks


def resolve_async_scheduling(config: EngineConfig, device: torch.device, one_process: bool) -> bool:
    """--async-scheduling as given, else on where the model runs asynchronously to the host
    (CUDA) in one process. Refused with worker processes (their steps go in lockstep)."""
    if config.async_scheduling is None:
        return device.type == "cuda" and one_process
    if config.async_scheduling and not one_process:
        raise EngineError("async_scheduling runs in one process, not with tp/spp/kvp > 1")
    return config.async_scheduling


def check_prompt(ids: list[int] | None, max_model_len: int, vocab_size: int) -> None:
    """Refuse (InvalidRequestError naming `prompt`) an empty prompt, one longer than the
    context, and ids outside the vocabulary."""
    if not ids:
        raise InvalidRequestError("prompt must not be empty", "prompt")
    if len(ids) > max_model_len:  # before looking at each id
        raise InvalidRequestError(
            f"prompt is {len(ids)} tokens long; the model's context is {max_model_len} tokens",
            "prompt",
        )
    if (
        not all(isinstance(t, int) and not isinstance(t, bool) for t in ids)
        or min(ids) < 0
        or max(ids) >= vocab_size
    ):
        raise InvalidRequestError(
            f"prompt token ids must be integers in [0, {vocab_size})", "prompt"
        )


class EngineMetrics:
    """Measured iteration times beside the predictor's, for profiles and dashboards."""

    def __init__(self) -> None:
        self.iterations = 0
        self.overlapped = 0  # (async scheduling) batches launched while the one before ran
        self.samples: list[tuple[tuple, tuple, float, float]] = []  # prefills, decodes, meas, pred
        self.keep_samples = False

    def record(self, batch, duration: float) -> None:
        self.iterations += 1
        if self.keep_samples:
            self.samples.append((*batch.shape(), duration, batch.predicted_time_s))
