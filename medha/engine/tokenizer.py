"""Tokenizer and chat template from the checkpoint directory, and incremental detokenizing with
stop strings."""

from __future__ import annotations

from pathlib import Path

from medha.engine.errors import EngineError


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

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True
                            ) -> list[int]:
        if not self._tok.chat_template:
            raise EngineError("this model has no chat template; send a plain prompt")
        try:
            ids = self._tok.apply_chat_template(
                messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        except Exception as e:  # jinja raises its own types for malformed messages
            raise EngineError(f"cannot apply the chat template: {e}") from None
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)


class Detokenizer:
    """Output text grown token by token. Text that might be the start of a stop string, or an
    incomplete UTF-8 sequence, is held back until it is safe to emit."""

    def __init__(self, tokenizer: Tokenizer, stop: list[str]) -> None:
        self._tok = tokenizer
        self._stop = stop
        self._ids: list[int] = []
        self.text = ""  # everything decoded so far (stop string excluded once found)
        self._emitted = 0
        self.stopped = False

    def add(self, token: int) -> str:
        """Append one token; returns the newly safe text (maybe empty)."""
        self._ids.append(token)
        text = self._tok.decode(self._ids)
        if text.endswith("\ufffd"):  # a multi-byte character is not complete yet
            return ""
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
        delta = self.text[self._emitted:end] if end > self._emitted else ""
        self._emitted = max(self._emitted, end)
        return delta

    def flush(self) -> str:
        """Whatever was held back, when the request ends for another reason."""
        delta = self.text[self._emitted:]
        self._emitted = len(self.text)
        return delta
