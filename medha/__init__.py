"""medha: serving LLM requests of every length without convoys."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

__version__ = "0.1.0"

# The engine's names, as vLLM users type them (`from medha import LLM, SamplingParams`), load
# on first use (PEP 562): `import medha` stays free of torch, which the scheduler, the
# simulator and the CLI's parser never need.
_LAZY = {
    "LLM": "medha.engine.llm",
    "LLMEngine": "medha.engine.llm_engine",
    "EngineConfig": "medha.engine.config",
    "RequestOutput": "medha.engine.outputs",
    "SamplingParams": "medha.engine.sampling_params",
}
__all__ = ["EngineConfig", "LLM", "LLMEngine", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from medha.engine.config import EngineConfig
    from medha.engine.llm import LLM
    from medha.engine.llm_engine import LLMEngine
    from medha.engine.outputs import RequestOutput
    from medha.engine.sampling_params import SamplingParams


def __getattr__(name: str):
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        module = importlib.import_module(_LAZY[name])
    except ModuleNotFoundError as e:  # `pip install medha` has no engine: say which extra has
        from medha.extras import missing_extra

        message = missing_extra(e, f"medha.{name}", "engine")
        if message is None:
            raise
        raise ModuleNotFoundError(message, name=e.name) from e
    value = getattr(module, name)
    globals()[name] = value  # later lookups skip this function
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
