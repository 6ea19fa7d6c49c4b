"""What the router reads of a request body: enough to predict its work and key its prefix, never
more. The body itself goes to the replica unchanged, which validates it in full; here anything
unexpected only makes the estimate coarser (a request whose prompt the router cannot read is
one token long to it), and no field can raise past `read_request`.

Tokens: with a tokenizer (`tokenizers`, torch-free, the replicas' own tokenizer.json) the prompt
is counted and keyed in the replicas' tokens; a chat is tokenized as its messages' roles and
contents in order, not through the model's chat template (the template adds a few tokens per
message and the same ones to every request sharing the prefix, so counts and shared prefixes
stay what they are). Without a tokenizer every 4 characters are a token.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from medha.core.request import Request
from medha.perf.hardware_specs import cache_dir

CHARS_PER_TOKEN = 4


class TextTokens:
    """4 characters a token: ids from the characters themselves, so equal text gives equal ids."""

    def encode(self, text: str) -> list[int]:
        return [
            hash(text[i : i + CHARS_PER_TOKEN]) & 0x7FFFFFFF
            for i in range(0, len(text), CHARS_PER_TOKEN)
        ]


class HfTokens:
    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self._tok = Tokenizer.from_file(str(path))

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids


def load_tokenizer(spec: str | None) -> HfTokens | TextTokens:
    """`spec`: a tokenizer.json or a directory with one; None: the embedded model's converted
    checkpoint if there is one, else TextTokens."""
    if spec is None:
        default = cache_dir() / "models" / "smollm2-135m-instruct" / "tokenizer.json"
        if not default.exists():
            return TextTokens()
        spec = str(default)
    path = Path(spec)
    if path.is_dir():
        path = path / "tokenizer.json"
    if not path.is_file():
        raise ValueError(f"no tokenizer at {spec} (a tokenizer.json, or a directory with one)")
    return HfTokens(path)


@dataclass
class Routing:
    """A request as the router routes it."""

    request: Request
    stream: bool
    expected_tokens: int  # output tokens its work is predicted with


def _positive(value, default):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return default
    return value if math.isfinite(value) and value > 0 else default


def _text_of(prompt) -> str | list[int] | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt:
        first = prompt[0]
        if isinstance(first, str):  # a batch of prompts: keyed by the first
            return "".join(p for p in prompt if isinstance(p, str))
        if isinstance(first, int) and not isinstance(first, bool):
            return [t for t in prompt if isinstance(t, int) and not isinstance(t, bool)]
        if isinstance(first, list):  # a batch of token lists
            return [t for p in prompt if isinstance(p, list) for t in p if isinstance(t, int)]
    return None


def _chat_text(messages) -> str | None:
    if not isinstance(messages, list):
        return None
    parts = []
    for m in messages:
        if not isinstance(m, dict):
            continue
        content = m.get("content")
        if isinstance(content, list):  # content parts: their text
            content = "".join(
                p.get("text", "")
                for p in content
                if isinstance(p, dict) and isinstance(p.get("text"), str)
            )
        role = m.get("role")
        parts.append(f"<{role if isinstance(role, str) else ''}>\n")
        parts.append(content if isinstance(content, str) else "")
        parts.append("\n")
    return "".join(parts)


def read_request(
    body: dict,
    chat: bool,
    request_id: str,
    now: float,
    tokenizer: HfTokens | TextTokens,
    headers: dict[str, str],
    default_tokens: int,
) -> Routing:
    """The Request the dispatcher sees for `body` (a JSON object), arriving at `now`."""
    source = _chat_text(body.get("messages")) if chat else _text_of(body.get("prompt"))
    if isinstance(source, str):
        try:
            tokens = tokenizer.encode(source)
        except Exception:  # text the tokenizer cannot take: the replica will say why
            tokens = TextTokens().encode(source)
    else:
        tokens = source or []
    tokens = tokens or [0]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    expected = int(min(_positive(max_tokens, default_tokens), 1 << 20))
    medha = body.get("medha") if isinstance(body.get("medha"), dict) else {}
    ttft = _positive(medha.get("ttft_slo_s"), None)
    tpot = _positive(medha.get("tpot_slo_s"), None)
    if ttft is None:
        ttft = _header_ms(headers, "x-slo-ttft-ms")
    if tpot is None:
        tpot = _header_ms(headers, "x-slo-tpot-ms")
    request = Request.from_tokens(
        request_id, now, tokens, max(1, expected), ttft_deadline_s=ttft, tpot_target_s=tpot
    )
    return Routing(request, body.get("stream") is True, expected)


def _header_ms(headers: dict[str, str], name: str) -> float | None:
    raw = headers.get(name)
    if raw is None:
        return None
    try:
        value = float(raw) / 1000.0
    except ValueError:
        return None
    return value if math.isfinite(value) and value > 0 else None
