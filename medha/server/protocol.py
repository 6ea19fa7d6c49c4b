"""The OpenAI request and response bodies the server speaks, with medha's SLO extension.

Requests are parsed strictly, as the OpenAI API parses them: `"max_tokens": 2.5`, `"true"` or
`"0.5"` where an integer, boolean or number belongs is a 400, not a silent conversion (numbers
may still be written as integers, and integers with a zero fraction, `2.0`, since JSON Schema
and so the OpenAPI document count them as integers). Unknown top-level fields are ignored
(clients send many optional ones), but a field medha does not implement and that would change
the result (n > 1, penalties, tools, ...) is refused with a 400 naming it, rather than silently
ignored.

The response models describe what the routes return, for the OpenAPI document (`/openapi.json`);
the routes build plain dicts.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from medha.core.request import PRIORITY_CLASSES
from medha.engine.sampling_params import FLOAT32_TINY, MAX_LOGPROBS, SEED_MAX, SEED_MIN

PRIORITIES = PRIORITY_CLASSES  # one list for the API, the scheduler and the simulator

PositiveFloat = Annotated[float, Field(gt=0, allow_inf_nan=False)]
TokenId = Annotated[int, Field(ge=0)]
NonEmptyStr = Annotated[str, Field(min_length=1)]
FinishReason = Literal["stop", "length"]


class MedhaOptions(BaseModel):
    """Per-request service targets, sent as `"medha": {...}` (extra_body with the openai
    client). Absent fields take the server's defaults (`medha serve --help`)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    priority: Literal[PRIORITIES] | None = Field(  # type: ignore[valid-type]
        None,
        description="priority class, REALTIME > HIGH > NORMAL (the default) > LOW; "
        "`medha serve --policy priority` orders and preempts by it",
    )
    ttft_slo_s: PositiveFloat | None = Field(
        None, description="time-to-first-token target in seconds (the scheduler's deadline)"
    )
    tpot_slo_s: PositiveFloat | None = Field(
        None,
        description="time-per-output-token target in seconds, a mean over the answer as "
        "SLO attainment and `vllm bench serve --goodput` count it (token k due within k "
        "targets of the first): every batch that carries this request's decode keeps its "
        "predicted time within it (x spp/(spp+1) with pipeline stages), so prefill chunks "
        "beside it shrink (a tighter --iteration-budget-s still applies); a paused long "
        "prefill may spend the time its earlier tokens saved",
    )


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True)
    include_usage: bool = False


def _integral(value: object) -> object:
    """2.0 is 2 (JSON Schema counts a number with a zero fraction as an integer); anything else
    is left to the strict checks (2.5, inf and nan are refused where an integer belongs)."""
    if type(value) is float and value.is_integer():
        return int(value)
    if type(value) is list:
        return [_integral(v) for v in value]
    return value


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _integers(cls, data: object) -> object:
        """Integers written with a zero fraction (`"n": 1.0`), in the fields that hold integers
        (and the token ids of a prompt), become integers before the strict checks: the
        document says integer, and JSON Schema counts 1.0 as one. Done here rather than in a
        field type, so the document keeps its minimum and maximum."""
        if not isinstance(data, dict):
            return data
        fixed = {k: _integral(data[k]) for k in cls._integer_fields() if k in data}
        return {**data, **fixed} if fixed else data

    @classmethod
    def _integer_fields(cls) -> tuple[str, ...]:
        ints = (int, int | None)
        names = [n for n, f in cls.model_fields.items() if f.annotation in ints]
        return (*names, "prompt") if "prompt" in cls.model_fields else tuple(names)

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(
        1.0,
        ge=0,
        le=2,
        allow_inf_nan=False,
        description=("0 or at least 1.2e-38 (a normal float32); below 1e-5 the request is greedy"),
    )
    top_p: float = Field(
        1.0,
        ge=FLOAT32_TINY,
        le=1,
        allow_inf_nan=False,
        description=(
            "nucleus mass, at least 1.2e-38 (a normal float32); the likeliest token is always kept"
        ),
    )
    top_k: int = Field(0, ge=-1, description="extension (vLLM): keep the k likeliest tokens")
    n: int = Field(1, ge=1, le=1, description="only 1: send several requests for more")
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: NonEmptyStr | Annotated[list[NonEmptyStr], Field(max_length=4)] | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool = Field(False, description="extension (vLLM): do not stop at EOS")
    stream: bool = False
    stream_options: StreamOptions | None = Field(None, description="only with stream: true")
    presence_penalty: float = Field(0.0, description="only 0 (not supported)")
    frequency_penalty: float = Field(0.0, description="only 0 (not supported)")
    logit_bias: dict[str, float] | None = Field(None, description="not supported")
    user: str | None = None
    medha: MedhaOptions | None = None

    @model_validator(mode="after")
    def _supported(self):
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(self, name):
                raise _unsupported(name, f"{name} is not supported (send 0 or omit it)")
        if self.logit_bias:
            raise _unsupported("logit_bias", "logit_bias is not supported")
        if self.stream_options is not None and not self.stream:
            raise _unsupported(
                "stream_options",
                "The 'stream_options' parameter is only allowed when 'stream' is enabled.",
            )
        return self

    @property
    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])


class CompletionRequest(_Common):
    prompt: (
        NonEmptyStr
        | Annotated[list[NonEmptyStr], Field(min_length=1)]
        | Annotated[list[TokenId], Field(min_length=1)]
        | Annotated[list[Annotated[list[TokenId], Field(min_length=1)]], Field(min_length=1)]
    )
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    suffix: str | None = Field(None, description="not supported")
    best_of: int | None = Field(None, ge=1, le=1, description="only 1")

    @model_validator(mode="after")
    def _prompts(self):
        if self.suffix:
            raise _unsupported("suffix", "suffix is not supported")
        if self.echo and self.logprobs is not None:
            raise _unsupported(
                "logprobs",
                "echo with logprobs (the prompt's logprobs) is not "
                "supported; send one or the other",
            )
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """One entry per choice: a string or token ids."""
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if isinstance(p[0], int):
            return [p]
        return list(p)


class TextPart(BaseModel):
    model_config = ConfigDict(strict=True)
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
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
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # The document says what is accepted (no tools; the text format only), so that a client
    # checking its requests against it, or a fuzzer, never sends one it promises and is refused.
    tools: list[dict] | None = Field(
        None, description="not supported: absent, null or []", json_schema_extra={"maxItems": 0}
    )
    response_format: dict | None = Field(
        None,
        description='only {"type": "text"}',
        json_schema_extra={"properties": {"type": {"enum": ["text"]}}},
    )

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


def _unsupported(param: str, message: str) -> ValueError:
    # pydantic wraps ValueErrors raised in validators; the handler reads `param` back.
    return ValueError(f"{param}: {message}")


# ---- responses (for the OpenAPI document) ----------------------------------------------------
class ErrorDetail(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorDetail


class PromptTokensDetails(BaseModel):
    cached_tokens: int  # prompt tokens the prefix cache supplied


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None
    finish_reason: FinishReason | None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage


class CompletionChunk(BaseModel):
    """One event of a streamed completion; with stream_options.include_usage every chunk has a
    usage field, null but in the last one, whose choices are empty."""

    id: str
    object: Literal["text_completion"]
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class AssistantMessage(BaseModel):
    role: Literal["assistant"]
    content: str


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"]
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None
    finish_reason: FinishReason | None


class ChatCompletionChunk(BaseModel):
    """One event of a streamed chat completion (usage as in CompletionChunk)."""

    id: str
    object: Literal["chat.completion.chunk"]
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"]
    created: int
    owned_by: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[ModelCard]


class Health(BaseModel):
    status: Literal["ok", "error"]
    reason: str | None = Field(None, description="why the engine stopped (with 503)")
