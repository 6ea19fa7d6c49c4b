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
    log_level: str = field(default="info", metadata={"help": "uvicorn log level"})


def max_request_bytes(config: ServerConfig, max_model_len: int) -> int:
    """The body limit: the flag, else room for a context of tokens written the longest way
    JSON allows (a long token, escaped) plus the rest of a request."""
    if config.max_request_bytes is not None:
        return config.max_request_bytes
    return 64 * max_model_len + (1 << 20)
