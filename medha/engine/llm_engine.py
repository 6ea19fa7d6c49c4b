"""LLMEngine: the replica scheduler driving a real model.

    engine = LLMEngine(EngineConfig(model="smollm2"))
    engine.add_request("r1", "Hello", SamplingParams(max_tokens=16))
    while engine.has_unfinished():
        for out in engine.step():
            print(out.request_id, out.delta_text, out.finished)

Each `step` schedules one batch with the wall clock as `now`, runs it, samples, and reports the
measured time back to the scheduler (and to `engine.metrics`).

A request that fails on its own (medha/engine/errors.py says which errors those are) comes out
of `step` finished with finish_reason "error" and the message in `error`; the other requests
go on. `step` raises only errors that break the engine.
"""

from __future__ import annotations

import atexit
import collections
import contextlib
import ctypes
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field

import torch

from medha.core.batch import BatchResult
from medha.core.config import SchedulerConfig
from medha.core.request import Request
from medha.engine.checkpoint import check_checkpoint, resolve_model
from medha.engine.config import EngineConfig
from medha.engine.cpu_threads import ThreadGovernor, machine_busy_s, usable_cores
from medha.engine.errors import (
    EngineError,
    InvalidRequestError,
    RequestFailedError,
    blame,
    is_fatal,
)
from medha.engine.kv_swap import HostKVCache, swap_config
from medha.engine.layers.sampler import Sample, sample
from medha.engine.layers.vllm_kernels import resolve_kernels
from medha.engine.model_runner import ModelRunner
from medha.engine.models.llama import LlamaArgs
from medha.engine.parallel.layout import Layout
from medha.engine.sampling_params import SamplingParams
from medha.engine.tokenizer import Detokenizer, Tokenizer
from medha.perf import ParallelConfig, Predictor, hardware_specs, make_predictor
from medha.perf.hardware_specs import cache_dir, get_hardware
from medha.perf.model_specs import model_from_hf_config
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.replica_scheduler import ReplicaScheduler

log = logging.getLogger("medha.engine")

# Forward passes in a row that failed with one request alone in them: past this, the error is not
# that request's (every forward fails) and the engine stops.
MAX_FORWARD_FAILURES = 3


@dataclass
class RequestOutput:
    """What one step did for one request. Per-step fields (`new_token_ids`, `delta_text`,
    `logprobs`) cost the same at any context length: `text` is the detokenizer's string,
    `prompt_token_ids` the request's own list (shared: do not modify it), and `token_ids`,
    every generated token, comes with the final output only (None before)."""

    request_id: str
    new_token_ids: list[int]
    delta_text: str
    text: str
    token_ids: list[int] | None
    finished: bool
    finish_reason: str | None
    prompt_token_ids: list[int]
    logprobs: list[Sample] | None = None  # per new token, when asked for
    metrics: dict | None = None  # TTFT etc. once finished
    error: str | None = None  # why it failed, with finish_reason "error"


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


@dataclass
class _State:
    """What the engine keeps of a request beside the scheduler's Request (which alone holds
    its tokens)."""

    params: SamplingParams
    detok: Detokenizer
    generator: torch.Generator | None
    stop_ids: frozenset[int]
    logprobs: list[Sample] = field(default_factory=list)


def default_profile_path(
    model_path, device: str, dtype: torch.dtype, config: EngineConfig, kernels: str
) -> str:
    """One profile per model, device, dtype, kernels, block size and parallel layout (each
    changes every batch's time: a bf16 step on a CPU takes about half an fp32 one, vLLM's
    kernels run a long prefill's attention twice as fast, and 2.6x faster again in blocks of 32
    than of 16 on AMX; a tp 2 batch adds all-reduces). `config` is resolved (resolve_engine)."""
    name = os.path.basename(os.path.normpath(str(model_path)))
    layout = "".join(
        f"-{k}{v}"
        for k, v in (("tp", config.tp), ("spp", config.spp), ("kvp", config.kvp))
        if v > 1
    )
    dtype_name = str(dtype).removeprefix("torch.")
    tag = "-vllmkernels" if kernels == "vllm" else ""
    if config.block_size != default_block_size(kernels):
        tag += f"-block{config.block_size}"
    return str(cache_dir() / "profiles" / f"{name}-{device}-{dtype_name}{tag}{layout}.json")


def default_block_size(kernels: str) -> int:
    """Tokens per KV block when --block-size is not given: 32 on vLLM's kernels, whose fast
    attention (AMX tiles, or AVX-512 over whole blocks) needs a multiple of 32 and falls back
    to a 16-wide vector kernel otherwise (SmolLM2 in bf16 on a 2-core Sapphire Rapids: a
    6,000-token prefill 7.29 s in blocks of 16, 2.76 s in blocks of 32); 16 on torch's ops."""
    return 32 if kernels == "vllm" else 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EngineError("device cuda requested, but torch sees no CUDA device")
    if name not in ("cpu", "cuda"):
        raise EngineError(f"device must be cpu, cuda or auto, got {name!r}")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # a decode step reads every weight: bf16 halves the bytes, and where the CPU
        # computes in bf16 natively its kernels run ~2x faster than fp32 (SmolLM2's lone
        # decode 37 -> 18 ms on an AVX512-BF16 EPYC). Elsewhere bf16 would be emulated
        # (not measured), so fp32 stays those CPUs' default
        if device.type == "cpu" and not hardware_specs.cpu_has_bf16():
            return torch.float32
        return torch.bfloat16
    table = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
    if name not in table:
        raise EngineError(f"dtype must be one of {', '.join(table)} or auto, got {name!r}")
    return table[name]


def resolve_engine(config: EngineConfig):
    """(device, dtype, model path, its config.json, kernels, config with the block size
    filled in) of an engine of `config`, each checked and resolved from auto the way the engine
    itself does."""
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, device)
    path = resolve_model(config.model)
    hf_config = check_checkpoint(path)
    head_dim = LlamaArgs.from_config(hf_config).head_dim
    kernels = resolve_kernels(config.kernels, device, dtype, config.kvp, head_dim)
    if config.block_size is None:
        config = dataclasses.replace(config, block_size=default_block_size(kernels))
    elif not (isinstance(config.block_size, int) and 1 <= config.block_size <= 1 << 16):
        raise EngineError(f"block_size must be an integer in [1, 65536], got {config.block_size!r}")
    return device, dtype, path, hf_config, kernels, config


def profile_path_for(config: EngineConfig) -> str:
    """The profile an engine of `config` plans with by default (`predictor: auto`)."""
    device, dtype, path, _, kernels, config = resolve_engine(config)
    return default_profile_path(path, device.type, dtype, config, kernels)


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the OS: every iteration
    allocates activations of several megabytes, and fresh pages cost page faults (about 10%
    of a long prefill on CPU). A no-op where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


class LLMEngine:
    def __init__(
        self, config: EngineConfig | None = None, scheduler: SchedulerConfig | None = None
    ) -> None:
        config = config or EngineConfig()
        _keep_freed_memory()
        if config.threads:
            torch.set_num_threads(config.threads)
        self.device, self.dtype, self.model_path, hf_config, self.kernels, config = resolve_engine(
            config
        )
        self.config = config  # resolved: block_size filled in
        self.tokenizer = Tokenizer(self.model_path)
        kv_per_token = ModelRunner.kv_bytes_per_token(hf_config, self.dtype)
        if not config.kv_memory_gb > 0:
            raise EngineError(f"kv_memory_gb must be positive, got {config.kv_memory_gb!r}")
        num_blocks = int(config.kv_memory_gb * 2**30 // (kv_per_token * config.block_size))
        if num_blocks < 1:
            raise EngineError(f"kv_memory_gb={config.kv_memory_gb} holds no KV block")
        # swap preemption: the host pool in blocks of this KV dtype (refused with workers)
        scheduler = swap_config(
            scheduler or SchedulerConfig(),
            {"tp": config.tp, "spp": config.spp, "kvp": config.kvp},
            kv_per_token,
            config.block_size,
        )
        self.workers = self._workers(config, hf_config, num_blocks)
        parallel = {} if self.workers is None else dict(self.workers.roles)
        self.pipeline = self.workers and self.workers.pipeline
        if self.workers is not None and self.pipeline is None:
            parallel["workers"] = self.workers  # no stages: every step is broadcast first
        self.runner = ModelRunner(
            self.model_path,
            hf_config,
            self.device,
            self.dtype,
            num_blocks,
            config.block_size,
            kernels=self.kernels,
            **parallel,
        )
        self._inflight: collections.deque = collections.deque()  # pipelined batches
        self.spec = model_from_hf_config(os.path.basename(str(self.model_path)), hf_config)
        self.predictor = self._predictor(config.predictor)
        if scheduler.max_model_len is None:
            scheduler = dataclasses.replace(scheduler, max_model_len=self.spec.max_context)
        blocks = BlockManager.for_layout(num_blocks, config.block_size, self.predictor.parallel)
        self.scheduler = ReplicaScheduler(scheduler, self.predictor, blocks)
        self.kv_swap = HostKVCache.for_engine(scheduler, self.runner)  # None: recompute only
        self.host_cache = HostKVCache.cache_tier(scheduler, self.runner)  # None: no host tier
        self._states: dict[str, _State] = {}
        self._failed: list[RequestOutput] = []  # requests that failed since the last step
        self._forward_failures = 0  # single-request forward failures in a row
        self.metrics = EngineMetrics()
        self.governor = self._governor(config)

    # ---- set-up ------------------------------------------------------------------------------
    def _workers(self, config: EngineConfig, hf_config: dict, num_blocks: int):
        for name in ("tp", "spp", "kvp", "max_tokens_per_kvp_group"):
            value = getattr(config, name)
            if not (isinstance(value, int) and value >= 1):
                raise EngineError(f"{name} must be a positive integer, got {value!r}")
        if config.max_tokens_per_kvp_group % config.block_size:
            raise EngineError(
                f"max_tokens_per_kvp_group ({config.max_tokens_per_kvp_group}) "
                f"must be a multiple of block_size ({config.block_size})"
            )
        layout = Layout(config.tp, config.spp, config.kvp)
        if layout.world == 1:
            return None
        if self.device.type != "cpu":
            raise EngineError("tp/spp/kvp > 1 run on CPU (gloo) so far; NCCL on CUDA is not built")
        args = LlamaArgs.from_config(hf_config)
        if config.tp > args.num_kv_heads:
            raise EngineError(f"tp={config.tp} exceeds the model's {args.num_kv_heads} KV heads")
        if config.spp > args.num_layers:
            raise EngineError(f"spp={config.spp} exceeds the model's {args.num_layers} layers")
        from medha.engine.parallel.workers import RunnerArgs, WorkerGroup

        group = WorkerGroup(
            layout,
            RunnerArgs(
                self.model_path,
                hf_config,
                self.dtype,
                num_blocks,
                config.block_size,
                self.kernels,
            ),
        )
        atexit.register(group.close)
        return group

    def _governor(self, config: EngineConfig) -> ThreadGovernor | None:
        """Fits the thread count to the free cores, unless --threads fixed it (or the model
        runs on a GPU, or in worker processes that each hold a share of the cores)."""
        if config.threads or self.device.type != "cpu" or self.workers is not None:
            return None
        if machine_busy_s() is None:
            return None
        return ThreadGovernor(torch.get_num_threads(), usable_cores())

    def close(self) -> None:
        """Stop the worker processes, if any (also done at interpreter exit)."""
        if self.workers is not None:
            self.workers.close()

    @property
    def profile_path(self) -> str:
        """Where `medha profile` writes this engine's profile and `predictor: auto` reads it."""
        return default_profile_path(
            self.model_path, self.device.type, self.dtype, self.config, self.kernels
        )

    def _predictor(self, spec: str) -> Predictor:
        hardware = (
            get_hardware("cpu")
            if self.device.type == "cpu"
            else _gpu_spec(torch.cuda.get_device_name())
        )
        # the roofline reads weights and KV in the engine's dtype
        hardware = dataclasses.replace(hardware, dtype_bytes=self.dtype.itemsize)
        if spec == "auto":
            path = self.profile_path
            spec = f"profiled:{path}" if os.path.exists(path) else "roofline"
        # tp stays 1: a profile of a tp layout times whole iterations, all-reduces included
        parallel = ParallelConfig(
            spp=self.config.spp,
            kvp=self.config.kvp,
            max_tokens_per_kvp_group=self.config.max_tokens_per_kvp_group,
        )
        return make_predictor(spec, self.spec, hardware, parallel)

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
        state = self._new_state(params)
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

    def _new_state(self, params: SamplingParams) -> _State:
        generator = None
        if not params.greedy:
            generator = torch.Generator()
            generator.manual_seed(params.seed if params.seed is not None else torch.seed() % 2**63)
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        return _State(
            params, Detokenizer(self.tokenizer, params.stop), generator, frozenset(stop_ids)
        )

    def abort(self, request_id: str) -> bool:
        self._states.pop(request_id, None)
        return self.scheduler.abort(request_id, time.monotonic()) is not None

    def _fail(self, request_id: str, error: RequestFailedError) -> None:
        """End one request with an error; the others go on."""
        log.warning("%s", error)
        state = self._states.pop(request_id, None)
        request = self.scheduler.abort(request_id, time.monotonic(), reason="error")
        self._failed.append(
            RequestOutput(
                request_id=request_id,
                new_token_ids=[],
                delta_text="",
                text=state.detok.text if state else "",
                token_ids=list(request.output_token_ids) if request else [],
                finished=True,
                finish_reason="error",
                prompt_token_ids=request.prompt_token_ids if request else [],
                error=error.detail,
            )
        )

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

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
        """Run one batch; the outputs of its requests, and of any that failed on their own."""
        if self.governor is not None:
            self.governor.tick()
        outputs = self._pipelined_step() if self.pipeline is not None else self._step()
        if self._failed:
            outputs, self._failed = self._failed + outputs, []
        return outputs

    def _step(self) -> list[RequestOutput]:
        batch = self.scheduler.schedule(time.monotonic())
        if batch is None:
            return []
        t0 = time.perf_counter()
        with self._discarding_on_error(batch):
            self._move_kv(batch)
            if not batch.num_seqs:  # the batch only moved KV
                self.scheduler.update(
                    batch, BatchResult(time.perf_counter() - t0), time.monotonic()
                )
                return []
            logits, chunks = self._run_isolated(batch)
        return self._finish(batch, chunks, logits, t0)

    def _move_kv(self, batch) -> None:
        """The batch's KV copies, before its step runs, in the order Batch gives."""
        if batch.cache_out:
            self.host_cache.swap_out(
                [d for d, _ in batch.cache_out], [h for _, h in batch.cache_out]
            )
        if self.kv_swap is not None:
            self.kv_swap.apply(batch)
        if batch.cache_in:
            self.host_cache.swap_in([h for h, _ in batch.cache_in], [d for _, d in batch.cache_in])

    def _pipelined_step(self) -> list[RequestOutput]:
        """Fill the pipeline (a new batch as soon as stage 1 is free, i.e. after this
        process ran its stage 0), then finish the oldest batch in flight."""
        while len(self._inflight) < self.config.spp:
            batch = self.scheduler.schedule(time.monotonic())
            if batch is None:
                break
            t0 = time.perf_counter()
            with self._discarding_on_error(batch):
                step, chunks = self._prepared(batch)
                if step is not None:
                    self._launch(step)
            self._inflight.append((batch, step, chunks, t0))
        if not self._inflight:
            return []
        batch, step, chunks, t0 = self._inflight.popleft()
        with self._discarding_on_error(batch):
            logits = self._no_logits() if step is None else self._collect(batch, step)
        return self._finish(batch, chunks, logits, t0)

    def _prepared(self, batch):
        """(StepInput, sampling chunks) of the batch's requests whose inputs can be built:
        a request whose inputs fail ends, and the step is built without it. (None, []) when
        no request is left."""
        while True:
            if not batch.num_seqs:
                return None, []
            try:
                return self.runner.prepare(batch)
            except RequestFailedError as e:
                self._fail(e.request_id, e)
                batch = _without(batch, e.request_id)

    def _run_isolated(self, batch) -> tuple[torch.Tensor, list]:
        """(logits, sampling chunks) of the batch, without the requests that fail on their
        own. In one process a failing forward pass is run again in halves, down to the request
        it fails with; with worker processes it is fatal (their collectives are out of step).
        """
        step, chunks = self._prepared(batch)
        if step is None:
            return self._no_logits(), []
        try:
            if self.workers is not None:
                self.workers.broadcast(step)
            logits = self.runner.run(step)
        except Exception as e:
            if is_fatal(e) or self.workers is not None:
                raise
            return self._bisect(batch, e)
        self._forward_failures = 0
        return logits, chunks

    def _bisect(self, batch, error: Exception) -> tuple[torch.Tensor, list]:
        members = [
            c.request.request_id
            for c in (*batch.decodes, *batch.prefills)
            if c.request.request_id in self._states
        ]
        if len(members) == 1:
            self._forward_failures += 1
            if self._forward_failures > MAX_FORWARD_FAILURES:
                raise error  # every forward fails: not this request's doing
            self._fail(members[0], RequestFailedError(members[0], error))
            return self._no_logits(), []
        half = set(members[: len(members) // 2])
        parts = [
            self._run_isolated(_keeping(batch, half)),
            self._run_isolated(_keeping(batch, set(members) - half)),
        ]
        if all(m not in self._states for m in members):
            raise error  # it failed with each request alone: not any one request's doing
        return torch.cat([p[0] for p in parts]), parts[0][1] + parts[1][1]

    def _no_logits(self) -> torch.Tensor:
        return torch.empty(0, self.runner.args.vocab_size)

    def _launch(self, step) -> None:
        """Run stage 0 here and send the step into the pipeline."""
        self.pipeline.launch(step, lambda: self.runner.forward(step))

    def _collect(self, batch, step) -> torch.Tensor:
        """The logits of the oldest batch in the pipeline, once its last stage is done."""
        return self.runner.logits(step, self.pipeline.result(batch.batch_id, step.ids.numel()))

    def execute(self, batch, all_logits: bool = False) -> tuple[torch.Tensor, list]:
        """Run one batch through every rank and stage now (no overlap with other batches):
        (logits, sampling chunks) as ModelRunner.execute. The profiler and tests use it."""
        if self.pipeline is None:
            return self.runner.execute(batch, all_logits)
        step, chunks = self.runner.prepare(batch, all_logits)
        self._launch(step)
        return self._collect(batch, step), chunks

    @contextlib.contextmanager
    def _discarding_on_error(self, batch):
        try:
            yield
        except BaseException:
            # the batch's requests cannot continue (their KV is in an unknown state): end them
            # and give their blocks back before the error goes up
            for r in self.scheduler.discard(batch, time.monotonic()):
                self._states.pop(r.request_id, None)
            raise

    def _finish(self, batch, chunks, logits: torch.Tensor, t0: float) -> list[RequestOutput]:
        """Sample the batch's next tokens and hand its result to the scheduler."""
        keep = [i for i, c in enumerate(chunks) if c.request.request_id in self._states]
        if len(keep) < len(chunks):  # aborted or failed while its batch ran
            chunks, logits = [chunks[i] for i in keep], logits[keep]
        with self._discarding_on_error(batch):
            rids = [c.request.request_id for c in chunks]
            states = [self._states[rid] for rid in rids]
            samples = sample(
                logits, [s.params for s in states], [s.generator for s in states], rids
            )
        duration = time.perf_counter() - t0
        token_ids, stopped, deltas, sampled = {}, set(), {}, []
        for c, s, smp in zip(chunks, states, samples):
            rid = c.request.request_id
            try:
                if isinstance(smp, RequestFailedError):
                    raise smp
                with blame(rid):
                    deltas[rid], stop = self._append(s, smp)
            except RequestFailedError as e:
                self._fail(rid, e)
                continue
            token_ids[rid] = smp.token
            if stop:
                stopped.add(rid)
            sampled.append((c, s, smp))
        self.metrics.record(batch, duration)
        finished = self.scheduler.update(
            batch, BatchResult(duration, token_ids, frozenset(stopped)), time.monotonic()
        )
        done = {r.request_id: r for r in finished}
        outputs = []
        for c, s, smp in sampled:
            r = c.request
            end = done.get(r.request_id)
            delta = deltas[r.request_id]
            if end is not None and end.finish_reason == "length":
                delta += s.detok.flush()
            outputs.append(
                RequestOutput(
                    request_id=r.request_id,
                    new_token_ids=[smp.token],
                    delta_text=delta,
                    text=s.detok.text,
                    token_ids=list(r.output_token_ids) if end else None,
                    finished=end is not None,
                    finish_reason=end.finish_reason if end else None,
                    prompt_token_ids=r.prompt_token_ids,
                    logprobs=[smp] if s.params.logprobs is not None else None,
                    metrics=_request_metrics(end) if end else None,
                )
            )
            if end is not None:
                del self._states[r.request_id]
        return outputs

    @staticmethod
    def _append(s: _State, smp: Sample) -> tuple[str, bool]:
        """Add a sampled token to a request's output (the scheduler adds it to its tokens):
        (the text it makes safe to emit, whether it ends the request)."""
        if s.params.logprobs is not None:
            s.logprobs.append(smp)
        if smp.token in s.stop_ids:
            return s.detok.flush(), True
        delta = s.detok.add(smp.token)
        return delta, s.detok.stopped


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


def _without(batch, request_id: str):
    """The batch without one request's chunk (what the runner reads: decodes, prefills)."""
    return _keeping(
        batch, {c.request.request_id for c in (*batch.decodes, *batch.prefills)} - {request_id}
    )


def _keeping(batch, request_ids: set[str]):
    return dataclasses.replace(
        batch,
        decodes=[c for c in batch.decodes if c.request.request_id in request_ids],
        prefills=[c for c in batch.prefills if c.request.request_id in request_ids],
    )


def _request_metrics(r: Request) -> dict:
    t = r.token_times_s
    return {
        "ttft_s": t[0] - r.arrival_s,
        "e2e_s": r.finish_s - r.arrival_s,
        "tpot_s": (t[-1] - t[0]) / (len(t) - 1) if len(t) > 1 else None,
        "preemptions": r.num_preemptions,
        "prompt_tokens": r.prompt_len,
        "cached_prompt_tokens": r.num_cached_tokens,
        "completion_tokens": r.num_output_tokens,
    }


def _gpu_spec(name: str):
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return get_hardware(key)
    return get_hardware("a100")


class EngineMetrics:
    """Measured iteration times beside the predictor's, for profiles and dashboards."""

    def __init__(self) -> None:
        self.iterations = 0
        self.busy_s = 0.0
        self.samples: list[tuple[tuple, tuple, float, float]] = []  # prefills, decodes, meas, pred
        self.keep_samples = False

    def record(self, batch, duration: float) -> None:
        self.iterations += 1
        self.busy_s += duration
        if self.keep_samples:
            self.samples.append(
                (
                    tuple((c.num_tokens, c.start) for c in batch.prefills),
                    tuple(c.start for c in batch.decodes),
                    duration,
                    batch.predicted_time_s,
                )
            )

    def to_json(self) -> str:
        return json.dumps({"iterations": self.iterations, "busy_s": self.busy_s})
