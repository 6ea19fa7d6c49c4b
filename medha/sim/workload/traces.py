"""Request traces: arrival times (when the trace has them) and token lengths.

Formats, told apart by their columns:
- Vidur / Splitwise CSV: `arrived_at` (s), `num_prefill_tokens`, `num_decode_tokens`
- Azure LLM inference CSV: `TIMESTAMP` (date-time), `ContextTokens`, `GeneratedTokens`
- length-only CSV (ShareGPT, arXiv stats): `num_prefill_tokens`, `num_decode_tokens`
- Mooncake CSV: `timestamp` (ms), `input_length`, `output_length`, and optionally `hash_ids`
  (the ids separated by spaces)
- JSONL (Mooncake's format; `.jsonl.gz` too), one object per line: `timestamp` (ms),
  `input_length`, `output_length`, and optionally `hash_ids` or `token_ids` (the prompt's
  token ids, input_length of them: the prefix cache keys them in its own blocks, as the
  engine's; what a recorded run through the API writes for its digital twin)

`hash_ids` are a prompt's prefix block hashes: one id per 512 tokens (the last block partial),
prefix-chained, so that an id stands for its block and every token before it. Two prompts
whose first k ids agree share their first k blocks; the prefix cache reuses them.
"""

from __future__ import annotations

import csv
import gzip
import json
import math
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from medha.core.request import PREFIX_HASH_BLOCK

TRACE_DIR = Path(__file__).resolve().parents[2] / "data" / "traces"
BUNDLED = {
    "sharegpt": "sharegpt_8k_filtered_stats_llama2_tokenizer.csv",
    "arxiv": "arxiv_summarization_stats_llama2_tokenizer_filtered_v2.csv",
    "splitwise_conv": "splitwise_conv.csv",
    "splitwise_code": "splitwise_code.csv",
    "azure_conv": "AzureLLMInferenceTrace_conv.csv",
    "azure_code": "AzureLLMInferenceTrace_code.csv",
    "mooncake_conv": "mooncake_conversation_trace.jsonl.gz",
}


class TraceError(ValueError):
    """Bad trace input; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class TraceEntry:
    arrival_s: float | None  # None: the trace has no timestamps
    prompt_len: int
    output_len: int
    hash_ids: tuple[int, ...] | None = None  # prefix block hashes (see the module)
    token_ids: tuple[int, ...] | None = None  # the prompt's tokens (JSONL only)


def resolve_trace(name: str | Path) -> Path:
    if str(name) in BUNDLED:
        return TRACE_DIR / BUNDLED[str(name)]
    path = Path(name)
    if not path.is_file():
        raise TraceError(
            f"trace {name}: no such file (bundled traces: {', '.join(sorted(BUNDLED))})"
        )
    return path


def _length(value, column: str, where: str) -> int:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column}={value!r} is not a number") from None
    if not math.isfinite(number) or number != int(number):
        raise TraceError(f"{where}: {column}={value!r} is not a whole number of tokens")
    if number < 1:
        raise TraceError(f"{where}: {column}={value!r} must be at least 1 token")
    return int(number)


def _time(value, column: str, where: str) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise TraceError(f"{where}: {column}={value!r} is not a number") from None
    if not math.isfinite(number) or number < 0:
        raise TraceError(f"{where}: {column}={value!r} must be a non-negative time")
    return number


def _token_ids(value, prompt_len: int, where: str) -> tuple[int, ...]:
    """A prompt's token ids: input_length non-negative integers."""

    def token(t) -> bool:
        return isinstance(t, int) and not isinstance(t, bool) and 0 <= t < 1 << 63

    if not isinstance(value, list) or len(value) != prompt_len or not all(map(token, value)):
        raise TraceError(f"{where}: token_ids must be input_length = {prompt_len} token ids")
    return tuple(value)


def _hash_ids(value, prompt_len: int, where: str) -> tuple[int, ...]:
    """A prompt's prefix hash ids: one non-negative integer per 512-token block."""
    if isinstance(value, str):
        value = value.split()
    want = -(-prompt_len // PREFIX_HASH_BLOCK)
    if not isinstance(value, list) or len(value) != want:
        raise TraceError(
            f"{where}: hash_ids must hold ceil(input_length / {PREFIX_HASH_BLOCK}) = {want} ids"
        )
    ids = []
    for v in value:
        try:
            i = int(v) if isinstance(v, (int, str)) and not isinstance(v, bool) else None
        except ValueError:
            i = None
        if i is None or i < 0 or i >= 1 << 62:
            raise TraceError(f"{where}: hash id {v!r} is not an integer in [0, 2^62)")
        ids.append(i)
    return tuple(ids)


_CSV_FORMATS = [  # (name, time column, prompt column, output column)
    ("Vidur/Splitwise", "arrived_at", "num_prefill_tokens", "num_decode_tokens"),
    ("Mooncake", "timestamp", "input_length", "output_length"),
    ("Azure", "TIMESTAMP", "ContextTokens", "GeneratedTokens"),
    ("length-only", None, "num_prefill_tokens", "num_decode_tokens"),
]


def _csv_format(path: Path, header: list[str]) -> tuple[str, str | None, str, str]:
    cols = set(header)
    for fmt in _CSV_FORMATS:
        name, time_col, prompt_col, output_col = fmt
        wanted = [c for c in (time_col, prompt_col, output_col) if c]
        if time_col and time_col not in cols:
            continue
        if time_col is None and not cols & {prompt_col, output_col}:
            continue
        missing = [c for c in wanted if c not in cols]
        if missing:
            raise TraceError(
                f"{path}:1: missing column {missing[0]!r} (a {name} trace has "
                f"columns {', '.join(wanted)})"
            )
        return fmt
    raise TraceError(
        f"{path}:1: unrecognised columns {header}; expected "
        "arrived_at,num_prefill_tokens,num_decode_tokens (Vidur/Splitwise), "
        "TIMESTAMP,ContextTokens,GeneratedTokens (Azure), "
        "timestamp,input_length,output_length[,hash_ids] (Mooncake) or "
        "num_prefill_tokens,num_decode_tokens (lengths only), or a .jsonl file"
    )


def _load_csv(path: Path, limit: int | None) -> list[TraceEntry]:
    with path.open(newline="") as fh:
        reader = csv.reader(fh)
        header = next(reader, None)
        if not header:
            raise TraceError(f"{path}:1: empty file")
        name, time_col, prompt_col, output_col = _csv_format(path, [h.strip() for h in header])
        idx = {h.strip(): i for i, h in enumerate(header)}
        entries: list[TraceEntry] = []
        first_stamp: datetime | None = None
        for line, row in enumerate(reader, start=2):
            if limit is not None and len(entries) >= limit:
                break
            if not row or all(not c.strip() for c in row):
                continue
            where = f"{path}:{line}"
            if len(row) < len(header):
                raise TraceError(f"{where}: {len(row)} fields, the header has {len(header)}")
            arrival = None
            if time_col == "TIMESTAMP":
                try:
                    stamp = datetime.fromisoformat(row[idx[time_col]].strip())
                except ValueError:
                    raise TraceError(
                        f"{where}: TIMESTAMP={row[idx[time_col]]!r} is not a date-time"
                    ) from None
                first_stamp = first_stamp or stamp
                arrival = (stamp - first_stamp).total_seconds()
                if arrival < 0:
                    raise TraceError(f"{where}: TIMESTAMP goes back in time")
            elif time_col:
                arrival = _time(row[idx[time_col]], time_col, where)
                if name == "Mooncake":
                    arrival /= 1e3  # ms
            prompt_len = _length(row[idx[prompt_col]], prompt_col, where)
            hashes = None
            if name == "Mooncake" and "hash_ids" in idx:
                hashes = _hash_ids(row[idx["hash_ids"]], prompt_len, where)
            entries.append(
                TraceEntry(
                    arrival, prompt_len, _length(row[idx[output_col]], output_col, where), hashes
                )
            )
    return entries


def _load_jsonl(path: Path, limit: int | None) -> list[TraceEntry]:
    entries: list[TraceEntry] = []
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as fh:
        for line, text in enumerate(fh, start=1):
            if limit is not None and len(entries) >= limit:
                break
            if not text.strip():
                continue
            where = f"{path}:{line}"
            try:
                obj = json.loads(text)
            except ValueError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(obj, dict):
                raise TraceError(f"{where}: expected a JSON object")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in obj:
                    raise TraceError(
                        f"{where}: missing field {key!r} (a JSONL trace has "
                        "timestamp (ms), input_length, output_length)"
                    )
            prompt_len = _length(obj["input_length"], "input_length", where)
            hashes, tokens = obj.get("hash_ids"), obj.get("token_ids")
            entries.append(
                TraceEntry(
                    _time(obj["timestamp"], "timestamp", where) / 1e3,
                    prompt_len,
                    _length(obj["output_length"], "output_length", where),
                    None if hashes is None else _hash_ids(hashes, prompt_len, where),
                    None if tokens is None else _token_ids(tokens, prompt_len, where),
                )
            )
    return entries


def load_trace(name: str | Path, limit: int | None = None) -> list[TraceEntry]:
    """Entries in file order (the first `limit` if given), times relative to the first."""
    path = resolve_trace(name)
    jsonl = path.suffix == ".jsonl" or path.suffixes[-2:] == [".jsonl", ".gz"]
    entries = _load_jsonl(path, limit) if jsonl else _load_csv(path, limit)
    if not entries:
        raise TraceError(f"{path}: holds no requests")
    if entries[0].arrival_s is not None:
        start = min(e.arrival_s for e in entries)
        entries = [
            TraceEntry(e.arrival_s - start, e.prompt_len, e.output_len, e.hash_ids, e.token_ids)
            for e in entries
        ]
    return entries
