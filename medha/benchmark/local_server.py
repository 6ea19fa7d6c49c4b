"""Start an OpenAI-compatible server on a free loopback port for a benchmark (or a test that
drives one, tests/test_vllm_executor.py), and stop it."""

from __future__ import annotations

import signal
import socket
import subprocess
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from medha.utils.net import free_port, wait_healthy

START_TRIES = 3  # starts on a fresh free port, when another process took the one picked


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
    open file that gets the server's stdout and stderr. `port`: this one rather than a free one.

    A port found free is free only then: a server that exits at start-up while another
    process holds its port is started again on another (START_TRIES in all)."""
    out = log if log is not None else subprocess.DEVNULL if quiet else None
    deadline = time.monotonic() + startup_s
    for attempt in range(1, START_TRIES + 1):
        chosen = port or free_port()
        proc = subprocess.Popen(
            command(chosen), stdout=out, stderr=subprocess.STDOUT if log else out
        )
        url = f"http://127.0.0.1:{chosen}"
        try:
            wait_healthy(proc, url, deadline, str(command(chosen)[:3]))
            break
        except RuntimeError:
            lost_port = port is None and proc.poll() is not None and port_taken(chosen)
            if not lost_port or attempt == START_TRIES:
                _stop(proc)
                raise
    try:
        yield (url, proc) if with_process else url
    finally:
        _stop(proc)


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(120)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def port_taken(port: int) -> bool:
    """Whether some process holds `port` on 127.0.0.1 now (binding it fails)."""
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False
