"""The server's settings (`medha serve` flags). No FastAPI or torch here: the CLI builds its
parser from ServerConfig without importing the server."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class ServerConfig:
    host: str = field(default="127.0.0.1", metadata={"help": "address to listen on"})
    port: int = field(default=8000, metadata={"help": "TCP port (0: any free port)"})
    api_key: str | None = field(
        default=None,
        metadata={
            "help": ("require `Authorization: Bearer KEY` on /v1 (default: $MEDHA_API_KEY if set)")
        },
    )
    served_model_name: str | None = field(
        default=None,
        metadata={
            "help": ("the model id clients send and /v1/models lists (default: the --model value)")
        },
    )
    max_waiting: int = field(
        default=256,
        metadata={
            "help": (
                "requests waiting for their first token before new ones get 429 with Retry-After"
            )
        },
    )
    drain_timeout_s: float = field(
        default=30.0,
        metadata={
            "help": ("on SIGTERM, seconds in-flight requests get to finish before they are aborted")
        },
    )
    max_request_bytes: int | None = field(
        default=None,
        metadata={
            "help": (
                "request bodies above this size get 413 before they are read (default: 64 bytes "
                "per token of the model's context + 1 MiB, room for any prompt that fits)"
            )
        },
    )
    max_buffered_bytes: int | None = field(
        default=None,
        metadata={
            "help": (
                "bytes of all request bodies being received at once; a body that would pass it "
                "gets 429 with Retry-After (default: 16 x the body limit, --max-request-bytes)"
            )
        },
    )
    log_level: str = field(default="info", metadata={"help": "uvicorn log level"})


def max_request_bytes(config: ServerConfig, max_model_len: int) -> int:
    """The body limit: the flag, else room for a context of tokens written the longest way
    JSON allows (a long token, escaped) plus the rest of a request."""
    if config.max_request_bytes is not None:
        return config.max_request_bytes
    return 64 * max_model_len + (1 << 20)


def max_buffered_bytes(config: ServerConfig, max_model_len: int) -> int:
    """The cap on the bytes of all bodies being received: the flag, else room for 16 bodies at
    the size limit. ValueError when it is below the size limit (every large body would get
    429) or either is not a positive integer."""
    per_body = max_request_bytes(config, max_model_len)
    total = config.max_buffered_bytes
    if total is None:
        total = 16 * per_body
    for name, value in (("max-request-bytes", per_body), ("max-buffered-bytes", total)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"--{name} must be a positive integer, got {value!r}")
    if total < per_body:
        raise ValueError(
            f"--max-buffered-bytes ({total}) must be at least the body limit, "
            f"--max-request-bytes ({per_body})"
        )
    return total
