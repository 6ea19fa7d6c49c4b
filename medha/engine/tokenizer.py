"""Tokenizer and chat template from the checkpoint directory, and incremental detokenizing with
stop strings."""

from __future__ import annotations

from pathlib import Path

from medha.engine.errors import EngineError, InvalidRequestError


class Tokenizer:
    def __init__(self, path: Path) -> None:
        from transformers import AutoTokenizer
        from transformers.utils import logging as hf_logging

        hf_logging.set_verbosity_error()
        try:
            self._tok = AutoTokenizer.from_pretrained(str(path))
        except (OSError, ValueError) as e:
            raise EngineError(f"{path}: cannot load the tokenizer ({e})") from None
        self.eos_token_id = self._tok.eos_token_id
        self.vocab_size = len(self._tok)
        # The longest token, in characters of its vocabulary entry (a byte each for byte-level
        # BPE, more for SentencePiece's byte fallback "<0x0A>"): every token covers at most
        # this many characters of a text, which bounds a text's token count from below.
        self.max_token_chars = max(1, max(len(t) for t in self._tok.get_vocab()))
        # The Rust tokenizer's decode where transformers' would only wrap it (a fast tokenizer,
        # no clean-up of spaces): transformers' wrapper converts every id in Python first,
        # 3.3 ms a step for 64 requests detokenizing on an H200's host, a fifth of the step
        backend = getattr(self._tok, "_tokenizer", None)
        self._backend_decode = (
            backend.decode
            if backend is not None and not self._tok.clean_up_tokenization_spaces
            else None
        )

    def min_tokens(self, text: str) -> int:
        """A lower bound on len(encode(text)), computed without tokenizing. (It assumes the
        tokenizer drops no characters, as byte-level BPE does.)"""
        return -(-len(text) // self.max_token_chars)

    def encode(self, text: str, param: str = "prompt", limit: int | None = None) -> list[int]:
        """Raises InvalidRequestError naming `param` for text the tokenizer cannot take and,
        with `limit`, for text of more than `limit` tokens: found by tokenizing prefixes of
        growing length (about twice the text that `limit` tokens cover, at most), not the
        whole of a long text."""
        _check_text(text, param)
        if limit is None:
            return self._tok.encode(text, add_special_tokens=False)
        at_least, n = self.min_tokens(text), 8 * (limit + 1)
        while at_least <= limit and n < len(text):
            cut = _word_boundary(text, n)
            if cut is None:  # one giant word: no prefix is safe to count
                break
            at_least = len(self._tok.encode(text[:cut], add_special_tokens=False))
            n *= 2
        if at_least <= limit:
            ids = self._tok.encode(text, add_special_tokens=False)
            at_least = len(ids)
        if at_least > limit:
            raise InvalidRequestError(
                f"{param} is more than {limit} tokens long (at least "
                f"{at_least}), the model's context",
                param,
            )
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._backend_decode is not None:
            return self._backend_decode(ids, skip_special_tokens=skip_special_tokens)
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, limit: int | None = None
    ) -> list[int]:
        """Token ids of a chat; with `limit`, refused (InvalidRequestError) without templating
        when its contents alone cannot fit in `limit` tokens."""
        if limit is not None:
            at_least = sum(self.min_tokens(m.get("content") or "") for m in messages)
            if at_least > limit:
                raise InvalidRequestError(
                    f"messages are at least {at_least} tokens long; the "
                    f"model's context is {limit} tokens",
                    "messages",
                )
        if not self._tok.chat_template:
            raise InvalidRequestError(
                "this model has no chat template; send a plain prompt", "messages"
            )
        for i, m in enumerate(messages):
            _check_text(m.get("content") or "", f"messages.{i}.content")
        try:
            ids = self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True
            )
        except Exception as e:  # jinja raises its own types for malformed messages
            raise InvalidRequestError(f"cannot apply the chat template: {e}", "messages") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


def _word_boundary(text: str, end: int, tries: int = 64) -> int | None:
    """A position at or before `end` where `text` has one space between two other characters.
    Tokenizers split words there (byte-level BPE pre-tokenizes " word" as a piece), so the
    tokens of text[:cut] are exactly the first tokens of the whole text."""
    for _ in range(tries):
        cut = text.rfind(" ", 1, end)
        if cut == -1:
            return None
        if not text[cut - 1].isspace() and cut + 1 < len(text) and not text[cut + 1].isspace():
            return cut
        end = cut
    return None


def _check_text(text: str, param: str) -> None:
    """Text the tokenizer can encode: a str of valid Unicode scalar values (JSON can carry
    lone surrogates, "\\ud800", which no UTF-8 encoder accepts)."""
    if not isinstance(text, str):
        raise InvalidRequestError(f"{param} must be a string", param)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidRequestError(
            f"{param} holds a lone surrogate ({text[e.start]!a} at "
            f"character {e.start}), which is not text",
            param,
        ) from None


class Detokenizer:
    """Output text grown token by token. Text that might be the start of a stop string, or an
    incomplete UTF-8 sequence, is held back until it is safe to emit.

    Each token decodes only a window of the last few ids, not the whole output (which made a
    long answer's detokenization quadratic): the window's text from `_prefix` to `_read` was
    already taken, and whatever decoding up to the new token adds beyond it is the new text.
    Decoding both from the same first id keeps a tokenizer's rule for a leading space the
    same in both, so the pieces add up to the whole output's decoding (vLLM's scheme)."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self._prefix = self._read = 0  # the window: ids[_prefix:_read] are in _decoded
        self._decoded = ""  # the output's text so far, as decoded
        self.text = ""  # everything decoded so far (stop string excluded once found)
        self._emitted = 0
        self.stopped = False

    def add(self, token: int) -> str:
        """Append one token; returns the newly safe text (maybe empty)."""
        self._ids.append(token)
        taken = self._tok.decode(self._ids[self._prefix : self._read])
        window = self._tok.decode(self._ids[self._prefix :])
        # a multi-byte character not complete yet, or a token with no text (a special one)
        if window.endswith("\ufffd") or len(window) <= len(taken):
            return ""
        self._decoded += window[len(taken) :]
        self._prefix, self._read = self._read, len(self._ids)
        text = self._decoded
        self.text = text
        hold = 0
        for s in self._stop:
            at = text.find(s, max(0, self._emitted - len(s) + 1))
            if at != -1:
                self.text = text[:at]
                self.stopped = True
                break
            # keep back a suffix that could still grow into a stop string
            for k in range(min(len(s) - 1, len(text)), 0, -1):
                if text.endswith(s[:k]):
                    hold = max(hold, k)
                    break
        end = len(self.text) if self.stopped else len(self.text) - hold
        delta = self.text[self._emitted : end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def flush(self) -> str:
        """Whatever was held back, when the request ends for another reason."""
        delta = self.text[self._emitted :]
        self._emitted = len(self.text)
        return delta
