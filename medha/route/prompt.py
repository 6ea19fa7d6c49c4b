"""What the router reads of a request body: enough to predict its work and key its prefix, never
more. The body itself goes to the replica unchanged, which validates it in full; here anything
unexpected only makes the estimate coarser (a request whose prompt the router cannot read is
one token long to it), and no field can raise past `read_request`.

Tokens: with a tokenizer (`tokenizers`, torch-free, the replicas' own tokenizer.json) the prompt
is counted and keyed in the replicas' tokens; a chat is tokenized message by message (role and
content), not through the model's chat template (the template adds a few tokens per message
and the same ones to every request sharing the prefix, so counts and shared prefixes stay what
they are). Without a tokenizer every 4 characters are a token.

Tokenizing costs the router more than anything else it does for a request (3 us a token here:
0.1 ms for a 40-token prompt, 70 ms for 100K characters), so pieces of prompts are remembered:
an LRU of the token ids of recent messages and prompts (`TokenCache`), which a chat's earlier
turns and shared system prompts hit, as SGLang's gateway caches its tokenizer's results. A piece
too long to tokenize without holding up the event loop goes to a thread (the tokenizer releases
the GIL).
"""

from __future__ import annotations

import asyncio
import math
from array import array
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from medha.core.request import PRIORITY_CLASSES, Request
from medha.perf.hardware_specs import cache_dir

CHARS_PER_TOKEN = 4
# A piece longer than this is tokenized on a thread (~1 ms of the tokenizer's time).
OFF_LOOP_CHARS = 1500


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


def _chat_pieces(messages) -> list[str] | None:
    """A chat's messages as the pieces it is tokenized in: role and content of each."""
    if not isinstance(messages, list):
        return None
    pieces = []
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
        role = role if isinstance(role, str) else ""
        pieces.append(f"<{role}>\n{content if isinstance(content, str) else ''}\n")
    return pieces


def prompt_pieces(body: dict, chat: bool) -> list[str] | list[int]:
    """What of `body` (a JSON object) is tokenized: its text in pieces (a chat's messages, a
    prompt), or the token ids it gives itself."""
    if chat:
        return _chat_pieces(body.get("messages")) or []
    source = _text_of(body.get("prompt"))
    if isinstance(source, str):
        return [source] if source else []
    return source or []


class TokenCache:
    """Token ids of recent pieces of prompts, least recently used out past `max_chars`."""

    def __init__(self, tokenizer: HfTokens | TextTokens, max_chars: int = 1 << 24) -> None:
        self.tokenizer, self.max_chars = tokenizer, max_chars
        self._ids: OrderedDict[str, array] = OrderedDict()
        self._chars = 0

    def __len__(self) -> int:
        return len(self._ids)

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception:  # text the tokenizer cannot take: the replica will say why
            return TextTokens().encode(text)

    async def tokens(self, pieces: list[str] | list[int]) -> list[int]:
        if not pieces or not isinstance(pieces[0], str):
            return list(pieces)
        out: list[int] = []
        for piece in pieces:
            ids = self._ids.get(piece)
            if ids is not None:
                self._ids.move_to_end(piece)
            else:
                if len(piece) > OFF_LOOP_CHARS:
                    found = await asyncio.to_thread(self._encode, piece)
                else:
                    found = self._encode(piece)
                ids = array("q", found)
                if len(piece) <= self.max_chars:
                    self._ids[piece] = ids
                    self._chars += len(piece)
                    while self._chars > self.max_chars:
                        old, _ = self._ids.popitem(last=False)
                        self._chars -= len(old)
            out.extend(ids)
        return out


def read_request(
    body: dict,
    tokens: list[int],
    request_id: str,
    now: float,
    headers: dict[str, str],
    default_tokens: int,
) -> Routing:
    """The Request the dispatcher sees for `body` (a JSON object) with prompt `tokens`
    (`TokenCache.tokens` of its `prompt_pieces`), arriving at `now`."""
    tokens = tokens or [0]
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    expected = int(min(_positive(max_tokens, default_tokens), 1 << 20))
    medha = body.get("medha") if isinstance(body.get("medha"), dict) else {}
    ttft = _positive(medha.get("ttft_slo_s"), None)
    if ttft is None:
        ttft = _header_ms(headers, "x-slo-ttft-ms")
    # The TPOT target caps the replica's steps (replica_rules.step_budget_s), which the
    # router's model of it predicts: only the one the replica reads, the body's.
    tpot = _positive(medha.get("tpot_slo_s"), None)
    priority = medha.get("priority")
    if priority not in PRIORITY_CLASSES:
        priority = None  # the replica's default class (it answers 400 to a bad one)
    request = Request.from_tokens(
        request_id,
        now,
        tokens,
        max(1, expected),
        ttft_deadline_s=ttft,
        tpot_target_s=tpot,
        priority_class=priority,
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
