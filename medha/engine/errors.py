"""What can go wrong, and whose problem it is.

One rule, here, decides whether an error ends one request or the engine, so that the engine,
the server and the Python API agree on it:

- A request refused before admission raises `InvalidRequestError` (HTTP 400, naming the field).
  Admission is all or nothing: a refused request leaves no trace in the engine.
- An error raised while the engine works on one request's own part of a step (its rows of the
  batch's inputs, its sampling, logprobs, stop strings, detokenization) is that request's: it
  ends with finish_reason "error" and every other request goes on. Code that works on one
  request runs under `blame(request_id)`, which turns such errors into `RequestFailedError`.
- A forward pass that fails in one process is re-run in halves to find the request it fails
  on (medha/engine/isolation.py); the request is blamed only if the error follows it.
- Everything else is fatal (`is_fatal`, or any error the engine cannot attribute): a dead
  worker process, a device error, exhausted memory, a failure inside the collectives of a
  multi-process step, or the scheduler's bookkeeping. Every request then fails, `/health`
  answers 503 and new requests get 503.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from contextlib import contextmanager


class EngineError(ValueError):
    """A problem with the model, checkpoint or configuration that the user can fix; the
    message says what and where (the CLI exits 2 with it)."""


class InvalidRequestError(ValueError):
    """A request refused before admission; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class RequestFailedError(RuntimeError):
    """An admitted request that could not go on; the engine ended it alone."""

    def __init__(self, request_id: str, cause: BaseException | str) -> None:
        self.request_id = request_id
        self.detail = cause if isinstance(cause, str) else f"{type(cause).__name__}: {cause}"
        super().__init__(f"request {request_id} failed: {self.detail}")


class EngineDeadError(RuntimeError):
    """The engine stopped after a fatal error; every request fails and new ones are refused."""


# Messages of errors that torch raises as plain RuntimeErrors from a broken device or a
# broken process group (older torch builds, gloo and NCCL).
_FATAL_MESSAGES = (
    "CUDA error",
    "CUBLAS_STATUS",
    "CUDNN_STATUS",
    "NCCL",
    "Connection closed by peer",
    "Connection reset by peer",
    "Broken pipe",
)


def is_fatal(error: BaseException) -> bool:
    """True for errors after which the engine cannot be trusted, whichever request was being
    worked on: exhausted memory, a device error, a lost worker or process group."""
    if isinstance(error, RequestFailedError):
        return False  # blame() lets fatal errors through unwrapped
    if not isinstance(error, Exception) or isinstance(error, MemoryError):
        return True  # KeyboardInterrupt, SystemExit
    torch = sys.modules.get("torch")  # never imported for this: no torch, no torch errors
    if torch is not None and isinstance(
        error, (torch.OutOfMemoryError, getattr(torch, "AcceleratorError", ()))
    ):
        return True
    return isinstance(error, RuntimeError) and any(m in str(error) for m in _FATAL_MESSAGES)


@contextmanager
def blame(request_id: str) -> Iterator[None]:
    """Errors raised inside are `request_id`'s alone (RequestFailedError), unless fatal."""
    try:
        yield
    except Exception as e:
        if isinstance(e, RequestFailedError) or is_fatal(e):
            raise
        raise RequestFailedError(request_id, e) from e
