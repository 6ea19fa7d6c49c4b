"""The OpenAI request bodies the server accepts, with medha's SLO extension.

Unknown top-level fields are ignored (clients send many optional ones), but a field medha does
not implement and that would change the result (n > 1, penalties, tools, ...) is refused with a
400 naming it, rather than silently ignored.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from medha.core.request import PRIORITY_CLASSES

PRIORITIES = PRIORITY_CLASSES  # one list for the API, the scheduler and the simulator

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]


class MedhaOptions(BaseModel):
    """Per-request service targets, sent as `"medha": {...}` (extra_body with the openai
    client). Absent fields take the server's defaults (`medha serve --help`)."""

    model_config = ConfigDict(extra="forbid")
    priority: Literal[PRIORITIES] | None = Field(  # type: ignore[valid-type]
        None, description="priority class, REALTIME > HIGH > NORMAL (the default) > LOW; "
        "`medha serve --policy priority` orders and preempts by it")
    ttft_slo_s: PositiveFloat | None = Field(
        None, description="time-to-first-token target in seconds (the scheduler's deadline)")
    tpot_slo_s: PositiveFloat | None = Field(
        None, description="time-per-output-token target in seconds")


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(1.0, gt=0, le=1, allow_inf_nan=False)
    top_k: int = Field(0, ge=-1, description="extension (vLLM): keep the k likeliest tokens")
    n: int = Field(1, ge=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    ignore_eos: bool = Field(False, description="extension (vLLM): do not stop at EOS")
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    medha: MedhaOptions | None = None

    @model_validator(mode="after")
    def _supported(self):
        if self.n != 1:
            raise _unsupported("n", "n > 1 is not supported; send several requests")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(name, f"{name} is not supported (send 0 or omit it)")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")
        if isinstance(self.stop, list) and len(self.stop) > 4:
            raise _unsupported("stop", "at most 4 stop sequences")
        if self.stop == "" or (isinstance(self.stop, list) and "" in self.stop):
            raise _unsupported("stop", "stop sequences must not be empty")
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _prompts(self):
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.best_of not in (None, 1):
            raise _unsupported("best_of", "best_of > 1 is not supported")
        if self.prompt in ("", []) or (isinstance(self.prompt, list) and
                                      any(p in ("", []) for p in self.prompt)):
            raise _unsupported("prompt", "prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if p and isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if isinstance(self.content, list):
            return "".join(p.text for p in self.content)
        return self.content or ""


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[dict] | None = None
    response_format: dict | None = None

    @model_validator(mode="after")
    def _chat(self):
        if self.tools:
            raise _unsupported("tools", "tool calling is not supported")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise _unsupported("response_format", "only the text response format is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise _unsupported("top_logprobs", "top_logprobs needs logprobs: true")
        return self

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class RequestError(ValueError):
    """A request medha refuses: HTTP status, message, and the offending parameter."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type_: str = "invalid_request_error", code: str | None = None) -> None:
        super().__init__(message)
        self.param, self.status, self.type, self.code = param, status, type_, code

    def body(self) -> dict:
        return {"error": {"message": str(self), "type": self.type, "param": self.param,
                          "code": self.code}}


def _unsupported(param: str, message: str) -> ValueError:
    # pydantic wraps ValueErrors raised in validators; the handler reads `param` back.
    return ValueError(f"{param}: {message}")
