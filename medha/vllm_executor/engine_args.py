"""medha's engine and scheduler flags as vLLM engine arguments (`--engine vllm`).

`medha serve --engine vllm` and `medha profile --engine vllm` take medha's own flags; this
module says what each means on vLLM's engine, refuses what vLLM cannot do (SPP, KVP) by name,
and adds the `--vllm-arg KEY=VALUE` pass-through for everything else of vLLM's `EngineArgs`.
"""

from __future__ import annotations

import dataclasses
import json
import os

from medha.engine.config import EngineConfig
from medha.scheduler.config import SchedulerConfig
from medha.utils.dataclass_cli import to_flat

SCHEDULER_CLS = "medha.vllm_executor.MedhaScheduler"

# medha's flag -> the vLLM engine argument that owns it (vLLM's model runner is sized by them)
_OWNED_BY_VLLM = {
    "max_model_len": "max_model_len",
    "max_num_seqs": "max_num_seqs",
    "max_batch_tokens": "max_num_batched_tokens",
}
# set by medha from its own flags: a --vllm-arg for them would contradict a medha flag
_SET_BY_MEDHA = (
    "model",
    "dtype",
    "kv_cache_memory_bytes",
    "block_size",
    "tensor_parallel_size",
    "scheduler_cls",
    "additional_config",
    *_OWNED_BY_VLLM.values(),
)


def parse_vllm_args(pairs: list[str] | None) -> dict:
    """`--vllm-arg KEY=VALUE` pairs as keyword arguments: VALUE is JSON when it parses (true,
    8192, {"level": 0}), a string otherwise. Keys are vLLM's `EngineArgs` fields (dashes or
    underscores); an unknown one, or one a medha flag sets, is a ValueError naming it."""
    from vllm.engine.arg_utils import EngineArgs

    known = {f.name for f in dataclasses.fields(EngineArgs)}
    out: dict = {}
    for pair in pairs or ():
        key, sep, value = pair.partition("=")
        key = key.strip().replace("-", "_")
        if not sep or not key:
            raise ValueError(f"--vllm-arg {pair!r}: expected KEY=VALUE")
        if key not in known:
            raise ValueError(f"--vllm-arg {key}: not one of vLLM's engine arguments (EngineArgs)")
        if key in _SET_BY_MEDHA:
            raise ValueError(
                f"--vllm-arg {key}: set by medha's own flags (--model, --dtype, --kv-memory-gb, "
                "--block-size, --tp, --max-model-len, --max-num-seqs, --max-batch-tokens and "
                "the scheduler flags)"
            )
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def vllm_engine_args(
    engine: EngineConfig, scheduler: SchedulerConfig, extra: dict | None = None
) -> dict:
    """Keyword arguments for vLLM's `EngineArgs` (or `vllm.LLM`) running medha's scheduler.

    What each medha flag becomes: --model (the embedded `smollm2` is its converted checkpoint
    directory), --dtype (auto: vLLM's choice, but float32 on a CPU without bf16 instructions, as on
    medha's engine: `vllm_dtype_arg`), --kv-memory-gb
    (vLLM's kv_cache_memory_bytes), --block-size (vLLM's own choice while it is medha's default:
    vLLM's CPU attention refuses 16, it takes multiples of 32), --tp (tensor_parallel_size),
    --predictor, --calibrate and the scheduler flags (the `medha` object of additional_config,
    read by MedhaScheduler), --prefix-cache (vLLM's enable_prefix_caching: off or device; left out,
    vLLM's default, on),
    --max-model-len / --max-num-seqs / --max-batch-tokens (vLLM's own limits). --threads sets
    the CPU cores vLLM binds its OpenMP threads to (VLLM_CPU_OMP_THREADS_BIND, in this
    process's environment). --spp and --kvp are medha's engine's alone."""
    from medha.engine.checkpoint import EMBEDDED, embedded_smollm2
    from medha.engine.errors import EngineError
    from medha.vllm_executor.settings import vllm_dtype_arg

    if engine.spp != 1 or engine.kvp != 1:
        raise ValueError(
            "--spp and --kvp run on medha's own engine only (vLLM has no stream-pipeline or "
            "KV-cache parallelism): drop them, or use --engine medha"
        )
    if engine.model.lower() in EMBEDDED:
        model = str(embedded_smollm2())
    else:
        model = os.path.expanduser(engine.model)
        if not os.path.isdir(model):
            raise EngineError(f"model {engine.model!r}: no such directory")
    defaults = to_flat(SchedulerConfig())
    medha = {
        name: value
        for name, value in to_flat(scheduler).items()
        if name not in _OWNED_BY_VLLM and name != "prefix_cache" and value != defaults[name]
    }
    medha["predictor"] = engine.predictor
    medha["calibrate"] = engine.calibrate  # resolved: --calibrate, else $MEDHA_CALIBRATE
    args = {
        "model": model,
        "dtype": vllm_dtype_arg(engine.dtype),
        "kv_cache_memory_bytes": int(engine.kv_memory_gb * (1 << 30)),
        "tensor_parallel_size": engine.tp,
        "scheduler_cls": SCHEDULER_CLS,
        "additional_config": {"medha": medha},
    }
    if engine.block_size is not None:  # not given: vLLM's own choice
        args["block_size"] = engine.block_size
    for ours, theirs in _OWNED_BY_VLLM.items():
        value = getattr(scheduler, ours)
        if value is not None:
            args[theirs] = value
    # The prefix cache on vLLM is vLLM's own (its KV cache manager's, which caches generated
    # blocks too; medha's scheduler follows its hits): on by vLLM's default, as on medha's
    # engine, and --prefix-cache off or device turn it off or on. vLLM has no host tier.
    mode = scheduler.prefix_cache
    if mode == "device+host":
        raise ValueError(
            "--prefix-cache device+host: vLLM's prefix cache has no host tier here; use device "
            "(vLLM's own cache, the default) or off"
        )
    if mode is not None:
        asked = (extra or {}).get("enable_prefix_caching")
        if asked is not None and asked != (mode == "device"):
            raise ValueError(
                f"--prefix-cache {mode} contradicts --vllm-arg enable_prefix_caching={asked}"
            )
        args["enable_prefix_caching"] = mode == "device"
    if engine.threads is not None:  # at least 1: EngineConfig checked it
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = f"0-{engine.threads - 1}"
    args.update(extra or {})
    return args
