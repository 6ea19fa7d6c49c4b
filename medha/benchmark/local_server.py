"""Start an OpenAI-compatible server on a free loopback port for a benchmark (or a test that
drives one, tests/test_vllm_executor.py), and stop it."""

from __future__ import annotations

import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from medha.utils.net import free_port, wait_healthy


def alternated(names: list[str], rounds: int) -> Iterator[tuple[int, str]]:
    """(round, contender) in the order a side-by-side benchmark runs them: the order flips
    every round, since a 2-core machine's speed drifts over minutes."""
    for rnd in range(rounds):
        for name in names if rnd % 2 == 0 else names[::-1]:
            yield rnd, name


@contextmanager
def local_server(
    command: Callable[[int], list[str]],
    quiet: bool = False,
    startup_s: float = 300.0,
    with_process: bool = False,
    log=None,
    port: int | None = None,
) -> Iterator:
    """Run `command(port)`, wait until its /health answers 200, yield its base URL (with
    `with_process`, the pair (URL, Popen)); SIGTERM (then kill) on the way out. `log`: an
    open file that gets the server's stdout and stderr. `port`: this one rather than a free one."""
    port = port or free_port()
    out = log if log is not None else subprocess.DEVNULL if quiet else None
    proc = subprocess.Popen(command(port), stdout=out, stderr=subprocess.STDOUT if log else out)
    url = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(proc, url, time.monotonic() + startup_s, str(command(port)[:3]))
        yield (url, proc) if with_process else url
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(120)
        except subprocess.TimeoutExpired:
            proc.kill()
