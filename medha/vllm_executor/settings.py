"""medha's scheduler settings on vLLM, and the mirror `ReplicaScheduler` built from them.

The settings are medha's `SchedulerConfig` fields (the `medha serve` scheduler flags without
the dashes), passed in vLLM's `--additional-config '{"medha": {...}}'`, plus `predictor`: the
step-time model the packer plans with (`auto`, the default, is this machine's vLLM profile from
`medha profile --engine vllm` when there is one, else the roofline of this hardware), and
`calibrate`: `online` (the default, or $MEDHA_CALIBRATE) corrects that model from every
step's measured time as medha's engine does (medha/perf/online_fit.py), `off` keeps it.

vLLM's own limits win where both have one: max_model_len, max_num_seqs and the tokens per step
(`--max-num-batched-tokens`), since vLLM's model runner is sized by them.
"""

from __future__ import annotations

import os
from pathlib import Path

from medha.engine.config import resolve_calibrate
from medha.perf import ParallelConfig, get_hardware, make_predictor
from medha.perf.hardware_specs import cache_dir, cpu_serving_dtype
from medha.perf.model_specs import model_from_hf_config
from medha.perf.online_fit import CorrectedPredictor, StepLearner
from medha.scheduler.block_manager import BlockManager
from medha.scheduler.config import SchedulerConfig
from medha.scheduler.replica_scheduler import RESOLVE_SLICE_S, ReplicaScheduler
from medha.utils.dataclass_cli import flags

_VLLM_OWNS = ("max_model_len", "max_num_seqs", "max_batch_tokens")
_OTHER_KEYS = ("predictor", "calibrate")


def vllm_profile_path(model: str, device: str, dtype: str, tp: int = 1) -> Path:
    """Where `medha profile --engine vllm` keeps vLLM's step times: one profile per model,
    device, dtype (as vLLM resolved it: `auto` is bfloat16 on a CPU with bf16 instructions)
    and tensor-parallel degree, since each changes every step's time."""
    name = os.path.basename(os.path.normpath(str(model)))
    layout = f"-tp{tp}" if tp > 1 else ""
    return cache_dir() / "profiles" / f"{name}-vllm-{device}-{dtype}{layout}.json"


def vllm_dtype_arg(dtype: str) -> str:
    """What medha passes vLLM as --dtype for medha's `dtype`: on a CPU, as medha serves it there
    (`cpu_serving_dtype`: `auto` is float32 without bf16 instructions); on CUDA as given."""
    import torch

    return dtype if torch.cuda.is_available() else cpu_serving_dtype(dtype)


def vllm_dtype(model_config) -> str:
    """The dtype vLLM runs the model in, by name (`bfloat16`)."""
    return str(model_config.dtype).removeprefix("torch.")


def scheduler_settings(additional_config) -> tuple[dict, str, str]:
    """The `medha` object of vLLM's additional config: (SchedulerConfig fields, predictor,
    calibrate)."""
    settings = dict((additional_config or {}).get("medha") or {})
    known = {f.name for f in flags(SchedulerConfig)}
    unknown = sorted(set(settings) - known - set(_OTHER_KEYS))
    if unknown:
        raise ValueError(
            f"unknown medha setting(s) {', '.join(unknown)} in --additional-config; "
            f"expected SchedulerConfig fields ({', '.join(sorted(known))}), predictor or "
            "calibrate"
        )
    owned = sorted(set(settings) & set(_VLLM_OWNS))
    if owned:
        raise ValueError(
            f"{', '.join(owned)}: set by vLLM's own flags (--max-model-len, --max-num-seqs, "
            "--max-num-batched-tokens), not in the medha settings"
        )
    if settings.get("pause_steps"):
        raise ValueError(
            "pause_steps: vLLM runs every step to its end (steps pause on medha's engine)"
        )
    predictor = settings.pop("predictor", "auto")
    return settings, predictor, resolve_calibrate(settings.pop("calibrate", None))


def build_replica_scheduler(
    vllm_config, kv_cache_config, max_step_tokens: int, async_scheduling: bool = False
) -> ReplicaScheduler:
    fields, predictor_spec, calibrate = scheduler_settings(vllm_config.additional_config)
    model_config = vllm_config.model_config
    device = "cuda" if vllm_config.device_config.device_type == "cuda" else "cpu"
    if predictor_spec == "auto":
        path = vllm_profile_path(
            model_config.model,
            device,
            vllm_dtype(model_config),
            vllm_config.parallel_config.tensor_parallel_size,
        )
        predictor_spec = f"profiled:{path}" if path.exists() else "roofline"
    hf = model_config.hf_config.to_dict()
    spec = model_from_hf_config(os.path.basename(str(model_config.model)), hf)
    # (the roofline of an unnamed GPU is an A100's: the CUDA path is not measured yet)
    hardware = get_hardware("cpu" if device == "cpu" else "a100")
    predictor = make_predictor(
        predictor_spec,
        spec,
        hardware,
        ParallelConfig(tp=vllm_config.parallel_config.tensor_parallel_size),
    )
    config = SchedulerConfig.from_flat(
        **fields,
        max_model_len=model_config.max_model_len,
        max_num_seqs=vllm_config.scheduler_config.max_num_seqs,
        max_batch_tokens=max_step_tokens,
    )
    if config.preemption_mode != "recompute":
        raise ValueError("on vLLM medha preempts by recompute only (preemption_mode recompute)")
    if config.prefix_cache not in (None, "off"):
        raise ValueError(
            "on vLLM the prefix cache is vLLM's own (--enable-prefix-caching, on by default); "
            "medha's scheduler follows its hits: leave prefix_cache out of the medha settings"
        )
    # vLLM keeps one of its blocks aside (the null block): the rest hold requests' KV
    block_size = vllm_config.cache_config.block_size
    blocks = BlockManager(kv_cache_config.num_blocks - 1, block_size)
    learner = None
    if calibrate == "online":  # each step's time, from `schedule` to `update_from_output`
        predictor = CorrectedPredictor(predictor)
        learner = StepLearner(predictor)
    return ReplicaScheduler(
        config,
        predictor,
        blocks,
        block_tables=False,
        learner=learner,
        async_scheduling=async_scheduling,
        # (a re-resolution of the defaults, spread over steps: none waits for a whole one)
        resolve_slice_s=RESOLVE_SLICE_S,
    )
