"""Sampling parameters with OpenAI semantics, validated up front in the arithmetic the sampler
uses (float32 logits, int64 seeds), so that a request the sampler could not serve is refused
before it reaches the scheduler. The HTTP API builds its requests' parameters through this class,
so the rules are the same there and in the Python API:

- `temperature`: 0 (greedy) or a finite number float32 holds as a normal number (>= FLOAT32_TINY,
  about 1.2e-38); smaller ones are refused: 1e-40 is a float32 denormal and 1e-46 rounds to 0,
  and logits divided by either are inf, which softmax turns into NaN. Below MIN_TEMPERATURE
  (1e-5) the request is greedy, as in vLLM: dividing float32 logits by less can overflow.
- `top_p` in [FLOAT32_TINY, 1]: 1e-46 or 1e-300 round to 0 in float32 and are refused. The
  nucleus always keeps the likeliest token, so a tiny top_p is greedy, as its limit is.
- `seed` in the int64 range [-2**63, 2**63 - 1] (vLLM's; torch's generator refuses wider ones).
- `stop`: non-empty strings of at most MAX_STOP_CHARS characters each, at most MAX_STOPS of
  them (the detokenizer checks each one against the text's tail at every token).
- `max_tokens` >= 1, `top_k` >= -1, `logprobs` in [0, 20], `stop_token_ids` >= 0: integers,
  and never booleans.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from medha.engine.errors import InvalidRequestError

MIN_TEMPERATURE = 1e-5
FLOAT32_TINY = float(np.finfo(np.float32).tiny)  # the smallest normal float32, 1.1754944e-38
MAX_STOPS = 16
MAX_STOP_CHARS = 1024
SEED_MIN, SEED_MAX = -(2**63), 2**63 - 1
MAX_LOGPROBS = 20


@dataclass
class SamplingParams:
    max_tokens: int = 16
    temperature: float = 1.0  # below MIN_TEMPERATURE: greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: no top-k cut
    seed: int | None = None  # per-request generator, reproducible whatever the batch
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # return the sampled token's logprob and this many top ones

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        if not _integer(self.max_tokens) or self.max_tokens < 1:
            raise _invalid("max_tokens", "must be a positive integer", self.max_tokens)
        if not _number(self.temperature) or self.temperature < 0:
            raise _invalid("temperature", "must be a finite number >= 0", self.temperature)
        if 0 < self.temperature < FLOAT32_TINY:
            raise _invalid(
                "temperature",
                "must be 0 (greedy) or at least 1.2e-38, the "
                "smallest normal float32 (the sampler divides float32 logits by it)",
                self.temperature,
            )
        if not _number(self.top_p) or not FLOAT32_TINY <= self.top_p <= 1:
            raise _invalid(
                "top_p",
                "must lie in [1.2e-38, 1] (smaller values are 0 or a "
                "denormal in float32, where the sampler compares it)",
                self.top_p,
            )
        if not _integer(self.top_k) or self.top_k < -1:
            raise _invalid("top_k", "must be -1, 0 or a positive integer", self.top_k)
        if self.seed is not None and (
            not _integer(self.seed) or not SEED_MIN <= self.seed <= SEED_MAX
        ):
            raise _invalid("seed", "must be an integer in [-2**63, 2**63 - 1]", self.seed)
        if not isinstance(self.stop, list) or len(self.stop) > MAX_STOPS:
            raise _invalid("stop", f"must be at most {MAX_STOPS} strings", _short(self.stop))
        for s in self.stop:
            if not isinstance(s, str) or not s or len(s) > MAX_STOP_CHARS:
                raise _invalid(
                    "stop",
                    f"must hold non-empty strings of at most {MAX_STOP_CHARS} characters each",
                    _short(s),
                )
        if not isinstance(self.stop_token_ids, list) or not all(
            _integer(t) and t >= 0 for t in self.stop_token_ids
        ):
            raise _invalid(
                "stop_token_ids",
                "must be a list of token ids (integers >= 0)",
                _short(self.stop_token_ids),
            )
        if self.logprobs is not None and (
            not _integer(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS
        ):
            raise _invalid("logprobs", f"must be an integer in [0, {MAX_LOGPROBS}]", self.logprobs)
        if not isinstance(self.ignore_eos, bool):
            raise _invalid("ignore_eos", "must be a boolean", self.ignore_eos)

    @property
    def greedy(self) -> bool:
        """Sampling that can only pick the likeliest token (see the module's rules)."""
        return self.temperature < MIN_TEMPERATURE or self.top_k == 1


def _integer(x) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _number(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _short(x) -> str:
    text = repr(x)
    return text if len(text) <= 80 else text[:77] + "..."


def _invalid(param: str, rule: str, value) -> InvalidRequestError:
    return InvalidRequestError(f"{param} {rule}, got {_short(value)}", param)
