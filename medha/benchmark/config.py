"""The settings of `medha bench`: a module of its own so that building the CLI's parser does not
import httpx or matplotlib."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from medha.benchmark.workload import WORKLOAD_HELP


@dataclass
class BenchConfig:
    url: str = field(
        default="http://127.0.0.1:8000",
        metadata={"help": ("server base URL (with or without /v1)")},
    )
    trace: str | None = field(
        default=None,
        metadata={
            "help": (
                "request lengths (and times, if it has them and --qps is not given) from a trace: "
                "a bundled name (sharegpt, arxiv, ...) or a CSV/JSONL file, e.g. a previous run's "
                "requests.csv"
            )
        },
    )
    workload: str | None = field(default=None, metadata={"help": WORKLOAD_HELP})
    qps: float | None = field(default=None, metadata={"help": "Poisson arrival rate (req/s)"})
    num_requests: int = field(default=200, metadata={"help": "requests to send"})
    out: str = field(
        default="runs/bench",
        metadata={"help": ("output folder: summary.json, requests.csv, CDF plots")},
    )
    endpoint: str = field(
        default="completions",
        metadata={
            "help": (
                "completions (prompts as token ids, exact lengths), text (/v1/completions with "
                "text prompts of that many words, one SmolLM2 token each: for a router that "
                "takes no token ids, as SGLang's) or chat (text prompts of about that many tokens)"
            )
        },
    )
    model: str | None = field(
        default=None,
        metadata={"help": ("model id to request (default: the first of the server's /v1/models)")},
    )
    api_key: str | None = field(
        default=None,
        metadata={"help": ("bearer token (default: $OPENAI_API_KEY or $MEDHA_API_KEY)")},
    )
    ignore_eos: bool = field(
        default=True,
        metadata={
            "help": (
                "send ignore_eos so every request produces exactly its output length (vLLM and "
                "medha extension)"
            )
        },
    )
    ttft_slo_s: float = field(default=1.0, metadata={"help": "TTFT target for attainment"})
    tpot_slo_s: float = field(default=0.2, metadata={"help": "TPOT target for attainment"})
    ttft_slo_per_token_s: float = field(
        default=0.0,
        metadata={
            "help": (
                "the TTFT target grows by this much a prompt token (ttft_slo_s plus this times "
                "the prompt: the Medha paper's deadlines scale with the prompt)"
            )
        },
    )
    send_slo: bool = field(
        default=False,
        metadata={
            "help": (
                "send each request's TTFT and TPOT targets in the medha extension (`medha: "
                "{ttft_slo_s, tpot_slo_s}`), which medha's servers schedule for; other servers "
                "ignore it or refuse the field"
            )
        },
    )
    send_tpot_slo: bool = field(
        default=True,
        metadata={
            "help": (
                "with --send-slo, the TPOT target too (off: the TTFT deadline alone, so that a "
                "run can tell what the TPOT target changes in medha's steps)"
            )
        },
    )
    send_priority: bool = field(
        default=False,
        metadata={
            "help": (
                "send vLLM's `priority` field, the prompt's length in tokens: a vLLM server "
                "started with --scheduling-policy priority then takes the shortest waiting "
                "prompt first (lower runs earlier; ties in arrival order), as a user who "
                "tunes vLLM for a mixed load would; vLLM under fcfs and medha's servers "
                "ignore it"
            )
        },
    )
    long_threshold: int | None = field(
        default=None,
        metadata={
            "help": (
                "prompts of at least this many tokens count as long in the by-class tables "
                "(default: the scheduler's default, min(32768, max_model_len / 4), of the "
                "max_model_len the server's /v1/models reports; 32768 if it reports none)"
            )
        },
    )
    seed: int = field(default=0, metadata={"help": "seed of lengths, arrivals and prompts"})
    timeout_s: float = field(default=600.0, metadata={"help": "per-request timeout"})

    def __post_init__(self) -> None:
        if self.endpoint not in ("completions", "text", "chat"):
            raise ValueError(f"endpoint must be completions, text or chat, got {self.endpoint!r}")
        if self.trace and self.workload:
            raise ValueError("give --trace or --workload, not both")
        if self.qps is not None and not self.qps > 0:
            raise ValueError(f"qps must be positive, got {self.qps}")
        if self.long_threshold is not None and self.long_threshold < 1:
            raise ValueError(f"long_threshold must be positive, got {self.long_threshold}")
        if self.num_requests < 1:
            raise ValueError(f"num_requests must be at least 1, got {self.num_requests}")
        for name in ("ttft_slo_s", "tpot_slo_s"):
            if not 0 < getattr(self, name) < math.inf:
                raise ValueError(f"{name} must be positive and finite, got {getattr(self, name)}")
        if not 0 <= self.ttft_slo_per_token_s < math.inf:
            raise ValueError(
                f"ttft_slo_per_token_s must be >= 0 and finite, got {self.ttft_slo_per_token_s}"
            )

    def ttft_target_s(self, prompt_len: int) -> float:
        """A request's TTFT target: ttft_slo_s plus ttft_slo_per_token_s a prompt token."""
        return self.ttft_slo_s + self.ttft_slo_per_token_s * prompt_len
