"""What several commands share: the user-error exception, the model and hardware flags, and
building a predictor, a scheduler config or an engine from parsed flags."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from medha.perf import PREDICTOR_HELP, ParallelConfig, Predictor, make_predictor
from medha.perf.hardware_specs import HARDWARE_NAMES
from medha.perf.model_specs import MODELS
from medha.scheduler.config import SchedulerConfig
from medha.utils.dataclass_cli import add_dataclass_args, dataclass_from_args

if TYPE_CHECKING:
    from medha.engine.llm import LLM


class CliError(Exception):
    """A user error: printed without a traceback, exit code 2."""


def add_platform_args(p: argparse.ArgumentParser, model: str, hardware: str, tp: int = 1) -> None:
    g = p.add_argument_group("model and hardware")
    g.add_argument(
        "--model", default=model, help=f"model spec: {', '.join(sorted(MODELS))} (default: {model})"
    )
    g.add_argument(
        "--hardware",
        default=hardware,
        help=f"device: {', '.join(HARDWARE_NAMES)}; cpu is this machine, measured "
        f"once and cached (default: {hardware})",
    )
    g.add_argument("--predictor", default="roofline", help=PREDICTOR_HELP + " (default: roofline)")
    add_dataclass_args(p, ParallelConfig, title="parallelism")
    p.set_defaults(tp=tp)


def add_engine_choice(p: argparse.ArgumentParser) -> None:
    """`--engine` and `--vllm-arg`: which engine runs medha's scheduler."""
    g = p.add_argument_group("executor")
    g.add_argument(
        "--engine",
        choices=("medha", "vllm"),
        default="medha",
        help="medha: medha's own engine (the reference; TP/SPP/KVP workers). vllm: vLLM's "
        "engine (vllm[-cpu] extra) with medha's scheduler deciding every step; the engine flags "
        "below map to vLLM's (--kv-memory-gb: its KV cache, --tp: its tensor parallelism; "
        "--dtype auto and the default --block-size: vLLM's own choice; --spp/--kvp are "
        "medha's engine's alone) (default: medha)",
    )
    g.add_argument(
        "--vllm-arg",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="with --engine vllm: any other argument of vLLM's engine (EngineArgs), VALUE in "
        "JSON where it parses, e.g. --vllm-arg enforce_eager=true; repeatable",
    )


def predictor_from_args(args: argparse.Namespace) -> Predictor:
    try:
        parallel = dataclass_from_args(ParallelConfig, args)
        return make_predictor(args.predictor, args.model, args.hardware, parallel)
    except ValueError as e:
        raise CliError(str(e)) from None


def scheduler_config_from_args(args: argparse.Namespace) -> SchedulerConfig:
    try:
        return dataclass_from_args(SchedulerConfig, args)
    except ValueError as e:
        raise CliError(str(e)) from None


def llm_from_args(args: argparse.Namespace, **overrides) -> LLM:
    from medha.engine.config import EngineConfig
    from medha.engine.errors import EngineError
    from medha.engine.llm import LLM

    try:
        return LLM(
            scheduler=scheduler_config_from_args(args),
            **vars(dataclass_from_args(EngineConfig, args, **overrides)),
        )
    except EngineError as e:
        raise CliError(str(e)) from None
