"""An engine's set-up, resolved once from its EngineConfig.

    setup = EngineSetup.resolve(config)   # device, dtype, checkpoint, kernels, KV blocks
    scheduler = setup.scheduler_config(scheduler)
    workers = setup.start_workers()       # None in one process
    runner = setup.model_runner(workers)
    predictor = setup.predictor()

`resolve` checks what needs torch or the checkpoint (EngineConfig checked the rest when it was
made) and settles every `auto`; the methods build what the engine runs with from it, in the
order above. `profile_path(config)` names the profile an engine of `config` plans with without
starting one.
"""

from __future__ import annotations

import atexit
import ctypes
import dataclasses
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from medha.engine.checkpoint import check_checkpoint, resolve_model
from medha.engine.config import EngineConfig, resolve_start_probe
from medha.engine.cpu_threads import ThreadGovernor, machine_busy_s, usable_cores
from medha.engine.errors import EngineError
from medha.engine.host_kv import size_host_memory
from medha.engine.layers.vllm_kernels import resolve_kernels
from medha.engine.model_runner import ModelRunner
from medha.engine.models.llama import LlamaArgs
from medha.engine.parallel.layout import Layout
from medha.perf import ParallelConfig, Predictor, hardware_specs, make_predictor
from medha.perf.hardware_specs import cache_dir, get_hardware
from medha.perf.model_specs import ModelSpec, model_from_hf_config
from medha.scheduler.config import SchedulerConfig

if TYPE_CHECKING:
    from pathlib import Path

    from medha.engine.parallel.workers import WorkerGroup


@dataclass(frozen=True)
class EngineSetup:
    config: EngineConfig  # as given, with the block size filled in
    device: torch.device
    dtype: torch.dtype
    model_path: Path
    hf_config: dict  # the checkpoint's config.json, checked
    kernels: str  # torch or vllm
    parallel: ParallelConfig  # tp x spp x kvp, and the tokens a KVP group holds
    spec: ModelSpec
    kv_bytes_per_token: int
    num_blocks: int  # KV blocks of each KVP group

    @classmethod
    def resolve(cls, config: EngineConfig) -> EngineSetup:
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        path = resolve_model(config.model)
        hf_config = check_checkpoint(path)
        head_dim = LlamaArgs.from_config(hf_config).head_dim
        kernels = resolve_kernels(config.kernels, device, dtype, config.kvp, head_dim)
        if config.block_size is None:
            config = dataclasses.replace(config, block_size=default_block_size(kernels))
        if config.max_tokens_per_kvp_group % config.block_size:
            raise EngineError(
                f"max_tokens_per_kvp_group ({config.max_tokens_per_kvp_group}) "
                f"must be a multiple of block_size ({config.block_size})"
            )
        kv_bytes_per_token = ModelRunner.kv_bytes_per_token(hf_config, dtype)
        num_blocks = int(config.kv_memory_gb * 2**30 // (kv_bytes_per_token * config.block_size))
        if num_blocks < 1:
            raise EngineError(f"kv_memory_gb={config.kv_memory_gb} holds no KV block")
        return cls(
            config=config,
            device=device,
            dtype=dtype,
            model_path=path,
            hf_config=hf_config,
            kernels=kernels,
            parallel=ParallelConfig(
                tp=config.tp,
                spp=config.spp,
                kvp=config.kvp,
                max_tokens_per_kvp_group=config.max_tokens_per_kvp_group,
            ),
            spec=model_from_hf_config(os.path.basename(str(path)), hf_config),
            kv_bytes_per_token=kv_bytes_per_token,
            num_blocks=num_blocks,
        )

    @property
    def profile_path(self) -> str:
        """One profile per model, device, dtype, kernels, block size and parallel layout: each
        changes every batch's time (bf16 against fp32, vLLM's kernels against torch's ops and,
        on vLLM's kernels, the block size; a tp batch adds all-reduces)."""
        name = os.path.basename(os.path.normpath(str(self.model_path)))
        p = self.parallel
        layout = "".join(
            f"-{k}{v}" for k, v in (("tp", p.tp), ("spp", p.spp), ("kvp", p.kvp)) if v > 1
        )
        dtype_name = str(self.dtype).removeprefix("torch.")
        tag = "-vllmkernels" if self.kernels == "vllm" else ""
        if self.config.block_size != default_block_size(self.kernels):
            tag += f"-block{self.config.block_size}"
        file = f"{name}-{self.device.type}-{dtype_name}{tag}{layout}.json"
        return str(cache_dir() / "profiles" / file)

    def scheduler_config(self, scheduler: SchedulerConfig) -> SchedulerConfig:
        """`scheduler` sized for this engine: host memory in blocks of its KV dtype, and the
        model's context as max_model_len unless one was given."""
        scheduler = size_host_memory(
            scheduler, self.parallel, self.kv_bytes_per_token, self.config.block_size
        )
        if scheduler.max_model_len is None:
            scheduler = dataclasses.replace(scheduler, max_model_len=self.spec.max_context)
        return scheduler

    def start_workers(self) -> WorkerGroup | None:
        """The processes of ranks 1 and up of the layout (None: one process runs the model)."""
        p = self.parallel
        layout = Layout(p.tp, p.spp, p.kvp)
        if layout.world == 1:
            return None
        if self.device.type != "cpu":
            raise EngineError("tp/spp/kvp > 1 run on CPU (gloo) so far; NCCL on CUDA is not built")
        args = LlamaArgs.from_config(self.hf_config)
        if p.tp > args.num_kv_heads:
            raise EngineError(f"tp={p.tp} exceeds the model's {args.num_kv_heads} KV heads")
        if p.spp > args.num_layers:
            raise EngineError(f"spp={p.spp} exceeds the model's {args.num_layers} layers")
        from medha.engine.parallel.workers import RunnerArgs, WorkerGroup

        group = WorkerGroup(
            layout,
            RunnerArgs(
                self.model_path,
                self.hf_config,
                self.dtype,
                self.num_blocks,
                self.config.block_size,
                self.kernels,
            ),
        )
        atexit.register(group.close)
        return group

    def model_runner(self, workers: WorkerGroup | None) -> ModelRunner:
        """Rank 0's runner: with workers, its share of the layout."""
        parallel = {} if workers is None else dict(workers.roles)
        if workers is not None and workers.pipeline is None:
            parallel["workers"] = workers  # no stages: every step is broadcast first
        return ModelRunner(
            self.model_path,
            self.hf_config,
            self.device,
            self.dtype,
            self.num_blocks,
            self.config.block_size,
            kernels=self.kernels,
            **parallel,
        )

    def predictor(self) -> Predictor:
        hardware = (
            get_hardware("cpu")
            if self.device.type == "cpu"
            else gpu_spec(torch.cuda.get_device_name())
        )
        # the roofline reads weights and KV in the engine's dtype
        hardware = dataclasses.replace(hardware, dtype_bytes=self.dtype.itemsize)
        spec = self.config.predictor
        if spec == "auto":
            path = self.profile_path
            spec = f"profiled:{path}" if os.path.exists(path) else "roofline"
        # tp stays 1: a profile of a tp layout times whole iterations, all-reduces included
        return make_predictor(spec, self.spec, hardware, dataclasses.replace(self.parallel, tp=1))

    def self_profile_due(self) -> bool:
        """Whether the engine times itself before serving: --predictor auto, no profile of it
        at `profile_path`, and --self-profile-s above 0."""
        return (
            self.config.predictor == "auto"
            and self.config.self_profile_s > 0
            and not os.path.exists(self.profile_path)
        )

    def start_probe_due(self) -> bool:
        """Whether the engine times the online correction's probe shapes before serving:
        --start-probe, --predictor auto and no profile of it at `profile_path` (it plans from
        the roofline)."""
        return (
            resolve_start_probe(self.config.start_probe)  # None: on (LLM turns it off)
            and self.config.predictor == "auto"
            and not os.path.exists(self.profile_path)
        )

    def governor(self, workers: WorkerGroup | None) -> ThreadGovernor | None:
        """Fits the thread count to the free cores, unless --threads fixed it (or the model
        runs on a GPU, or in worker processes that each hold a share of the cores)."""
        if self.config.threads or self.device.type != "cpu" or workers is not None:
            return None
        if machine_busy_s() is None:
            return None
        return ThreadGovernor(torch.get_num_threads(), usable_cores())


def profile_path(config: EngineConfig) -> str:
    """The profile an engine of `config` plans with by default (`predictor: auto`)."""
    return EngineSetup.resolve(config).profile_path


def tune_process(config: EngineConfig) -> None:
    """What an engine changes in its process before anything loads: the allocator, and the
    thread count when --threads gives one."""
    _keep_freed_memory()
    if config.threads is not None:
        torch.set_num_threads(config.threads)


def default_block_size(kernels: str) -> int:
    """Tokens per KV block when --block-size is not given: 32 on vLLM's kernels, whose fast
    attention (AMX tiles, or AVX-512 over whole blocks) needs a multiple of 32 and falls back
    to a much slower 16-wide vector kernel otherwise (docs/engine.md); 16 on torch's ops."""
    return 32 if kernels == "vllm" else 16


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise EngineError("device cuda requested, but torch sees no CUDA device")
    return torch.device(name)


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        # a decode step reads every weight: bf16 halves the bytes, and where the CPU computes
        # in bf16 natively its kernels run much faster than fp32's (docs/engine.md, "dtype").
        # Elsewhere bf16 is emulated (vLLM there: 1.75x slower, cpu_serving_dtype), so fp32
        # stays those CPUs' default
        if device.type == "cpu" and hardware_specs.cpu_serving_dtype(name) == "float32":
            return torch.float32
        return torch.bfloat16
    return getattr(torch, name)  # one of EngineConfig's DTYPES, which it checked


def _keep_freed_memory() -> None:
    """Ask glibc to keep freed memory instead of returning it to the OS: every iteration
    allocates activations of several megabytes, and fresh pages cost page faults (a noticeable
    share of a long prefill on CPU, docs/engine.md). A no-op where glibc is not the allocator."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 1 << 30)
    libc.mallopt(m_trim_threshold, 1 << 31)


def gpu_spec(name: str):
    for key in ("h200", "h100", "a100"):
        if key in name.lower():
            return get_hardware(key)
    return get_hardware("a100")
