"""bench/route/route_slo.py's references for a run: its digital twin (the run's requests as a trace,
replayed by `medha simulate` on two replicas under the contender's dispatcher) and the prefix
hit rate of one cache holding both replicas' (the reference a router's cluster hit rate is held
to).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from medha.benchmark.route_report import LONG_THRESHOLD, summarize

_TOKENIZER = None


def _tokens(payload) -> list[int]:
    """The token ids a medha replica computes for a request's prompt or messages (its own
    tokenizer and chat template)."""
    global _TOKENIZER
    if _TOKENIZER is None:
        from medha.engine.tokenizer import Tokenizer
        from medha.perf.hardware_specs import cache_dir

        _TOKENIZER = Tokenizer(cache_dir() / "models" / "smollm2-135m-instruct")
    if isinstance(payload, str):
        return _TOKENIZER.encode(payload)
    return _TOKENIZER.apply_chat_template(payload)


def twin_trace(results: list) -> list[dict]:
    """The run's requests as a JSONL trace (Mooncake's fields plus token_ids): sent times,
    prompt tokens, output lengths, for `medha simulate` to replay."""
    rows = []
    for r in sorted((r for r in results if r.payload is not None), key=lambda r: r.sent_s):
        ids = _tokens(r.payload)
        out = r.completion_tokens or 1
        rows.append(
            {"timestamp": round(r.sent_s * 1e3, 3), "input_length": len(ids),
             "output_length": out, "token_ids": ids, "ok": r.status == "ok",
             "ttft_s": r.ttft_s}
        )  # fmt: skip
    return rows


def one_cache_hit_rate(rows: list[dict], capacity_tokens: int, block: int = 16) -> float | None:
    """The prefix hit rate of one cache holding both replicas' (an LRU of `capacity_tokens`,
    16-token chained block keys, every earlier prompt in it): the reference a router's
    cluster hit rate is held to."""
    from medha.core.request import Request
    from medha.route.tracked import PrefixIndex
    from medha.scheduler.prefix_cache import cacheable_pages

    index = PrefixIndex(capacity_tokens // block)
    hits = total = 0
    for i, row in enumerate(rows):
        r = Request.from_tokens(f"r{i}", 0.0, row["token_ids"], row["output_length"])
        keys, per, limit = cacheable_pages(r, block)
        hits += index.match(keys, limit) * per * block
        total += r.prompt_len
        index.add(keys)
    return hits / total if total else None


def simulate_twin(cell: dict, profile: str) -> float | None:
    """`medha simulate` of the cell's requests on two replicas under the contender's
    dispatcher and the replicas' profile: its short-request TTFT p50."""
    dispatcher = cell["contender"].removeprefix("medha-")
    trace = Path(cell["twin_trace"])
    sim_out = trace.with_suffix("")
    subprocess.run(
        [sys.executable, "-m", "medha", "simulate", "--model", "smollm2-135m", "--hardware",
         "cpu", "--predictor", f"profiled:{profile}", "--trace", str(trace), "--replicas", "2",
         "--dispatcher", dispatcher, "--prefix-cache", "device", "--kv-memory-gb", "2",
         "--long-threshold", str(LONG_THRESHOLD), "--out", str(sim_out), "--no-plots",
         "--overwrite"],
        check=True, stdout=subprocess.DEVNULL,
    )  # fmt: skip
    summary = json.loads((sim_out / "summary.json").read_text())
    return summary["by_class"]["short"]["ttft_s"]["p50"]


def twins(cells: list[dict], profile: str) -> list[dict]:
    """Each medha contender's run against its twin: short-request TTFT p50."""
    out = []
    for cell in cells:
        if not cell["contender"].startswith("medha-"):
            continue
        measured = summarize([cell])["short_ttft_p50_s"]
        simulated = simulate_twin(cell, profile)
        if measured and simulated is not None:
            out.append(
                {"contender": cell["contender"], "workload": cell["workload"],
                 "round": cell["round"], "measured_s": measured, "simulated_s": simulated,
                 "error": (simulated - measured) / measured}
            )  # fmt: skip
    return out
