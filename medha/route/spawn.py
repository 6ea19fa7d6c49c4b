"""`medha route --spawn N`: N local `medha serve` replicas for a one-command try, each bound to its
share of this machine's cores (an engine sizes its threads to the cores it may use)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager

from medha.utils.net import free_port, stop_processes, wait_healthy

STARTUP_S = 600.0  # a first start converts the embedded model


def core_groups(n: int, cores: list[int]) -> list[list[int]]:
    """`cores` split into `n` groups as even as they go; with fewer cores than replicas, the
    replicas share them in turn."""
    if n <= len(cores):
        size, extra = divmod(len(cores), n)
        groups, start = [], 0
        for i in range(n):
            end = start + size + (i < extra)
            groups.append(cores[start:end])
            start = end
        return groups
    return [[cores[i % len(cores)]] for i in range(n)]


def _child_setup(cores: list[int]) -> None:
    """In the replica's process before it starts: its cores, and SIGTERM when the router dies
    (uvicorn re-raises the SIGTERM it caught once it has shut down, which ends the router
    before the `finally` below runs; Linux's parent-death signal stops the replicas anyway)."""
    os.sched_setaffinity(0, cores)
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # not Linux: the finally below is all there is
        pass


@contextmanager
def spawned_replicas(n: int, extra_args: list[str]) -> Iterator[list[str]]:
    """Start `n` replicas (none: yields []), wait until each answers /health, yield their URLs;
    SIGTERM (then kill) them on the way out."""
    if n <= 0:
        yield []
        return
    cores = sorted(os.sched_getaffinity(0))
    procs: list[tuple[subprocess.Popen, str]] = []
    try:
        for group in core_groups(n, cores):
            port = free_port()
            cmd = [sys.executable, "-m", "medha", "serve", "--port", str(port), *extra_args]
            proc = subprocess.Popen(cmd, preexec_fn=lambda group=group: _child_setup(group))
            url = f"http://127.0.0.1:{port}"
            procs.append((proc, url))
            print(f"medha route: replica {url} on cores {group}", file=sys.stderr, flush=True)
        deadline = time.monotonic() + STARTUP_S
        for proc, url in procs:
            wait_healthy(proc, url, deadline, f"the replica on {url}")
        yield [url for _, url in procs]
    finally:
        stop_processes([proc for proc, _ in procs], 60.0)
