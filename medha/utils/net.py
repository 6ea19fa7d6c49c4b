"""Loopback networking helpers shared by the worker processes, the tests and the benchmarks."""

from __future__ import annotations

import socket


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now (the OS picks it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_healthy(proc, url: str, deadline: float, what: str | None = None) -> None:
    """Poll `url`/health until it answers 200; RuntimeError when `proc` (a Popen) exits first
    or the monotonic clock passes `deadline`. `what` names the server in the errors."""
    import time

    import httpx

    what = what or url
    while True:
        if proc.poll() is not None:
            raise RuntimeError(f"{what} exited with {proc.returncode}")
        if time.monotonic() > deadline:
            raise RuntimeError(f"no /health answer from {url} in time")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)


def stop_processes(procs: list, timeout_s: float) -> None:
    """SIGTERM to all first (they drain side by side), then wait up to `timeout_s` in all;
    kill what outlives it."""
    import signal
    import subprocess
    import time

    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
